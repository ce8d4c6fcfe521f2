"""The run of a hostile-input suite (issue 20), shared by the transports' suites.

Each case runs while a neighbour session is heard, under a `LoopLag`; a failed case is
noted and the next one runs, so that one run shows every case. After each case: the
neighbour was heard during or right after it, the loop's lag p99 stayed under 50 ms,
and whatever the suite says must hold again (no session, place or call left) does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from duplex.metrics import LoopLag

MIN_CASE_S = 0.5  # the loop's lag is measured this long at least (a case of 10 ms has no sample)
MAX_LAG_P99_MS = 50.0


async def until(holds: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not holds():
        assert time.monotonic() < deadline, f"not within {within} s"
        await asyncio.sleep(0.01)


async def run_cases(
    cases: Sequence[Callable[..., Awaitable[None]]],
    args: tuple[Any, ...],
    speaking: Callable[[], Awaitable[None]],
    heard_since: Callable[[float], int],
    afterwards: Sequence[tuple[str, Callable[[], bool]]],
    errors: tuple[type[BaseException], ...],
) -> tuple[dict[str, str], dict[str, str]]:
    """Run each ``case(*args)`` once ``speaking`` has the neighbour talking; what failed
    (a case's error, the lag, the neighbour unheard, ``afterwards`` not holding within
    30 s), and figures for the machine with no hostile client and for every case."""
    failed: dict[str, str] = {}
    figures: dict[str, str] = {}
    lag = LoopLag()  # what the machine does to the loop with no hostile client, for the figures
    lag.start()
    await asyncio.sleep(2)
    await lag.stop()
    figures["no hostile client"] = f"loop lag p99 {np.percentile(lag.samples_ms, 99):.1f} ms"
    for case in cases:
        name = case.__name__
        await speaking()
        lag = LoopLag()
        lag.start()
        began = time.monotonic()
        try:
            async with asyncio.timeout(90):
                await case(*args)
        except (AssertionError, TimeoutError) + errors as e:
            failed[name] = f"{type(e).__name__}: {e}"
        finally:
            took = time.monotonic() - began
            await asyncio.sleep(max(0.0, began + MIN_CASE_S - time.monotonic()))
            await lag.stop()
        p99 = float(np.percentile(lag.samples_ms, 99))
        figures[name] = (
            f"{took:.1f} s, loop lag p99 {p99:.1f} ms (max {max(lag.samples_ms):.0f}), "
            f"neighbour's audio messages meanwhile {heard_since(began)}"
        )
        if p99 >= MAX_LAG_P99_MS:
            failed.setdefault(name, f"loop lag p99 {p99:.0f} ms")
        heard = ("the neighbour heard nothing during or right after it", lambda t=began: heard_since(t) > 0)
        for why, holds in [heard, *afterwards]:
            try:
                await until(holds, 30)
            except AssertionError:
                failed.setdefault(name, why)
                break
    return failed, figures
