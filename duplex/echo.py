"""`EchoGate`: is speech that starts while the assistant talks the caller, or its echo?

Without echo cancellation (a speakerphone, many phone lines), the assistant's own voice
comes back into the microphone, attenuated (-10 to -25 dB) and delayed (20-250 ms).
Silero VAD hears it as speech. A caller who talks over the assistant is, at the
microphone, about as loud as the assistant's voice or louder; its echo is far below.
So inbound audio counts as the caller only if its level is within ``suppression_db``
of the loudest audio sent in the echo window before it (a Geigel-style double-talk
detector, on levels rather than samples).

Levels are compared in two bands, below and above `SPLIT_HZ`, and the caller is heard
if either band is: a word that opens with a fricative ("Stop", "Sorry", "Flip") begins
with hiss well under the reply's loudest vowels (so broadband it passes for echo) but
far over the reply's own high band (figures: docs/performance.md, "Duplex runtime").

A line can echo louder than ``suppression_db`` allows (a phone line at -10 dB). So the
gate measures each line: for the first `TRAIN_S` of inbound audio after a reply begins
(when the caller is listening), inbound audio is taken for echo and its level against
the reply's is measured; from then on the reply is gated with the suppression that
echo needs (`ADAPT_MARGIN_DB` under it), never more than ``suppression_db`` nor less
than `MIN_SUPPRESSION_DB`. A caller who starts talking in that first moment is heard
once it has passed (the session re-checks speech over the reply as it goes on).

Where an `EchoCanceller` takes the echo out, the gate judges what it leaves (the
residual; per band, the quieter of it and the audio, for a canceller that has lost the
echo's path adds echo rather than taking it away): each band's threshold goes down by
what the canceller was measured to take away, in this reply, on frames that were echo
alone (`observe_cancellation`: the 10th percentile over a second that ended 0.3 s ago,
`CANCELLED_MARGIN_DB` under it), so a soft vowel or nasal that the echo's level would
hide is heard at once. That allowance holds only where the canceller works now: a band
of a window it made louder (`TAKEN_MIN_DB`: an echo path that moved under it, the client
playing a late frame and the rest of its run after it, leaves an estimate that adds echo
rather than taking it away) is judged as without a canceller, or the echo it failed to
take out would be taken for the caller, and one such window is enough to cut the reply
(figures: docs/performance.md, "A moved echo path is not the caller"). A window of the
caller's voice over the echo still has the echo taken from it, and keeps the allowance.

Pure bookkeeping: levels of 20 ms frames with their send times, no audio kept.
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np
import numpy.typing as npt

SPLIT_HZ = 3000  # vowels below, fricatives ("s", "f", "sh", "t") above
TOP_HZ = 8000  # inbound audio runs at 16 kHz: the high band ends here on both sides
FLOOR_DB = -45.0  # a band quieter than this is never taken for the caller
SENT_KEPT_S = 3.0  # sent frames' levels are kept this long
TRAIN_S = 0.4  # after a reply starts, inbound audio this long is measured as its echo
ADAPT_MARGIN_DB = 4.0  # the suppression is set this far under the echo measured
MIN_SUPPRESSION_DB = 4.0  # ... and never lower: the caller must still be heard over the reply
CANCELLED_S = (0.3, 1.3)  # the canceller's effect is measured on echo-only frames this old (s) ...
CANCELLED_MIN_FRAMES = 10  # ... once there are this many, ...
CANCELLED_EVERY_S = 0.1  # ... again every 0.1 s
CANCELLED_MARGIN_DB = 3.0  # ... and counted this much under their 10th percentile
CANCELLED_MAX_DB = 30.0  # ... and never more
TAKEN_MIN_DB = 0.0  # ... and given a window's band only if the canceller took at least this from it
Bands = npt.NDArray[np.float64]  # (..., 2): dBFS below and above SPLIT_HZ


def level_db(samples: npt.NDArray[np.int16]) -> float:
    """RMS level in dB relative to full scale (-inf for silence)."""
    if samples.size == 0:
        return -math.inf
    rms = math.sqrt(float(np.mean(np.square(samples.astype(np.float64))))) / 32768.0
    return 20 * math.log10(rms) if rms > 0 else -math.inf


def band_levels_db(frames: npt.NDArray[np.int16], rate: int) -> Bands:
    """Levels (dBFS, as RMS) of each frame (the last axis) below and above `SPLIT_HZ`."""
    spectrum = np.fft.rfft(frames, axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    with np.errstate(divide="ignore"):
        return 10.0 * np.log10(power @ _band_weights(frames.shape[-1], rate))


@functools.cache
def _band_weights(n: int, rate: int) -> npt.NDArray[np.float64]:
    """Which of the bins of an ``n``-sample spectrum each band sums, scaled so that
    (by Parseval) the sums are mean squares of full scale."""
    freqs = np.fft.rfftfreq(n, 1.0 / rate)
    bands = np.stack([freqs < SPLIT_HZ, (freqs >= SPLIT_HZ) & (freqs < TOP_HZ)], axis=-1)
    return bands.astype(np.float64) * (2.0 / (n * n * 32768.0**2))


class EchoGate:
    def __init__(self, suppression_db: float = 12.0, window_s: float = 0.4) -> None:
        self.suppression_db = suppression_db  # at most (the session's setting)
        self.effective_db = suppression_db  # for the reply now playing, from its measured echo
        self.window_s = window_s
        self._sent_at = np.zeros(0)  # when each 20 ms sent frame left (the last 3 s) ...
        self._sent_db: Bands = np.zeros((0, 2))  # ... and its band levels
        self._training: tuple[float, float] | None = None  # inbound arriving then is measured
        self._loudest = -math.inf  # the loudest echo measured, dB against the reply
        self.cancelled_db = np.zeros(2)  # what the echo canceller takes away, per band (dB)
        self._cancelled: collections.deque[tuple[float, Bands]] = collections.deque()  # (arrived, dB)
        self._cancelled_at = -math.inf  # when `cancelled_db` was last worked out

    def configure(self, suppression_db: float) -> None:
        self.suppression_db = suppression_db
        self.effective_db = min(self.effective_db, suppression_db)

    def record_sent(self, samples: npt.NDArray[np.int16], rate: int, at: float) -> None:
        if not self.active(at):  # a reply begins: measure
            self._training, self._loudest = (at, at + TRAIN_S), -math.inf
            self.forget_cancellation()  # its echo may come back another way (a new delay)
        kept = int(np.searchsorted(self._sent_at, at - SENT_KEPT_S))
        self._sent_at = np.append(self._sent_at[kept:], at)
        self._sent_db = np.concatenate([self._sent_db[kept:], band_levels_db(samples, rate)[None]])

    def reference_db(self, start: float, end: float) -> Bands:
        """The loudest audio sent in ``[start - window, end]``, per band: what could echo
        in the inbound audio that arrived from ``start`` to ``end``."""
        first = int(np.searchsorted(self._sent_at, start - self.window_s, side="left"))
        last = int(np.searchsorted(self._sent_at, end, side="right"))
        return self._sent_db[first:last].max(axis=0) if last > first else np.full(2, -math.inf)

    def active(self, at: float) -> bool:
        """Audio was sent recently enough to be echoing in inbound audio arrived at ``at``."""
        return self._sent_at.size > 0 and self._sent_at[-1] >= at - self.window_s

    def measuring(self, at: float) -> bool:
        """Inbound audio arrived at ``at`` is wanted by `train`."""
        return self._training is not None and at >= self._training[0]

    def train(self, inbound: Bands, at: float) -> None:
        """Inbound frames (band levels) arrived at ``at``: measured as the reply's echo in
        its first `TRAIN_S`; the first frame after that sets the reply's suppression."""
        if self._training is None or at < self._training[0]:
            return
        if at <= self._training[1]:
            reference = self.reference_db(at, at)
            if np.any(reference > FLOOR_DB):
                excess = np.where(reference > FLOOR_DB, inbound - reference, -np.inf)
                self._loudest = max(self._loudest, float(np.max(excess)))
            return
        self._training = None
        wanted = -self._loudest - ADAPT_MARGIN_DB if math.isfinite(self._loudest) else self.suppression_db
        self.effective_db = max(MIN_SUPPRESSION_DB, min(self.suppression_db, wanted))

    def observe_cancellation(self, inbound: Bands, residual: Bands, start: float, end: float) -> None:
        """Inbound frames (band levels, arrived from ``start`` to ``end``) before and after
        the echo canceller: on those the level test takes for echo alone, how much each
        band (over `FLOOR_DB`) was taken down sets `cancelled_db`."""
        threshold = np.maximum(self.reference_db(start, end) - self.effective_db, FLOOR_DB)
        for frame in np.flatnonzero(~np.any(inbound >= threshold, axis=-1)):
            loud = inbound[frame] > FLOOR_DB
            if loud.any():
                self._cancelled.append((end, np.where(loud, inbound[frame] - residual[frame], np.nan)))
        while self._cancelled and self._cancelled[0][0] < end - CANCELLED_S[1]:
            self._cancelled.popleft()
        if end - self._cancelled_at < CANCELLED_EVERY_S:
            return
        self._cancelled_at = end
        # not the last 0.3 s: a soft onset passes the level test for echo, is not taken
        # away (it is no echo), and must not lower the figure it is about to be judged by
        taken = [db for at, db in self._cancelled if at <= end - CANCELLED_S[0]]
        if len(taken) < CANCELLED_MIN_FRAMES:
            self.cancelled_db = np.zeros(2)
            return
        bands = np.array(taken).T
        low = [np.percentile(b[~np.isnan(b)], 10) if (~np.isnan(b)).any() else 0.0 for b in bands]
        self.cancelled_db = np.clip(np.array(low) - CANCELLED_MARGIN_DB, 0.0, CANCELLED_MAX_DB)

    def forget_cancellation(self) -> None:
        """The canceller started over: what it took away is not known any more."""
        self._cancelled.clear()
        self.cancelled_db = np.zeros(2)
        self._cancelled_at = -math.inf

    def callers(
        self, inbound: Bands, start: float, end: float, taken: Bands | None = None
    ) -> npt.NDArray[np.bool_]:
        """Which inbound frames (band levels, arrived from ``start`` to ``end``; after the
        echo canceller, if there is one, with ``taken``: how much it took from each band
        of each, dB) are louder, in either band, than echo could be: the caller's voice.
        Frames that arrived while the reply's echo was being measured are taken for echo."""
        allowance = self.cancelled_db
        if taken is not None:  # only where the canceller works now
            allowance = np.where(taken >= TAKEN_MIN_DB, allowance, 0.0)
        threshold = np.maximum(self.reference_db(start, end) - self.effective_db - allowance, FLOOR_DB)
        callers = np.any(inbound >= threshold, axis=-1)
        if self._training is not None and callers.size:
            arrived = start + (end - start) * (np.arange(callers.size) + 1) / callers.size
            callers &= arrived > self._training[1]
        return callers

    def is_echo(self, inbound: Bands, start: float, end: float, taken: Bands | None = None) -> bool:
        """Inbound audio with these band levels, arrived from ``start`` to ``end``, may be echo."""
        return not bool(self.callers(inbound, start, end, taken))
