"""`EchoCanceller`: the reply's echo taken out of the caller's audio, sample by sample.

On a line without echo cancellation (a speakerphone, many phone lines) the microphone
picks the reply up again: its samples, delayed by the line (40-500 ms) and filtered by
the room. Those samples are known here, so the echo can be estimated and subtracted,
leaving the caller's voice (the *residual*), on which `EchoGate` then judges a soft
onset that the echo's level would hide. The microphone's audio itself goes on to the
VAD and ASR as it came.

- **The delay** is found by GCC-PHAT: the microphone's last second against what was
  played, over lags up to `MAX_LAG_S`; a sharp peak locks it (re-checked each second).
- **The room** is learned by a partitioned-block frequency-domain adaptive filter (the
  algorithm of Speex's MDF: normalized LMS per frequency bin, 20 ms blocks, one
  partition's gradient constrained per block) over `PARTITIONS` blocks from `LEAD`
  blocks before the delay (figures: docs/performance.md, "An echo canceller under the
  echo gate").
- **Double talk**: the filter adapts only on blocks the caller's voice is not in (the
  session's echo gate tells, `adapt`), or it would learn the caller as echo. A frame
  whose estimate is far louder than what came (a moved path) is passed on as it came.

Timelines: what was played is placed at the instant the client is to play it (a frame's
``playout_time``, the pacer's drift-free grid; runs of frames are contiguous), at 16 kHz
on the monotonic clock; the microphone by its sample position, from the first frame's
arrival. Jitter in when frames are sent or arrive moves neither: the lag between them is
what GCC-PHAT measures. Numbers and arrays only; no audio leaves it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import Resampler

Float32Array = npt.NDArray[np.float32]
Int16Array = npt.NDArray[np.int16]
Spectra = npt.NDArray[np.complex128]  # (partitions, bins)

BLOCK = RUNTIME_RATE // 50  # 20 ms: the filter's block and partition
PARTITIONS = 8  # the filter spans 160 ms ...
LEAD = 2  # ... from 40 ms before the measured delay (a peak a little late; the room after it)
MAX_LAG_S = 0.6  # the longest echo delay looked for
LOCK_WINDOW = RUNTIME_RATE  # GCC-PHAT over the last second of microphone audio ...
LOCK_EVERY = RUNTIME_RATE  # ... once a second while something was played
LOCK_PEAK = 8.0  # the correlation peak must stand this many times over the mean: a real echo
MOVE_MIN = RUNTIME_RATE // 1000  # a lag moved less than 1 ms is kept (the filter follows)
STEP = 1.0  # NLMS step (per bin, normalized by the reference's power, smoothed by `SMOOTH`)
SMOOTH = 0.9
DIVERGED = 4.0  # an estimate this many times full scale (or not finite): the filter starts over
RUN_SLACK_S = 0.005  # a frame due this close to the end of the last one continues its run
RING = 4 * RUNTIME_RATE  # played and heard audio kept, by 16 kHz index on the monotonic clock
_BAND = (100, 7000)  # Hz: GCC-PHAT weighs these bins (outside them the reply has no energy)
_EPS = 1e-10
_ECHO_REACH = round(MAX_LAG_S * RUNTIME_RATE) + (PARTITIONS + 1) * BLOCK  # played audio echoes this long
_QUIET = BLOCK * 1e-7  # a block's energy at -70 dBFS: quieter is silence, whatever the ratio


class _Ring:
    """Samples by absolute 16 kHz index, the last `RING` of them; never written: zeros."""

    def __init__(self) -> None:
        self.data = np.zeros(RING, np.float32)
        self.end: int | None = None  # one past the last index written

    def write(self, start: int, samples: Float32Array, add: bool = False) -> None:
        end = start + samples.size
        if self.end is None or start - self.end >= RING:
            self.data[:] = 0.0
        elif end > self.end:  # what lies ahead held older audio: cleared first
            self._put(max(self.end, end - RING), np.zeros(end - max(self.end, end - RING), np.float32))
        if add and self.end is not None:
            samples = samples + self.read(start, end)
        keep = samples[max(0, samples.size - RING) :]
        self._put(end - keep.size, keep)
        self.end = end if self.end is None else max(self.end, end)

    def _put(self, start: int, values: Float32Array) -> None:
        i = start % RING
        first = min(values.size, RING - i)
        self.data[i : i + first] = values[:first]
        self.data[: values.size - first] = values[first:]

    def read(self, start: int, end: int) -> Float32Array:
        out = np.zeros(end - start, np.float32)
        if self.end is None:
            return out
        lo, hi = max(start, self.end - RING), min(end, self.end)
        if hi > lo:
            i = lo % RING
            first = min(hi - lo, RING - i)
            out[lo - start : lo - start + first] = self.data[i : i + first]
            out[lo - start + first : hi - start] = self.data[: hi - lo - first]
        return out


def gcc_phat_lag(heard: Float32Array, played: Float32Array, max_lag: int) -> tuple[int, float]:
    """The lag (samples) at which ``heard`` best repeats ``played``, and how sharply:
    the peak of the phase-transform cross-correlation over its mean. ``played`` begins
    ``max_lag`` samples before ``heard`` and is as long as ``heard`` plus that."""
    n = 1 << (played.size - 1).bit_length()  # lags 0..max_lag never wrap around
    cross = np.fft.rfft(played, n) * np.conj(np.fft.rfft(heard, n))
    freqs = np.fft.rfftfreq(n, 1.0 / RUNTIME_RATE)
    cross = np.where((freqs >= _BAND[0]) & (freqs <= _BAND[1]), cross / (np.abs(cross) + _EPS), 0.0)
    corr = np.abs(np.fft.irfft(cross, n)[: max_lag + 1])  # played[i + k] ~ heard[i]: lag max_lag - k
    k = int(np.argmax(corr))
    return max_lag - k, float(corr[k] / (np.mean(corr) + _EPS))


class EchoCanceller:
    def __init__(self) -> None:
        self._played = _Ring()  # what the client was to play, float in [-1, 1)
        self._heard = _Ring()  # the microphone's audio, the same
        self._resampler: Resampler | None = None
        self._run_until = 0.0  # when the last frame played ends: a frame due then continues the run
        self._origin: int | None = None  # the 16 kHz index of microphone position 0
        self.lag: int | None = None  # samples from playing a sample to hearing its echo
        self.peak = 0.0  # the last lock's sharpness (`gcc_phat_lag`)
        self.resets = 0  # times the filter started over (a new lag, or a diverged estimate)
        self.echoing = False  # something played lately could echo in the last frame heard
        self._weights = np.zeros((PARTITIONS, BLOCK + 1), np.complex128)
        self._power = np.zeros(BLOCK + 1)  # the reference's power per bin, smoothed
        self._turn = 0  # the partition whose gradient is constrained next
        self._next_lock: int | None = None  # microphone index of the next delay check
        self._caller_heard: int | None = None  # ... which waits for a second without the caller
        self._block: int | None = None  # microphone index where the unfinished block begins
        self._estimate: Float32Array | None = None  # the echo estimate of that block
        self._spectra: Spectra | None = None  # the reference it came from, newest partition first
        self._spectra_block: int | None = None  # ... for the block at this index
        self._spectra_whole = False  # ... all of it played already (else it is computed afresh)
        self._done: list[tuple[Spectra, Float32Array]] = []  # finished blocks to learn from

    # -- what was played --

    def play(self, samples: Int16Array, rate: int, playout_time: float) -> None:
        """A frame that left for the client, to be played at ``playout_time``."""
        if self._resampler is None or self._resampler.in_rate != rate:
            self._resampler = Resampler(rate, RUNTIME_RATE)
        audio = self._resampler.process(samples).astype(np.float32) / 32768.0
        start = round(playout_time * RUNTIME_RATE)
        if self._played.end is not None and abs(playout_time - self._run_until) <= RUN_SLACK_S:
            start = self._played.end  # the run goes on: contiguous, as the client plays it
        self._run_until = playout_time + samples.size / rate
        self._played.write(start, audio, add=True)

    # -- what was heard --

    def cancel(self, samples: Int16Array, position: int, arrived: float) -> Int16Array:
        """The microphone's audio from stream ``position`` (arrived at ``arrived``) less
        the echo estimated in it; the audio itself until a delay is locked, or where
        nothing played could echo."""
        if self._origin is None:
            self._origin = round(arrived * RUNTIME_RATE) - (position + samples.size)
        start = self._origin + position
        heard = samples.astype(np.float32) / 32768.0
        self._heard.write(start, heard)
        self.echoing = self._played.end is not None and start - self._played.end <= _ECHO_REACH
        if not self.echoing:
            self._done.clear()  # blocks of an echo's tail not learned from: let go
            return samples  # nothing played lately could echo here: nothing to do
        self._maybe_lock(start + samples.size)
        if self.lag is None:
            return samples
        out = heard.copy()
        if self._block is None or not start - BLOCK < self._block <= start:  # not where it left off
            self._block, self._estimate = start - (start - self._origin) % BLOCK, None
        while self._block < start + samples.size:
            block = self._block
            if self._estimate is None:
                self._estimate = self._predict(block)
            lo, hi = max(block, start), min(block + BLOCK, start + samples.size)
            out[lo - start : hi - start] -= self._estimate[lo - block : hi - block]
            if hi < block + BLOCK:
                break  # the rest of this block comes with the next frame
            if self._spectra is not None and self._spectra_block == block:
                error = self._heard.read(block, block + BLOCK) - self._estimate
                if not np.all(np.abs(self._estimate) < DIVERGED):
                    self._reset()  # the filter blew up (an estimate louder than any audio)
                    break
                self._done.append((self._spectra, error))
            self._block, self._estimate = block + BLOCK, None
        if np.sum(np.square(heard - out)) > 4.0 * np.sum(np.square(heard)) + _QUIET:
            return samples  # an estimate far louder than all that came is wrong (misplaced): as it came
        return np.clip(np.rint(out * 32768.0), -32768, 32767).astype(np.int16)

    def adapt(self, echo_only: bool) -> None:
        """Learn from the blocks finished since the last call if they held the echo only
        (the gate heard no caller in the residual); else they are let go."""
        done, self._done = self._done, []
        if not echo_only:
            self._caller_heard = self._heard.end
            return
        for spectra, error in done:
            power = np.sum(spectra.real**2 + spectra.imag**2, axis=0)
            self._power = np.maximum(power, SMOOTH * self._power + (1 - SMOOTH) * power)
            padded = np.concatenate([np.zeros(BLOCK, np.float32), error])
            gradient = np.conj(spectra) * np.fft.rfft(padded)
            # bins the reply leaves (nearly) empty are held still by the floor
            self._weights += STEP * gradient / (self._power + 0.01 * np.mean(self._power) + 1e-6)
            turn = self._turn  # one partition a block is made a linear, not circular, filter
            taps = np.fft.irfft(self._weights[turn], 2 * BLOCK)
            taps[BLOCK:] = 0.0
            self._weights[turn] = np.fft.rfft(taps)
            self._turn = (turn + 1) % PARTITIONS

    def _predict(self, block: int) -> Float32Array:
        """The echo estimate of the block of microphone audio at ``block``; its reference
        spectra, newest partition first, are kept (`_spectra`) for `adapt`."""
        assert self.lag is not None and self._played.end is not None
        newest = block + BLOCK - self.lag + LEAD * BLOCK  # where the newest partition's window ends
        if newest - (PARTITIONS + 1) * BLOCK >= self._played.end:
            self._spectra = None  # nothing played then could echo now
            return np.zeros(BLOCK, np.float32)
        window = self._played.read(newest - 2 * BLOCK, newest)
        spectrum = np.fft.rfft(window)[None]
        if self._spectra is not None and self._spectra_whole and self._spectra_block == block - BLOCK:
            self._spectra = np.concatenate([spectrum, self._spectra[:-1]])  # each partition a block older
        else:
            windows = [
                self._played.read(end - 2 * BLOCK, end)
                for end in range(newest, newest - PARTITIONS * BLOCK, -BLOCK)
            ]
            self._spectra = np.fft.rfft(np.stack(windows), axis=-1)
        self._spectra_block = block
        self._spectra_whole = newest <= self._played.end  # else (a short delay) not reused next block
        estimate = np.fft.irfft(np.sum(self._weights * self._spectra, axis=0), 2 * BLOCK)[BLOCK:]
        return estimate.astype(np.float32)

    def _maybe_lock(self, end: int) -> None:
        """Once a second of microphone audio, if enough was played that could echo in
        it: measure the delay, and take it if the peak is sharp."""
        if self._next_lock is None:
            self._next_lock = end + LOCK_WINDOW
        if end < self._next_lock:
            return
        self._next_lock = end + LOCK_EVERY
        max_lag = round(MAX_LAG_S * RUNTIME_RATE)
        played = self._played.read(end - LOCK_WINDOW - max_lag, end)
        heard = self._heard.read(end - LOCK_WINDOW, end)
        if np.count_nonzero(played) < LOCK_WINDOW // 4 or not np.any(heard):  # too little played
            return
        if self._caller_heard is not None and self._caller_heard > end - LOCK_WINDOW:
            return  # the caller's voice would blur the peak, or make one of its own
        lag, peak = gcc_phat_lag(heard, played, max_lag)
        if peak < LOCK_PEAK:
            return
        self.peak = peak
        if self.lag is None or abs(lag - self.lag) > MOVE_MIN:
            self.lag = lag
            self._reset()

    def _reset(self) -> None:
        self._weights[:] = 0.0
        self._power[:] = 0.0
        self._done.clear()
        self._block, self._estimate, self._spectra, self._spectra_block = None, None, None, None
        self.resets += 1
