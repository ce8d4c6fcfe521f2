"""`EchoGate`: is speech that starts while the assistant talks the caller, or its echo?

Without echo cancellation (a speakerphone, many phone lines), the assistant's own voice
comes back into the microphone, attenuated (-10 to -25 dB) and delayed (20-250 ms).
Silero VAD hears it as speech. A caller who talks over the assistant is, at the
microphone, about as loud as the assistant's voice or louder; its echo is far below.
So speech that starts while audio is going out counts as the caller only if its level
is within ``suppression_db`` of the loudest audio sent in the echo window before it
(a Geigel-style double-talk detector, on levels rather than samples).

Pure bookkeeping: levels of 20 ms frames with their send times, no audio kept.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import numpy.typing as npt


def level_db(samples: npt.NDArray[np.int16]) -> float:
    """RMS level in dB relative to full scale (-inf for silence)."""
    if samples.size == 0:
        return -math.inf
    rms = math.sqrt(float(np.mean(np.square(samples.astype(np.float64))))) / 32768.0
    return 20 * math.log10(rms) if rms > 0 else -math.inf


class EchoGate:
    def __init__(self, suppression_db: float = 12.0, window_s: float = 0.4) -> None:
        self.suppression_db = suppression_db
        self.window_s = window_s
        self._sent: collections.deque[tuple[float, float]] = collections.deque()  # (time, dB)

    def record_sent(self, samples: npt.NDArray[np.int16], at: float) -> None:
        self._sent.append((at, level_db(samples)))
        while self._sent and self._sent[0][0] < at - 3.0:
            self._sent.popleft()

    def reference_db(self, start: float, end: float) -> float:
        """The loudest audio sent in ``[start - window, end]``: what could echo in the
        inbound audio that arrived from ``start`` to ``end``."""
        levels = [db for at, db in self._sent if start - self.window_s <= at <= end]
        return max(levels, default=-math.inf)

    def active(self, at: float) -> bool:
        """Audio was sent recently enough to be echoing in inbound audio arrived at ``at``."""
        return bool(self._sent) and self._sent[-1][0] >= at - self.window_s

    def is_echo(self, inbound_db: float, start: float, end: float) -> bool:
        """Inbound audio at this level, arrived from ``start`` to ``end``, may be echo."""
        return inbound_db < self.reference_db(start, end) - self.suppression_db
