"""Streaming format conversion: resampling (soxr), down-mixing, re-framing.

Resampling uses soxr's *variable-rate* engine (``vr=True``) at a fixed ratio: it emits
a steady 20 ms out per 20 ms in, with a constant delay, where the default constant-rate
engine holds output back and releases it in bursts, later than pacing and barge-in can
afford. soxr trims its own filter delay; what remains is a constant delay of at most 2
samples at the output rate, and chunked output equals one-shot output (figures:
docs/performance.md, "Audio core").
Samples are processed in float32 and rounded back to int16 here, so that rounding is the
same however the signal is chunked.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import soxr

from audio_io.frame import AudioFrame
from audio_io.pcm import pcm16_to_float

Int16Array = npt.NDArray[np.int16]


def downmix(samples: Int16Array, channels: int) -> Int16Array:
    """Interleaved multi-channel int16 -> mono int16 (mean of the channels, rounded)."""
    if channels == 1:
        return samples
    if samples.size % channels:
        raise ValueError(f"{samples.size} samples do not divide into {channels} channels")
    mean = samples.reshape(-1, channels).astype(np.int32).sum(axis=1) / channels
    return np.clip(np.rint(mean), -32768, 32767).astype(np.int16)


def _to_int16(x: npt.NDArray[np.float32]) -> Int16Array:
    # the exact inverse of pcm16_to_float (x 32768, not 32767), so that resampling at
    # the same rate, or a filter with unity gain, gives back the same samples
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)


class Resampler:
    """Stateful mono resampler: feed int16 chunks, get int16 chunks, no boundary clicks.

    Per-stream state lives in the soxr handle; one instance per direction per session.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._quality = quality
        self._stream: soxr.ResampleStream | None = None
        self.reset()

    def reset(self) -> None:
        """Forget all history (e.g. after a flush), as if newly made."""
        if self.in_rate == self.out_rate:
            self._stream = None
        else:
            self._stream = soxr.ResampleStream(
                self.in_rate, self.out_rate, 1, dtype="float32", quality=self._quality, vr=True
            )

    def process(self, samples: Int16Array, last: bool = False) -> Int16Array:
        """Resample one chunk; with ``last`` the filter tail is flushed too."""
        if self._stream is None:
            return samples
        return _to_int16(self._stream.resample_chunk(pcm16_to_float(samples), last=last))

    def flush(self) -> Int16Array:
        """Drain the filter tail at the end of a stream; the resampler is then reset."""
        tail = self.process(np.zeros(0, dtype=np.int16), last=True)
        self.reset()
        return tail


def resample(samples: Int16Array, in_rate: int, out_rate: int) -> Int16Array:
    """One-shot resampling of a whole signal, equal to streaming it through `Resampler`."""
    return Resampler(in_rate, out_rate).process(samples, last=True)


class Reframer:
    """Cuts a mono stream of arbitrary chunk sizes into fixed-duration frames.

    ``capture_time`` of each output frame is derived from the first input chunk's
    timestamp plus the sample position, so timestamps stay exact across re-framing.
    """

    def __init__(self, sample_rate: int, frame_ms: int = 20) -> None:
        if (sample_rate * frame_ms) % 1000:
            raise ValueError(f"{frame_ms} ms is not a whole number of samples at {sample_rate} Hz")
        self.sample_rate = sample_rate
        self.frame_samples = sample_rate * frame_ms // 1000
        self._buffer = np.zeros(0, dtype=np.int16)
        self._emitted = 0  # samples already handed out in frames
        self._t0: float | None = None  # capture time of sample 0

    def push(self, samples: Int16Array, capture_time: float | None = None) -> list[AudioFrame]:
        if self._t0 is None and capture_time is not None:
            self._t0 = capture_time - (self._emitted + self._buffer.size) / self.sample_rate
        self._buffer = np.concatenate([self._buffer, samples]) if self._buffer.size else samples.copy()
        frames: list[AudioFrame] = []
        n = self.frame_samples
        while self._buffer.size >= n:
            chunk, self._buffer = self._buffer[:n], self._buffer[n:]
            t = None if self._t0 is None else self._t0 + self._emitted / self.sample_rate
            frames.append(AudioFrame(np.ascontiguousarray(chunk), self.sample_rate, 1, t))
            self._emitted += n
        return frames

    @property
    def pending_samples(self) -> int:
        return self._buffer.size

    def reset(self) -> None:
        self._buffer = np.zeros(0, dtype=np.int16)
        self._emitted = 0
        self._t0 = None


class FrameResampler:
    """Audio at any rate in, whole frames (20 ms) at ``out_rate`` out: what a transport
    that sends fixed frames needs from the voice's output. `finish` (the reply ended)
    sends the held remainder padded with silence; `reset` (barge-in) drops it."""

    def __init__(self, out_rate: int, frame_ms: int = 20) -> None:
        self.out_rate = out_rate
        self._resampler: Resampler | None = None
        self._reframer = Reframer(out_rate, frame_ms)

    def push(self, samples: Int16Array, in_rate: int) -> list[Int16Array]:
        if self._resampler is None or self._resampler.in_rate != in_rate:
            self._resampler = Resampler(in_rate, self.out_rate)
        return [f.samples for f in self._reframer.push(self._resampler.process(samples))]

    def finish(self) -> list[Int16Array]:
        tail = self._resampler.flush() if self._resampler is not None else np.zeros(0, np.int16)
        pending = self._reframer.pending_samples + tail.size
        pad = np.zeros(-pending % self._reframer.frame_samples, np.int16)
        frames = [f.samples for f in self._reframer.push(np.concatenate([tail, pad]))] if pending else []
        self._reframer.reset()
        return frames

    def reset(self) -> None:
        if self._resampler is not None:
            self._resampler.reset()
        self._reframer.reset()

    def end(self, completed: bool) -> list[Int16Array]:
        """A reply ended: played out, its held remainder (`finish`); cut, nothing (`reset`)."""
        if completed:
            return self.finish()
        self.reset()
        return []

    @property
    def pending_samples(self) -> int:
        return self._reframer.pending_samples
