"""`make bench`: every benchmark, results as JSON (and plots) in benchmarks/results/.

Each runs as ``python -m benchmarks.<name>`` in a process of its own: most load their own
engines (vLLM among them, whose shutdown does not give everything back to the process),
and one benchmark's crash or leftovers must not change the next one's figures.
``python -m benchmarks.run tts asr`` runs only those.
"""

from __future__ import annotations

import os
import subprocess
import sys

# DUPLEX_BENCH_TURNS: the conversation benchmark's long session (turns)
TURNS = os.environ.get("DUPLEX_BENCH_TURNS", "100")
# BENCH_SOAK_CYCLES, BENCH_SOAK_MINUTES: the soak's connect/disconnect cycles and long
# session (not DUPLEX_*: the configuration refuses variables of that prefix it does not know)
SOAK_CYCLES = os.environ.get("BENCH_SOAK_CYCLES", "1000")
SOAK_MINUTES = os.environ.get("BENCH_SOAK_MINUTES", "30")
BENCHMARKS: dict[str, list[str]] = {
    "audio_core": [],
    "prepare": [],
    "asr": [],
    "tts": [],
    "ar": [],
    "ar_cpu": [],
    "ar_variants": [],
    "conversation": ["--turns", TURNS],
    "endpoint": [],
    "soak": ["--cycles", SOAK_CYCLES, "--minutes", SOAK_MINUTES],
}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmarks {', '.join(unknown)}; these exist: {', '.join(BENCHMARKS)}")
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    for name, args in BENCHMARKS.items():
        if names and name not in names:
            continue
        print(f"== {name}", flush=True)
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], env=env)
        if done.returncode != 0:
            raise SystemExit(f"benchmarks.{name} failed with exit status {done.returncode}")


if __name__ == "__main__":
    main(sys.argv[1:])
