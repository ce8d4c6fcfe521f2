"""G.711 against CPython 3.11's audioop, the reference implementation, exhaustively."""

import audioop

import numpy as np
import pytest

from audio_io import g711

ALL_PCM = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = np.arange(256, dtype=np.uint8)


@pytest.mark.parametrize(
    ("encode", "reference"),
    [(g711.ulaw_encode, audioop.lin2ulaw), (g711.alaw_encode, audioop.lin2alaw)],
    ids=["ulaw", "alaw"],
)
def test_encode_matches_audioop_for_every_int16(encode, reference):
    pcm = ALL_PCM.astype("<i2").tobytes()
    assert encode(ALL_PCM).tobytes() == reference(pcm, 2)
    assert encode(pcm).tobytes() == reference(pcm, 2)  # bytes in, same codes


@pytest.mark.parametrize(
    ("decode", "reference"),
    [(g711.ulaw_decode, audioop.ulaw2lin), (g711.alaw_decode, audioop.alaw2lin)],
    ids=["ulaw", "alaw"],
)
def test_decode_matches_audioop_for_every_code(decode, reference):
    codes = ALL_CODES.tobytes()
    assert decode(codes).astype("<i2").tobytes() == reference(codes, 2)
    assert decode(ALL_CODES).dtype == np.int16


@pytest.mark.parametrize(
    ("encode", "decode"), [(g711.ulaw_encode, g711.ulaw_decode), (g711.alaw_encode, g711.alaw_decode)]
)
def test_decode_then_encode_is_identity_on_codes(encode, decode):
    # Every code decodes to a value that encodes back to a code decoding the same way
    # (μ-law has two zero codes, 0x7F and 0xFF, so compare decoded values).
    assert np.array_equal(decode(encode(decode(ALL_CODES))), decode(ALL_CODES))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="odd byte count"):
        g711.ulaw_encode(b"\x00\x01\x02")
    with pytest.raises(TypeError, match="int16"):
        g711.alaw_encode(np.zeros(4, dtype=np.float32))
