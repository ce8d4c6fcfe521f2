"""`Pacer`: releases outbound frames on a real-time clock, without drift.

Frame k of a run is due at ``start + k * period``, computed from one monotonic start,
never by sleeping a fixed period after the previous frame, so scheduling error does not
accumulate: a late wake-up makes one frame late, and the next is due on the same grid.

    queue:  [f0][f1][f2] ...              (filled by TTS, faster than real time)
    grid:   t0   t0+p  t0+2p  ...         (frames leave at these instants)

A run ends when the queue is empty at a frame's due time (an underrun) or falls more
than ``max_lag`` behind; the next frame starts a new run at "now", so audio that
arrives after a pause is not burst out to catch up. `clear` (barge-in) drops every
queued frame at once and is synchronous, so no frame queued before it can leave after.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from audio_io.frame import AudioFrame


class Pacer:
    def __init__(
        self,
        period: float = 0.020,
        max_lag: float = 0.100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if period <= 0:
            raise ValueError("period must be positive")
        self.period = period
        self.max_lag = max_lag
        self._clock = clock
        self._queue: collections.deque[AudioFrame] = collections.deque()
        self._wakeup = asyncio.Event()
        self._closed = False
        self._paused = False
        self._run_start: float | None = None
        self._run_index = 0
        self.frames_sent = 0
        self.frames_dropped = 0
        self.underruns = 0

    def put(self, frame: AudioFrame) -> None:
        if self._closed:
            raise RuntimeError("put() on a closed Pacer")
        self._queue.append(frame)
        self._wakeup.set()

    def clear(self) -> int:
        """Drop every queued frame now; returns how many were dropped."""
        dropped = len(self._queue)
        self._queue.clear()
        self.frames_dropped += dropped
        return dropped

    def pause(self) -> None:
        """No frame leaves until `resume`; the queue is kept."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wakeup.set()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def queued_frames(self) -> int:
        return len(self._queue)

    @property
    def queued_seconds(self) -> float:
        return sum(f.duration for f in self._queue)

    def close(self) -> None:
        """End `frames()` after the frame in flight; idempotent."""
        self._closed = True
        self._wakeup.set()

    def _next_due(self, now: float) -> float:
        if self._run_start is not None:
            due = self._run_start + self._run_index * self.period
            if now - due <= self.max_lag:
                return due
            self.underruns += 1  # fell too far behind: start a new run rather than burst
        self._run_start, self._run_index = now, 0
        return now

    async def frames(self) -> AsyncIterator[AudioFrame]:
        """Yield each queued frame at its due time, with ``playout_time`` set to it."""
        while not self._closed:
            if not self._queue or self._paused:
                if self._run_start is not None and not self._paused:
                    self.underruns += 1
                self._run_start = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            due = self._next_due(self._clock())
            delay = due - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._closed or not self._queue or self._paused:
                continue  # cleared or paused while waiting: nothing of the old queue may leave
            frame = self._queue.popleft()
            self._run_index += 1
            self.frames_sent += 1
            yield replace(frame, playout_time=due)
