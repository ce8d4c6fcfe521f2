"""``make test``'s pytest, in two lanes at once: ``python -m tests.lanes [PYTEST ARGS]``.

- The paced lane: every test that plays audio at a call's pace or depends on being
  answered in time (barge-in, echo, loop lag, SIGTERM within 5 s), at normal priority.
- The background lane: the modules marked ``background``, which need CPU but no pace
  (building and installing the wheel, compiling, converting, offline transcription,
  the engines' bookkeeping, the command-line checks), at the kernel's idle priority
  (``SCHED_IDLE``): they get only the CPU the paced lane leaves unused, so the paced
  lane's timing is what it was alone. Alone, the whole suite kept the two cores 43%
  busy on average (docs/performance.md, "The test suite's time").

Either lane's failure fails the run. The background lane's report is printed after the
paced lane's, from its log (``tests/artifacts/pytest-background.log``); each lane has a
temporary directory of its own. Plain ``pytest`` still runs everything in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOG = REPO / "tests" / "artifacts" / "pytest-background.log"
BACKGROUND = "background and not paced"
PACED = "not background or paced"


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
        )
        # the kernel's idle class, inherited by all the lane starts (servers, engines, pip)
        os.sched_setscheduler(background.pid, os.SCHED_IDLE, os.sched_param(0))
        print(f"background lane: pid {background.pid}, output in {LOG.relative_to(REPO)}", flush=True)
        try:
            paced = subprocess.run(pytest("paced", PACED, args), cwd=REPO).returncode
            paced_s = time.monotonic() - started
            waited = background.wait()
        finally:
            if background.poll() is None:
                background.terminate()
                background.wait()
    print(f"\n{'=' * 30} background lane {'=' * 30}", flush=True)
    sys.stdout.buffer.write(LOG.read_bytes())
    both_s = time.monotonic() - started
    print(f"\npaced lane: exit {paced} after {paced_s:.0f} s; background: {waited}; both: {both_s:.0f} s")
    return paced or waited


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
