"""WAV files in and out, with clear errors for what we cannot read.

Reads RIFF/WAVE with PCM (8, 16, 24, 32 bit) or IEEE float (32, 64 bit) samples, any
rate and channel count, down-mixed to mono int16. Writes mono PCM16.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.pcm import float_to_pcm16
from audio_io.resample import downmix

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
MAX_BYTES = 2 << 30  # a 2 GiB file is certainly not a conversation turn


class WavError(ValueError):
    pass


def read_wav(path: str | Path) -> tuple[npt.NDArray[np.int16], int]:
    """Mono int16 samples and the sample rate; `WavError` says what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise WavError(f"{path}: {size} bytes is larger than the {MAX_BYTES} bytes we read")
    data = path.read_bytes()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError(f"{path}: not a RIFF/WAVE file")
    fmt: tuple[int, int, int, int] | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, chunk_size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + chunk_size]
        if chunk_id == b"fmt ":
            if len(body) < 16:
                raise WavError(f"{path}: truncated fmt chunk")
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            if fmt is None:
                raise WavError(f"{path}: data chunk before fmt chunk")
            return _decode(path, body, *fmt)
        pos += 8 + chunk_size + (chunk_size & 1)
    raise WavError(f"{path}: no {'fmt' if fmt is None else 'data'} chunk (truncated file?)")


def _decode(
    path: Path, body: bytes, tag: int, channels: int, rate: int, bits: int
) -> tuple[npt.NDArray[np.int16], int]:
    if channels < 1 or not 1000 <= rate <= 384000:
        raise WavError(f"{path}: implausible format ({channels} channels, {rate} Hz)")
    width = bits // 8
    usable = len(body) - len(body) % (width * channels) if width else 0
    raw = body[:usable]
    if tag == PCM and bits == 16:
        samples = np.frombuffer(raw, "<i2").astype(np.int16)
    elif tag == PCM and bits == 8:
        samples = ((np.frombuffer(raw, np.uint8).astype(np.int16) - 128) << 8).astype(np.int16)
    elif tag == PCM and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        value = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
        samples = (value >> 8).astype(np.int16)
    elif tag == PCM and bits == 32:
        samples = (np.frombuffer(raw, "<i4") >> 16).astype(np.int16)
    elif tag == FLOAT and bits in (32, 64):
        floats = np.frombuffer(raw, "<f4" if bits == 32 else "<f8")
        if not np.all(np.isfinite(floats)):
            raise WavError(f"{path}: float samples contain NaN or infinity")
        samples = float_to_pcm16(floats)
    else:
        raise WavError(f"{path}: unsupported sample format (tag {tag}, {bits} bit); use PCM or float")
    return downmix(samples, channels), rate


def write_wav(path: str | Path, samples: npt.NDArray[np.int16], rate: int) -> None:
    body = samples.astype("<i2").tobytes()
    header = b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, PCM, 1, rate, rate * 2, 2, 16)
    Path(path).write_bytes(header + b"data" + struct.pack("<I", len(body)) + body)
