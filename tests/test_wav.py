import struct
from pathlib import Path

import numpy as np
import pytest

from audio_io.wav import WavError, read_wav, write_wav


def wav_bytes(tag: int, channels: int, rate: int, bits: int, body: bytes) -> bytes:
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * bits // 8, channels * bits // 8, bits)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def test_round_trip(tmp_path: Path):
    x = np.arange(-1000, 1000, 7, dtype=np.int16)
    write_wav(tmp_path / "a.wav", x, 8000)
    y, rate = read_wav(tmp_path / "a.wav")
    assert rate == 8000 and np.array_equal(x, y)


@pytest.mark.parametrize(
    ("tag", "bits", "body", "expected"),
    [
        (1, 8, bytes([128, 255, 0]), [0, 127 << 8, -32768]),
        (1, 24, b"\x00\x00\x40" + b"\x00\x00\xc0", [16384, -16384]),
        (1, 32, struct.pack("<2i", 1 << 30, -(1 << 30)), [16384, -16384]),
        (3, 32, struct.pack("<2f", 0.5, -1.0), [16384, -32767]),
    ],
)
def test_formats_decode_to_int16(tmp_path: Path, tag, bits, body, expected):
    (tmp_path / "f.wav").write_bytes(wav_bytes(tag, 1, 16000, bits, body))
    samples, _ = read_wav(tmp_path / "f.wav")
    assert samples.tolist() == pytest.approx(expected, abs=1)


def test_stereo_is_downmixed(tmp_path: Path):
    body = np.array([100, 300, -100, -300], dtype="<i2").tobytes()
    (tmp_path / "s.wav").write_bytes(wav_bytes(1, 2, 48000, 16, body))
    samples, rate = read_wav(tmp_path / "s.wav")
    assert (samples.tolist(), rate) == ([200, -200], 48000)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a RIFF/WAVE"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "no fmt chunk"),
        (wav_bytes(1, 1, 16000, 16, b"\x00\x00")[:-10], "no data chunk"),
        (wav_bytes(2, 1, 16000, 4, b"\x00" * 8), "unsupported sample format"),
        (wav_bytes(1, 0, 16000, 16, b"\x00" * 8), "implausible format"),
        (wav_bytes(1, 1, 5, 16, b"\x00" * 8), "implausible format"),
        (wav_bytes(3, 1, 16000, 32, struct.pack("<2f", 0.1, float("nan"))), "NaN"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 100, "not a RIFF/WAVE"),
    ],
)
def test_bad_files_are_clear_errors(tmp_path: Path, data, message):
    (tmp_path / "bad.wav").write_bytes(data)
    with pytest.raises(WavError, match=message):
        read_wav(tmp_path / "bad.wav")


def test_an_odd_trailing_byte_is_ignored(tmp_path: Path):
    (tmp_path / "t.wav").write_bytes(wav_bytes(1, 1, 16000, 16, b"\x01\x00\x02"))
    assert read_wav(tmp_path / "t.wav")[0].tolist() == [1]
