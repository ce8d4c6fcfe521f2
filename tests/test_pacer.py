import asyncio
import statistics
import time

import numpy as np
import pytest

from audio_io.frame import AudioFrame
from audio_io.pacer import Pacer


def frame(i: int = 0) -> AudioFrame:
    return AudioFrame(np.full(320, i % 30000, dtype=np.int16), 16000)


async def busy_neighbour(stop: asyncio.Event) -> None:
    """Hogs the event loop: 4 ms of blocking work every 10 ms, like a careless task."""
    while not stop.is_set():
        end = time.perf_counter() + 0.004
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0.006)


@pytest.mark.timeout(60)
async def test_500_frames_at_20ms_without_drift_on_a_busy_loop():
    pacer = Pacer(period=0.020)
    for i in range(500):
        pacer.put(frame(i))
    stop = asyncio.Event()
    neighbours = [asyncio.create_task(busy_neighbour(stop)) for _ in range(2)]
    released: list[float] = []
    try:
        async for f in pacer.frames():
            released.append(time.monotonic())
            assert f.playout_time is not None
            if len(released) == 500:
                break
    finally:
        stop.set()
        await asyncio.gather(*neighbours)
    periods = np.diff(released)
    assert abs(statistics.fmean(periods) - 0.020) <= 0.0005
    # drift: each frame's release against the ideal grid from the first one
    offsets = np.array(released) - (released[0] + 0.020 * np.arange(500))
    assert abs(offsets[-1]) < 0.020  # drift: the grid is not left behind
    # jitter is the neighbours' fault (4 ms blocks); a stall of the whole machine may
    # delay one frame, but the following frames are back on the grid
    assert np.median(np.abs(offsets)) < 0.005
    assert np.percentile(np.abs(offsets), 99) < 0.020
    assert pacer.frames_sent == 500 and pacer.underruns == 0


async def test_clear_drops_everything_queued_at_once():
    pacer = Pacer(period=0.010)
    for i in range(50):
        pacer.put(frame(i))
    got = []

    async def consume() -> None:
        async for f in pacer.frames():
            got.append(int(f.samples[0]))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.055)
    dropped = pacer.clear()
    sent_at_clear = len(got)
    await asyncio.sleep(0.05)
    pacer.close()
    await asyncio.wait_for(task, 1)
    assert len(got) == sent_at_clear  # nothing queued before clear() left after it
    assert dropped == 50 - sent_at_clear
    assert got == list(range(sent_at_clear))


async def test_underrun_starts_a_new_run_instead_of_bursting():
    pacer = Pacer(period=0.020)
    times: list[float] = []

    async def consume() -> None:
        async for _ in pacer.frames():
            times.append(time.monotonic())

    task = asyncio.create_task(consume())
    pacer.put(frame())
    await asyncio.sleep(0.2)  # ten periods with nothing to send
    pacer.put(frame())
    pacer.put(frame())
    await asyncio.sleep(0.06)
    pacer.close()
    await asyncio.wait_for(task, 1)
    assert len(times) == 3
    assert times[2] - times[1] >= 0.015  # paced, not burst out to catch up
    assert pacer.underruns >= 1


async def test_close_ends_iteration_and_put_after_close_fails():
    pacer = Pacer()
    pacer.close()
    assert [f async for f in pacer.frames()] == []
    with pytest.raises(RuntimeError):
        pacer.put(frame())


async def test_pause_stops_at_once_and_resume_goes_on_with_the_next_frame():
    pacer = Pacer(period=0.010)
    for i in range(20):
        pacer.put(frame(i))
    got: list[int] = []

    async def consume() -> None:
        async for f in pacer.frames():
            got.append(int(f.samples[0]))
            if len(got) == 5:
                pacer.pause()  # synchronous: nothing more may leave
            if len(got) == 20:
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    assert got == [0, 1, 2, 3, 4] and pacer.paused
    assert pacer.queued_frames == 15
    pacer.resume()
    await asyncio.wait_for(task, 2)
    assert got == list(range(20))
    assert pacer.underruns == 0
