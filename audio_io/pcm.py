"""Sample formats: the runtime's rate, and int16 <-> float conversions in one place."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

RUNTIME_RATE = 16000  # what VAD, ASR and the sessions work at (mono)


def pcm16_to_float(samples: npt.NDArray[np.int16]) -> npt.NDArray[np.float32]:
    """int16 to float32 in [-1, 1)."""
    return samples.astype(np.float32) / 32768.0


def float_to_pcm16(samples: npt.NDArray[np.floating]) -> npt.NDArray[np.int16]:
    """Float audio in [-1, 1] to int16, clipped; NaN or infinity is an error, not noise."""
    if not np.all(np.isfinite(samples)):
        raise ValueError("audio contains NaN or infinite samples")
    return np.clip(np.rint(samples * 32767.0), -32768, 32767).astype(np.int16)
