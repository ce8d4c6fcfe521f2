"""The gRPC API's audio formats: PCM16 at 8/16/24/48 kHz, G.711 mu-law and A-law at
8 kHz, to and from the int16 frames of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from audio_io._proto import duplex_pb2 as pb
from audio_io.frame import Int16Array
from audio_io.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

PCM16_RATES = (8000, 16000, 24000, 48000)


class FormatError(ValueError):
    pass


@dataclass(frozen=True)
class WireFormat:
    encoding: int  # pb.AudioEncoding
    sample_rate: int

    @classmethod
    def parse(cls, message: pb.AudioFormat, what: str) -> WireFormat:
        encoding, rate = message.encoding, message.sample_rate
        if encoding == pb.PCM16:
            if rate not in PCM16_RATES:
                raise FormatError(f"{what}: PCM16 takes sample rates {PCM16_RATES}, not {rate}")
        elif encoding in (pb.MULAW, pb.ALAW):
            if rate != 8000:
                raise FormatError(f"{what}: G.711 is 8000 Hz only, not {rate}")
        else:
            raise FormatError(f"{what}: no encoding given (PCM16, MULAW or ALAW)")
        return cls(encoding, rate)

    def message(self) -> pb.AudioFormat:
        return pb.AudioFormat(encoding=self.encoding, sample_rate=self.sample_rate)  # type: ignore[arg-type]

    def decode(self, data: bytes) -> Int16Array:
        if self.encoding == pb.MULAW:
            return ulaw_decode(data)
        if self.encoding == pb.ALAW:
            return alaw_decode(data)
        if len(data) % 2:
            raise FormatError(f"PCM16 audio must be whole 2-byte samples; got {len(data)} bytes")
        return np.frombuffer(data, dtype="<i2").astype(np.int16)

    def encode(self, samples: Int16Array) -> bytes:
        if self.encoding == pb.MULAW:
            return ulaw_encode(samples).tobytes()
        if self.encoding == pb.ALAW:
            return alaw_encode(samples).tobytes()
        return samples.astype("<i2", copy=False).tobytes()
