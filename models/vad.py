"""Voice activity detection: Silero VAD (ONNX), one engine batching all sessions.

Each session has a `VadStream` (its model state, 64 samples of context, its pending
audio and its speech/silence bookkeeping). The engine's worker thread takes one
512-sample window (32 ms at 16 kHz) from every stream that has one, runs them as one
batch (far cheaper than one by one: docs/performance.md, "Speech stages"), and repeats
until no stream has a full window.

Decisions per window, as in Silero's own iterator, with hysteresis:

    prob >= threshold            speech (starts a candidate, or cancels a pause)
    prob <  threshold - 0.15     silence (starts a pause while speaking)

A candidate becomes ``speech_start`` once speech has lasted ``min_speech_ms``; a pause
becomes ``speech_end`` once it has lasted ``min_silence_ms``. Positions are sample
indices in the session's 16 kHz stream: a start at the first speech window (less
``speech_pad_ms``, or ``prefix_pad_ms`` when set), an end where the pause began, less
Silero's lag in noticing it (``end_lag_ms``, two windows: the span between the last
sample above -40 dB and the first window below the silence threshold, on our
synthesized speech; figures: docs/performance.md, "Speech stages"), plus
``speech_pad_ms``. A ``pause`` event announces a pause once
it has lasted ``pause_ms`` (shorter than ``min_silence_ms``), so that later stages can
start work that a ``speech_end`` at the same position will confirm; commas and breaths,
which are shorter, do not trigger it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE, pcm16_to_float
from models.handoff import resolve_from_thread
from models.onnx_cpu import cpu_session

log = logging.getLogger("duplex.vad")

SAMPLE_RATE = RUNTIME_RATE
WINDOW = 512
CONTEXT = 64


class VadEventKind(enum.Enum):
    SPEECH_START = "speech_start"
    PAUSE = "pause"  # tentative: speech may resume before min_silence_ms
    SPEECH_END = "speech_end"


@dataclass(frozen=True)
class VadEvent:
    kind: VadEventKind
    position: int  # sample index in the session's 16 kHz stream
    silence_ms: int | None = None  # SPEECH_END: the silence that ended the utterance


@dataclass(frozen=True)
class VadConfig:
    threshold: float = 0.5
    min_speech_ms: int = 96
    min_silence_ms: int = 400
    speech_pad_ms: int = 30
    prefix_pad_ms: int | None = None  # kept before a start instead of speech_pad_ms (Realtime's prefix)
    pause_ms: int = 192  # silence before a PAUSE event (commas and breaths are shorter)
    end_lag_ms: int = 64  # Silero's probability stays high this long after speech ends

    def __post_init__(self) -> None:
        if not 0.15 < self.threshold < 1.0:
            raise ValueError("VAD threshold must be within (0.15, 1)")
        pads = (self.speech_pad_ms, self.prefix_pad_ms or 0)
        if min(self.min_speech_ms, self.min_silence_ms, self.pause_ms, *pads) < 0:
            raise ValueError("VAD durations must not be negative")
        if self.pause_ms > self.min_silence_ms:
            raise ValueError("pause_ms must not exceed min_silence_ms")


class VadStream:
    """Per-session VAD state. Feed 16 kHz int16 audio with `push`; read events."""

    def __init__(self, engine: VadEngine, config: VadConfig) -> None:
        self.engine = engine
        self.config = config
        self._loop = asyncio.get_running_loop()
        self.reset()

    def reset(self) -> None:
        self.state = np.zeros((2, 128), dtype=np.float32)
        self.context = np.zeros(CONTEXT, dtype=np.float32)
        self.pending = np.zeros(0, dtype=np.float32)
        self.position = 0  # samples consumed by the model
        self.speaking = False
        self.candidate: int | None = None  # start of a not yet confirmed speech run
        self.pause: int | None = None  # start of the current pause while speaking
        self.pause_announced = False
        self.held: tuple[int, int] | None = None  # (pause start, ms): `hold_pause`
        self._events: list[VadEvent] = []
        self._waiter: asyncio.Future[list[VadEvent]] | None = None

    async def push(self, samples: npt.NDArray[np.int16]) -> list[VadEvent]:
        """Queue audio; returns the events of every full window it completed."""
        if samples.dtype != np.int16:
            raise TypeError(f"VAD takes int16 samples at 16 kHz, got {samples.dtype}")
        assert self._waiter is None, "VadStream.push is not reentrant: await one push at a time"
        self.pending = np.concatenate([self.pending, pcm16_to_float(samples)])
        if self.pending.size < WINDOW:
            return []
        self._waiter = self._loop.create_future()
        self.engine.wake(self)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    # -- called on the engine thread --

    def _decide(self, prob: float, window_start: int) -> None:
        cfg = self.config
        min_speech = cfg.min_speech_ms * SAMPLE_RATE // 1000
        prefix = cfg.speech_pad_ms if cfg.prefix_pad_ms is None else cfg.prefix_pad_ms
        pad = prefix * SAMPLE_RATE // 1000
        window_end = window_start + WINDOW
        if prob >= cfg.threshold:
            self.pause = None
            if not self.speaking:
                if self.candidate is None:
                    self.candidate = window_start
                if window_end - self.candidate >= min_speech:
                    self.speaking = True
                    start = max(0, self.candidate - pad)
                    self._events.append(VadEvent(VadEventKind.SPEECH_START, start))
                    self.candidate = None
        elif prob < cfg.threshold - 0.15:
            self.candidate = None
            if self.speaking:
                if self.pause is None:
                    self.pause, self.pause_announced = window_start, False
                if not self.pause_announced and window_end - self.pause >= cfg.pause_ms * SAMPLE_RATE // 1000:
                    self.pause_announced = True
                    self._events.append(VadEvent(VadEventKind.PAUSE, self._end_position()))
                held, silence_ms = self.held, cfg.min_silence_ms
                if held is not None and held[0] == self.pause:
                    silence_ms = held[1]
                if window_end - self.pause >= silence_ms * SAMPLE_RATE // 1000:
                    self.speaking = False
                    self._events.append(VadEvent(VadEventKind.SPEECH_END, self._end_position(), silence_ms))
                    self.pause = None

    def hold_pause(self, pause: int, silence_ms: int) -> None:
        """The pause that began at ``pause`` (`VadStream.pause`) ends the utterance after
        ``silence_ms`` instead of ``min_silence_ms`` (the caller's words before it sound
        unfinished); any other pause as before. Safe during a push: a window decided
        before it is decided as it was."""
        self.held = (pause, silence_ms)

    def end_now(self) -> int | None:
        """End the utterance in the pause the stream is in, as ``min_silence_ms`` of
        silence would (the caller's turn was judged over sooner): the end position, or
        None when not in a pause. Between pushes only: the engine thread is not on it."""
        assert self._waiter is None, "end_now during a push"
        if not self.speaking or self.pause is None:
            return None
        position = self._end_position()
        self.speaking, self.pause = False, None
        return position

    def _end_position(self) -> int:
        assert self.pause is not None
        lag = (self.config.end_lag_ms - self.config.speech_pad_ms) * SAMPLE_RATE // 1000
        return max(0, self.pause - lag)

    def _finish(self) -> None:
        events, self._events = self._events, []
        if self._waiter is not None:
            resolve_from_thread(self._loop, self._waiter, events)


@dataclass
class VadEngine:
    """The shared Silero model and its worker thread."""

    model_path: str | Path
    windows_run: int = 0
    batches_run: int = 0
    _streams: set[VadStream] = field(default_factory=set)
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _closed: bool = False

    def __post_init__(self) -> None:
        self._session = cpu_session(self.model_path)
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self._thread = threading.Thread(target=self._work, name="vad-engine", daemon=True)
        self._thread.start()

    def stream(self, config: VadConfig | None = None) -> VadStream:
        return VadStream(self, config or VadConfig())

    def wake(self, stream: VadStream) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("VAD engine is closed")
            self._streams.add(stream)
            self._lock.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=5)

    def probabilities(
        self, windows: npt.NDArray[np.float32], state: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """One batched step: windows [B, 64+512] with context, state [2, B, 128]."""
        out, new_state = self._session.run(None, {"input": windows, "state": state, "sr": self._sr})
        return out[:, 0], new_state

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._streams and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                streams, self._streams = list(self._streams), set()
            try:
                self._run(streams)
            except Exception:
                log.exception("VAD batch failed; its streams get no events for it")
            for stream in streams:
                stream._finish()

    def _run(self, streams: list[VadStream]) -> None:
        active = [s for s in streams if s.pending.size >= WINDOW]
        while active:
            windows = np.stack([np.concatenate([s.context, s.pending[:WINDOW]]) for s in active])
            state = np.stack([s.state for s in active], axis=1)
            probs, new_state = self.probabilities(windows, state)
            self.windows_run += len(active)
            self.batches_run += 1
            for i, s in enumerate(active):
                s.state = new_state[:, i, :]
                s.context = s.pending[WINDOW - CONTEXT : WINDOW].copy()
                s.pending = s.pending[WINDOW:]
                s._decide(float(probs[i]), s.position)
                s.position += WINDOW
            active = [s for s in active if s.pending.size >= WINDOW]
