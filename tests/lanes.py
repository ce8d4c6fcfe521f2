"""``make test``'s pytest, in two lanes at once: ``python -m tests.lanes [PYTEST ARGS]``.

- The paced lane: every test that plays audio at a call's pace or depends on being
  answered in time (barge-in, echo, loop lag, SIGTERM within 5 s), at normal priority.
- The background lane: the modules marked ``background``, which need CPU but no pace
  (building and installing the wheel, compiling, converting, offline transcription,
  the engines' bookkeeping, the command-line checks), at the lowest priority the
  kernel has (`lowest`): they get only the CPU the paced lane leaves unused, so the
  paced lane's timing is what it was alone. Alone, the whole suite kept the two cores
  43-48% busy on average (docs/performance.md, "The test suite's time").

Either lane's failure fails the run. The background lane's report is printed after the
paced lane's, from its log (``tests/artifacts/pytest-background.log``); each lane has a
temporary directory of its own. Plain ``pytest`` still runs everything in one process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOG = REPO / "tests" / "artifacts" / "pytest-background.log"
BACKGROUND = "background and not paced"
PACED = "not background or paced"


def lowest(pid: int) -> None:
    """The lane's process, and all it starts (servers, engines, pip, which inherit both):
    the idle scheduling class, in a session of its own whose autogroup has nice 19.
    The idle class alone is idle only against its own autogroup: with autogroups on (as
    on this project's machines), a lane in make's session got a third of the CPU against two
    busy loops in sessions of their own (Chromium, which Playwright starts detached, is
    one) whenever the paced pytest itself waited; 1.6% with its own niced autogroup."""
    os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():  # a kernel without autogroups: the idle class is enough
        autogroup.write_text("19")


def pytest(lane: str, marks: str, args: list[str]) -> list[str]:
    base = Path(tempfile.gettempdir()) / f"duplex-pytest-{lane}"
    return [sys.executable, "-m", "pytest", "-m", marks, f"--basetemp={base}", "-ra", "--durations=30", *args]


def main(args: list[str]) -> int:
    LOG.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    with LOG.open("wb") as log:
        background = subprocess.Popen(
            [*pytest("background", BACKGROUND, args), "-p", "no:cacheprovider"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own autogroup (`lowest`), so Ctrl-C stops it below
        )
        lowest(background.pid)
        print(f"background lane: pid {background.pid}, output in {LOG.relative_to(REPO)}", flush=True)
        try:
            paced = subprocess.run(pytest("paced", PACED, args), cwd=REPO).returncode
            paced_s = time.monotonic() - started
            waited = background.wait()
        finally:
            if background.poll() is None:  # the paced lane was stopped: the lane and its servers
                os.killpg(background.pid, signal.SIGTERM)
                background.wait()
    print(f"\n{'=' * 30} background lane {'=' * 30}", flush=True)
    sys.stdout.buffer.write(LOG.read_bytes())
    both_s = time.monotonic() - started
    print(f"\npaced lane: exit {paced} after {paced_s:.0f} s; background: {waited}; both: {both_s:.0f} s")
    return paced or waited


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
