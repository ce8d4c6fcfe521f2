"""`Inbound`: the caller's audio on its way to be heard: its checks, its queue, when each
part of it arrived, and how loud it is against the echo of what was sent. Bookkeeping;
the session decides what to do with it.

    push(frame) ─► format, overflow ─► queue ─► next(): 16 kHz mono, the residual, arrival
                                                          │
    arrival(position) ◄──── (stream position, time) ◄─────┘  for the last 200 frames

The *residual* is the audio less the reply's echo as the `EchoCanceller` estimates it
(the audio itself without one); the echo gate judges the caller's voice on it, and each
frame's verdict tells the canceller whether it may learn from it. The VAD and ASR hear
the audio as it came. Levels are taken once per 20 ms window (frames of any length are
gathered into windows) and kept for 0.5 s, for the checks over a reply (`may_be_echo`,
`first_above_echo`) to read rather than compute again.

Arrival times are taken when the transport hands a frame over, not when it is heard:
echo checks and latencies must not drift when hearing lags (a loaded machine). A frame
in the wrong format, or one more than ``max_inbound_s`` of queued audio allows, is
refused with a typed error, told once until a good frame comes.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import time

import numpy as np

from audio_io.frame import AudioFrame, Int16Array
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import Resampler, downmix
from duplex.echo import Bands, EchoGate, band_levels_db, level_db
from duplex.echo_canceller import EchoCanceller
from duplex.events import SessionError
from duplex.session_config import SessionConfig

LEVEL_WINDOW = RUNTIME_RATE // 50  # levels are compared over 20 ms
ARRIVALS_KEPT = 200  # frames whose arrival times are kept: 4 s of 20 ms frames
ECHO_CHECK_SAMPLES = RUNTIME_RATE // 2  # speech over the reply is judged on its last 0.5 s
WINDOWS_KEPT = ECHO_CHECK_SAMPLES // LEVEL_WINDOW + 1  # ... of 20 ms windows, and the one it begins in
Window = tuple[int, Bands, Bands]  # where it begins, its judged levels, what the canceller took


class Inbound:
    def __init__(self, config: SessionConfig, echo: EchoGate, canceller: EchoCanceller | None = None) -> None:
        self.rate, self.channels, self.max_s = config.input_rate, config.input_channels, config.max_inbound_s
        self.echo = echo
        self.canceller = canceller
        self._resets = 0  # the canceller's, when the gate last heard of them
        self._pending = np.zeros((1 if canceller is None else 2, 0), np.int16)  # audio (and residual) ...
        self._pending_at = 0  # ... from this stream position, short of a whole window
        # the judged band levels of the last 0.5 s of 20 ms windows, by where each begins,
        # and what the canceller took from each band (dB; 0 without one)
        self._judged: collections.deque[Window] = collections.deque(maxlen=WINDOWS_KEPT)
        self._resampler = Resampler(config.input_rate, RUNTIME_RATE)
        self._queue: asyncio.Queue[tuple[AudioFrame, float]] = asyncio.Queue()  # with arrival time
        self._queued_s = 0.0
        self._told: set[str] = set()  # error codes told since the last good frame
        self._arrivals: list[tuple[int, float]] = []  # (16 kHz stream end position, arrival time)
        self._levels: collections.deque[float] = collections.deque(maxlen=100)  # dBFS, 20 ms each

    def push(self, frame: AudioFrame) -> SessionError | None:
        """Queue a frame from the transport; if it is refused, the error to tell the
        client (None if it was told since the last good frame)."""
        if frame.sample_rate != self.rate or frame.channels != self.channels:
            return self._once(
                SessionError(
                    "bad_audio_format",
                    f"audio at {frame.sample_rate} Hz x{frame.channels}, the session takes "
                    f"{self.rate} Hz x{self.channels}",
                )
            )
        if self._queued_s + frame.duration > self.max_s:
            return self._once(SessionError("input_overflow", "audio arrives faster than real time; dropped"))
        self._told.clear()  # a good frame: the next bad one is told again
        self._queued_s += frame.duration
        self._queue.put_nowait((frame, time.monotonic()))
        return None

    def _once(self, error: SessionError) -> SessionError | None:
        if error.code in self._told:
            return None
        self._told.add(error.code)
        return error

    async def next(self, position: int) -> tuple[Int16Array, Int16Array, float]:
        """The next frame, 16 kHz mono, its residual, and when it arrived; ``position``:
        the stream position it begins at (the `Listener`'s)."""
        frame, arrived = await self._queue.get()
        self._queued_s = max(0.0, self._queued_s - frame.duration)
        samples = self._resampler.process(downmix(frame.samples, frame.channels))
        self._arrivals.append((position + samples.size, arrived))
        del self._arrivals[: max(0, len(self._arrivals) - ARRIVALS_KEPT)]
        canceller = self.canceller
        residual = samples if canceller is None else canceller.cancel(samples, position, arrived)
        windows = self._windows(samples, residual, position)
        if windows is not None:
            self._judge(*windows, arrived)
        return samples, residual, arrived

    def _windows(
        self, samples: Int16Array, residual: Int16Array, position: int
    ) -> tuple[Bands, Bands, Bands] | None:
        """The band levels of the 20 ms windows of the audio, of its residual, and as
        judged (per band the quieter of the two: a canceller that lost the path adds echo,
        it never hides the caller), of the windows this frame completes (a frame need not
        be 20 ms, nor begin a window; None if it completes none). The judged levels, and
        what the canceller took from each band (dB), are kept for `may_be_echo` and
        `first_above_echo`."""
        if position != self._pending_at + self._pending.shape[-1]:  # not where the last frame ended
            self._pending, self._pending_at = self._pending[:, :0], position
        rows = [samples] if self.canceller is None else [samples, residual]
        audio = np.concatenate([self._pending, np.stack(rows)], axis=-1)
        n = audio.shape[-1] // LEVEL_WINDOW
        if n == 0:
            self._pending = audio
            return None
        bands = band_levels_db(audio[:, : n * LEVEL_WINDOW].reshape(len(rows), n, LEVEL_WINDOW), RUNTIME_RATE)
        heard, left = bands[0], bands[-1]
        judged = np.minimum(heard, left)
        with np.errstate(invalid="ignore"):  # silence in and out: nan, nothing taken
            taken = heard - left  # (without a canceller the residual is the audio: 0)
        starts = range(self._pending_at, self._pending_at + n * LEVEL_WINDOW, LEVEL_WINDOW)
        self._judged.extend(zip(starts, judged, taken, strict=True))
        self._pending, self._pending_at = audio[:, n * LEVEL_WINDOW :], self._pending_at + n * LEVEL_WINDOW
        return heard, left, judged

    def _judge(self, heard: Bands, left: Bands, judged: Bands, arrived: float) -> None:
        """New windows of the audio and its residual, arrived at ``arrived``: the gate
        measures the echo at a reply's start (`EchoGate.train`) and what the canceller
        takes away, and the canceller learns from them if the gate hears no caller in
        what it leaves."""
        if self.echo.measuring(arrived):
            self.echo.train(heard, arrived)
        canceller = self.canceller
        if canceller is None or not canceller.echoing:  # nothing played could echo: nothing to learn
            return
        if canceller.resets != self._resets:
            self._resets = canceller.resets
            self.echo.forget_cancellation()
        since = arrived - ECHO_CHECK_SAMPLES / RUNTIME_RATE
        self.echo.observe_cancellation(heard, left, since, arrived)
        # learning stops at any sign of the caller, even where the canceller takes too
        # little now to count it (`EchoGate.callers`): it must never learn their voice
        canceller.adapt(echo_only=not self.echo.callers(judged, since, arrived).any())

    def arrival(self, position: int) -> float:
        """When the audio at this 16 kHz stream position arrived (now, if it has not)."""
        i = bisect.bisect_left(self._arrivals, position, key=lambda arrival: arrival[0])
        return self._arrivals[i][1] if i < len(self._arrivals) else time.monotonic()

    def echoing(self, at: float) -> bool:
        """Audio arriving at ``at`` may hold the echo of what was sent (`EchoGate.active`)."""
        return self.echo.active(at)

    def level(self, samples: Int16Array) -> tuple[float, float]:
        """The level of a frame (dBFS), and the room's: the quietest of the last 100 frames
        (2 s) measured here."""
        level = level_db(samples)
        self._levels.append(level)
        return level, min(self._levels)

    def may_be_echo(self, since: float, now: float) -> bool:
        """The last 20 ms window heard (its residual, with a canceller), arrived at
        ``now``, is no louder than the echo of what was sent from ``since`` on could be."""
        if not self._judged:
            return True
        _, judged, taken = self._judged[-1]
        return self.echo.is_echo(judged, since, now, taken)

    def first_above_echo(self, start: int) -> int | None:
        """The stream position of the first 20 ms window heard from ``start`` on (as far
        back as `ECHO_CHECK_SAMPLES`; the window ``start`` falls in counts from ``start``)
        that is louder, in either band, than the reply's echo could be: than the loudest
        audio sent from 0.4 s before ``start`` until now, less the suppression (the test
        the quick pause makes on each frame): one reference for the whole stretch, since
        a reference per 20 ms window lets the reply's echo interrupt it (figures:
        docs/performance.md, "Duplex runtime"). None if all of it may be echo."""
        windows = [window for window in self._judged if window[0] + LEVEL_WINDOW > start]
        if not windows:
            return None
        judged = np.array([bands for _, bands, _ in windows])
        taken = np.array([took for _, _, took in windows])
        callers = np.flatnonzero(self.echo.callers(judged, self.arrival(start), time.monotonic(), taken))
        return max(start, windows[int(callers[0])][0]) if callers.size else None
