"""The hostile suites' measure of a case (`tests.hostile.lag_tried`): a case that stalls
the loop fails in both of its runs, one the machine stalled once passes on its second,
and a case that fails otherwise is not run again."""

from __future__ import annotations

import asyncio
import time

from tests.hostile import MAX_LAG_P99_MS, lag_tried

STALL_S = 0.15  # the loop held this long, three times the limit


def stalls(times: int):
    """A case that holds the loop (a blocking call on it) in its first ``times`` runs."""
    runs = []

    async def case() -> None:
        runs.append(1)
        if len(runs) <= times:
            for _ in range(3):  # three stalls: the p99 of ~40 samples is one of them
                time.sleep(STALL_S)  # noqa: ASYNC251 (the stall under test)
                await asyncio.sleep(0.02)

    return case, runs


async def test_a_case_that_stalls_the_loop_each_time_fails_in_two_runs():
    case, runs = stalls(times=2)
    run, figure = await lag_tried(case, 0.5, 10, ())
    assert len(runs) == 2 and run.error is None
    assert run.p99 >= MAX_LAG_P99_MS
    assert run.fault is not None and run.fault.endswith("ms in two runs")
    assert "its first run" in figure


async def test_a_stall_that_comes_once_passes_on_the_second_run():
    case, runs = stalls(times=1)
    run, figure = await lag_tried(case, 0.5, 10, ())
    assert len(runs) == 2
    assert run.p99 < MAX_LAG_P99_MS and run.fault is None
    assert "its first run" in figure


async def test_a_case_with_no_stall_runs_once():
    case, runs = stalls(times=0)
    run, figure = await lag_tried(case, 0.5, 10, ())
    assert len(runs) == 1 and run.p99 < MAX_LAG_P99_MS
    assert "its first run" not in figure


async def test_a_case_that_fails_otherwise_runs_once_and_keeps_its_error():
    runs = []

    async def case() -> None:
        runs.append(1)
        time.sleep(STALL_S * 3)  # noqa: ASYNC251 (a stall too, but the error is what counts)
        raise AssertionError("refused with the wrong code")

    run, _ = await lag_tried(case, 0.5, 10, ())
    assert len(runs) == 1
    assert run.fault == run.error == "AssertionError: refused with the wrong code"
