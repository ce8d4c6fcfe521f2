"""The gRPC API's audio formats: PCM16 at 8/16/24/48 kHz, G.711 mu-law and A-law at
8 kHz, to and from the int16 frames of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from audio_io._proto import duplex_pb2 as pb
from audio_io.frame import Int16Array
from audio_io.g711 import decode_wire, encode_wire

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
        elif encoding == 0:
            raise FormatError(f"{what}: no encoding given (PCM16, MULAW or ALAW)")
        else:
            raise FormatError(f"{what}: unknown encoding {encoding} (PCM16, MULAW or ALAW)")
        return cls(encoding, rate)

    def message(self) -> pb.AudioFormat:
        return pb.AudioFormat(encoding=self.encoding, sample_rate=self.sample_rate)  # type: ignore[arg-type]

    @property
    def law(self) -> str | None:
        return "ulaw" if self.encoding == pb.MULAW else "alaw" if self.encoding == pb.ALAW else None

    def decode(self, data: bytes) -> Int16Array:
        try:
            return decode_wire(data, self.law)
        except ValueError as e:
            raise FormatError(str(e)) from None

    def encode(self, samples: Int16Array) -> bytes:
        return encode_wire(samples, self.law)
