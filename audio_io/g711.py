"""G.711 μ-law and A-law codecs (ITU-T G.711), vectorised with lookup tables.

The tables are built once from the reference segment algorithm (the one CPython's
``audioop`` implements), so encoding and decoding are one ``np.take`` each and are
bit-exact with ``audioop.lin2ulaw``/``ulaw2lin``/``lin2alaw``/``alaw2lin`` on 16-bit
samples. Encoding tables are indexed by the int16 value viewed as uint16.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Int16Array = npt.NDArray[np.int16]
CodeArray = npt.NDArray[np.uint8]

_ULAW_BIAS = 0x84
_ULAW_CLIP = 8159  # largest magnitude of 14-bit μ-law input, after the bias
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _segment(magnitude: npt.NDArray[np.int64], seg_end: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Index of the first segment whose end is >= magnitude (8 when above all)."""
    return np.searchsorted(seg_end, magnitude, side="left").astype(np.int64)


def _build_ulaw_encode() -> CodeArray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 2  # 14-bit, arithmetic shift
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    seg = _segment(mag, _ULAW_SEG_END)
    code = (np.minimum(seg, 7) << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0xF)
    code = np.where(seg >= 8, 0x7F, code) ^ mask
    table = np.empty(65536, dtype=np.uint8)
    table[np.arange(-32768, 32768, dtype=np.int64) & 0xFFFF] = code.astype(np.uint8)
    return table


def _build_ulaw_decode() -> Int16Array:
    u = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((u & 0x0F) << 3) + _ULAW_BIAS) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, _ULAW_BIAS - t, t - _ULAW_BIAS).astype(np.int16)


def _build_alaw_encode() -> CodeArray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 3  # 13-bit, arithmetic shift
    negative = pcm < 0
    mask = np.where(negative, 0x55, 0xD5)
    mag = np.where(negative, -pcm - 1, pcm)
    seg = _segment(mag, _ALAW_SEG_END)
    shift = np.where(seg < 2, 1, np.minimum(seg, 7))
    code = (np.minimum(seg, 7) << 4) | ((mag >> shift) & 0xF)
    code = np.where(seg >= 8, 0x7F, code) ^ mask
    table = np.empty(65536, dtype=np.uint8)
    table[np.arange(-32768, 32768, dtype=np.int64) & 0xFFFF] = code.astype(np.uint8)
    return table


def _build_alaw_decode() -> Int16Array:
    a = np.arange(256, dtype=np.int64) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, t + 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ULAW_ENC = _build_ulaw_encode()
_ULAW_DEC = _build_ulaw_decode()
_ALAW_ENC = _build_alaw_encode()
_ALAW_DEC = _build_alaw_decode()


def _as_int16(pcm: Int16Array | bytes) -> Int16Array:
    if isinstance(pcm, (bytes, bytearray, memoryview)):
        if len(pcm) % 2:
            raise ValueError(f"PCM16 payload has an odd byte count ({len(pcm)})")
        return np.frombuffer(pcm, dtype="<i2").astype(np.int16, copy=False)
    if pcm.dtype != np.int16:
        raise TypeError(f"expected int16 samples, got {pcm.dtype}")
    return pcm


def _as_codes(codes: CodeArray | bytes) -> CodeArray:
    if isinstance(codes, (bytes, bytearray, memoryview)):
        return np.frombuffer(codes, dtype=np.uint8)
    if codes.dtype != np.uint8:
        raise TypeError(f"expected uint8 codes, got {codes.dtype}")
    return codes


def ulaw_encode(pcm: Int16Array | bytes) -> CodeArray:
    """int16 samples (or little-endian PCM16 bytes) -> μ-law codes."""
    return _ULAW_ENC[_as_int16(pcm).view(np.uint16)]


def ulaw_decode(codes: CodeArray | bytes) -> Int16Array:
    """μ-law codes (array or bytes) -> int16 samples."""
    return _ULAW_DEC[_as_codes(codes)]


def alaw_encode(pcm: Int16Array | bytes) -> CodeArray:
    """int16 samples (or little-endian PCM16 bytes) -> A-law codes."""
    return _ALAW_ENC[_as_int16(pcm).view(np.uint16)]


def alaw_decode(codes: CodeArray | bytes) -> Int16Array:
    """A-law codes (array or bytes) -> int16 samples."""
    return _ALAW_DEC[_as_codes(codes)]


def decode_wire(data: bytes, law: str | None) -> Int16Array:
    """Audio bytes as transports carry them: ``law`` "ulaw" or "alaw" (G.711 codes), or
    None (PCM16, little-endian). A `ValueError` for PCM16 of an odd length."""
    if law == "ulaw":
        return ulaw_decode(data)
    if law == "alaw":
        return alaw_decode(data)
    if len(data) % 2:
        raise ValueError(f"PCM16 audio must be whole 2-byte samples; got {len(data)} bytes")
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


def encode_wire(samples: Int16Array, law: str | None) -> bytes:
    """The inverse of `decode_wire`."""
    if law == "ulaw":
        return ulaw_encode(samples).tobytes()
    if law == "alaw":
        return alaw_encode(samples).tobytes()
    if samples.dtype != np.int16:  # as the G.711 encoders: a float or wider array is a bug upstream
        raise TypeError(f"PCM16 encodes int16 samples, not {samples.dtype}")
    return samples.astype("<i2", copy=False).tobytes()
