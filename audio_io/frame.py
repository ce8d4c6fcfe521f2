"""`AudioFrame`: the unit of audio that crosses every boundary inside the service."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Int16Array = npt.NDArray[np.int16]


@dataclass(frozen=True, slots=True, eq=False)
class AudioFrame:
    """A block of int16 PCM, interleaved when ``channels > 1``.

    ``capture_time`` is when the first sample was captured (inbound audio) and
    ``playout_time`` when it is due to leave the server (outbound audio); both are
    ``time.monotonic()`` seconds, or None when unknown.
    """

    samples: Int16Array
    sample_rate: int
    channels: int = 1
    capture_time: float | None = None
    playout_time: float | None = None

    def __post_init__(self) -> None:
        if self.samples.dtype != np.int16 or self.samples.ndim != 1:
            raise TypeError(
                f"AudioFrame needs 1-D int16 samples, got {self.samples.dtype} {self.samples.shape}"
            )
        if self.sample_rate <= 0 or self.channels <= 0:
            raise ValueError(f"bad audio format: {self.sample_rate} Hz, {self.channels} channels")
        if self.samples.size % self.channels:
            raise ValueError(f"{self.samples.size} samples do not divide into {self.channels} channels")

    @classmethod
    def from_pcm16(
        cls, data: bytes, sample_rate: int, channels: int = 1, capture_time: float | None = None
    ) -> AudioFrame:
        """Wrap little-endian PCM16 bytes (copied, so the frame owns its samples)."""
        if len(data) % (2 * channels):
            raise ValueError(f"PCM16 payload of {len(data)} bytes is not whole {channels}-channel samples")
        samples = np.frombuffer(data, dtype="<i2").astype(np.int16)
        return cls(samples, sample_rate, channels, capture_time)

    @classmethod
    def silence(cls, duration_s: float, sample_rate: int, channels: int = 1) -> AudioFrame:
        n = round(duration_s * sample_rate)
        return cls(np.zeros(n * channels, dtype=np.int16), sample_rate, channels)

    @property
    def num_samples(self) -> int:
        """Samples per channel."""
        return self.samples.size // self.channels

    @property
    def duration(self) -> float:
        return self.num_samples / self.sample_rate

    def to_pcm16(self) -> bytes:
        return self.samples.astype("<i2", copy=False).tobytes()
