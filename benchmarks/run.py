"""`make bench`: every benchmark, results as JSON (and plots) in benchmarks/results/.

Each runs as ``python -m benchmarks.<name>`` in a process of its own: most load their own
engines (vLLM among them, whose shutdown does not give everything back to the process),
and one benchmark's crash or leftovers must not change the next one's figures.
``python -m benchmarks.run tts asr`` runs only those.

Settings come from ``BENCH_*`` environment variables (`SETTINGS`), not ``DUPLEX_*``: that
prefix is the service's configuration, whose reader refuses every ``DUPLEX_`` variable
it does not know, so that a misspelt setting is an error rather than silently ignored.
The benchmarks read that configuration too (the same ``DUPLEX_*`` as ``duplex serve``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from duplex.config import ENV_PREFIX


@dataclass(frozen=True)
class Setting:
    variable: str
    default: str
    meaning: str
    benchmark: str  # the benchmark, and its flag, that the value goes to
    flag: str
    kind: type[int] | type[float] = int


SETTINGS = (
    Setting(
        "BENCH_TURNS", "100", "the conversation benchmark's long session, in turns", "conversation", "--turns"
    ),
    Setting("BENCH_SOAK_CYCLES", "1000", "the soak's connect/disconnect cycles", "soak", "--cycles"),
    Setting("BENCH_SOAK_MINUTES", "30", "the soak's long session, in minutes", "soak", "--minutes", float),
)
NAMES = (
    "audio_core",
    "prepare",
    "asr",
    "tts",
    "ar",
    "ar_cpu",
    "ar_variants",
    "conversation",
    "endpoint",
    "tools",
    "soak",
)


class SettingError(ValueError):
    pass


def benchmarks(environ: Mapping[str, str]) -> dict[str, list[str]]:
    """Each benchmark's command-line flags from the ``BENCH_*`` settings in ``environ``;
    `SettingError` for a value that is not a positive number, or a setting under the
    old ``DUPLEX_BENCH_`` name."""
    old = sorted(v for v in environ if v.startswith(ENV_PREFIX + "BENCH_"))
    if old:
        new = ", ".join(f"{v} is now {v.removeprefix(ENV_PREFIX)}" for v in old)
        raise SettingError(
            f"benchmark settings are BENCH_*, not {ENV_PREFIX}BENCH_* ({ENV_PREFIX}* is the service's "
            f"configuration): {new}"
        )
    flags: dict[str, list[str]] = {name: [] for name in NAMES}
    for setting in SETTINGS:
        value = environ.get(setting.variable, setting.default).strip()
        try:
            positive = setting.kind(value) > 0
        except ValueError:
            positive = False
        if not positive:
            kind = "a whole number" if setting.kind is int else "a number"
            raise SettingError(f"{setting.variable}={value!r}: expected {kind} above 0 ({setting.meaning})")
        flags[setting.benchmark] += [setting.flag, value]
    return flags


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise SystemExit(f"unknown benchmarks {', '.join(unknown)}; these exist: {', '.join(NAMES)}")
    try:
        flags = benchmarks(os.environ)
    except SettingError as e:
        raise SystemExit(f"make bench: {e}") from None
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    for name, args in flags.items():
        if names and name not in names:
            continue
        print(f"== {name}", flush=True)
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], env=env)
        if done.returncode != 0:
            raise SystemExit(f"benchmarks.{name} failed with exit status {done.returncode}")


if __name__ == "__main__":
    main(sys.argv[1:])
