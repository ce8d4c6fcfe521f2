"""The run of a hostile-input suite (issue 20), shared by the transports' suites.

Each case runs while a neighbour session is heard, under a `LoopLag`; a failed case is
noted and the next one runs, so that one run shows every case. After each case: the
neighbour was heard during or right after it, the loop's lag p99 stayed under 50 ms,
and whatever the suite says must hold again (no session, place or call left) does.

A case whose only fault is the lag runs once more (`lag_tried`), and fails if the lag
comes again: a case that stalls the loop does so each time, while a stall the machine
made once does not (CI saw one such case among eight at p99 129 ms, with the others
at 13-42 and none of it here, alone, in the whole module or beside two busy cores:
1-12 ms). Both runs' figures are kept, with the garbage collector's pauses.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.metrics import LoopLag

MIN_CASE_S = 0.5  # the loop's lag is measured this long at least (a case of 10 ms has no sample)
MAX_LAG_P99_MS = 50.0
Errors = tuple[type[BaseException], ...]


@dataclass
class Lagged:
    """One run of a case: how long it took, the loop's lag meanwhile, the collector's
    pauses (ms) and the error it ended with, if any."""

    took_s: float = 0.0
    lag_ms: list[float] = field(default_factory=list)
    gc_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def p99(self) -> float:
        return float(np.percentile(self.lag_ms, 99)) if self.lag_ms else 0.0

    @property
    def fault(self) -> str | None:
        """What failed, after `lag_tried`: the error, or a lag over the limit twice."""
        if self.error is None and self.p99 >= MAX_LAG_P99_MS:
            return f"loop lag p99 {self.p99:.0f} ms in two runs"
        return self.error

    def figure(self) -> str:
        return (
            f"{self.took_s:.1f} s, loop lag p99 {self.p99:.1f} ms (max {max(self.lag_ms, default=0):.0f}, "
            f"{len(self.lag_ms)} samples), gc pauses {len(self.gc_ms)} "
            f"(longest {max(self.gc_ms, default=0):.0f} ms)"
        )


async def lagged(
    run: Callable[[], Awaitable[None]], min_s: float, timeout_s: float, errors: Errors
) -> Lagged:
    """``run()`` under a `LoopLag` kept on for ``min_s`` at least (its aftermath), and
    the collector's pauses meanwhile; ``errors`` (and assertions, timeouts) are noted."""
    result = Lagged()
    began_gc = [0.0]

    def collecting(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began_gc[0] = time.perf_counter()
        else:
            result.gc_ms.append((time.perf_counter() - began_gc[0]) * 1000)

    lag = LoopLag()
    lag.start()
    await asyncio.sleep(0)  # its timer set: a stall from the case's first step counts
    gc.callbacks.append(collecting)
    began = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            await run()
    except (AssertionError, TimeoutError) + errors as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.took_s = time.monotonic() - began
        await asyncio.sleep(max(0.0, began + min_s - time.monotonic()))
        gc.callbacks.remove(collecting)
        await lag.stop()
        result.lag_ms = lag.samples_ms
    return result


async def lag_tried(
    run: Callable[[], Awaitable[None]], min_s: float, timeout_s: float, errors: Errors
) -> tuple[Lagged, str]:
    """`lagged`, run once more if its only fault was a lag p99 over `MAX_LAG_P99_MS`:
    the last run, and the figures of both."""
    first = await lagged(run, min_s, timeout_s, errors)
    if first.error is not None or first.p99 < MAX_LAG_P99_MS:
        return first, first.figure()
    again = await lagged(run, min_s, timeout_s, errors)
    return again, f"{again.figure()}; its first run: {first.figure()}"


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
        began = time.monotonic()
        run, figure = await lag_tried(functools.partial(case, *args), MIN_CASE_S, 90, errors)
        figures[name] = f"{figure}, neighbour's audio messages meanwhile {heard_since(began)}"
        if run.fault is not None:
            failed[name] = run.fault
        heard = ("the neighbour heard nothing during or right after it", lambda t=began: heard_since(t) > 0)
        for why, holds in [heard, *afterwards]:
            try:
                await until(holds, 30)
            except AssertionError:
                failed.setdefault(name, why)
                break
    return failed, figures
