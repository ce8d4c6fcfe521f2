"""The gRPC API's audio formats (audio_io/grpc_codec.py), without a server.

tests/test_grpc.py checks that a bad format ends a real call with INVALID_ARGUMENT, and
tests/test_g711.py checks the G.711 tables against audioop; here: which formats parse,
what the error says, and the bytes each format puts on the wire."""

import numpy as np
import pytest

from audio_io._proto import duplex_pb2 as pb
from audio_io.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from audio_io.grpc_codec import PCM16_RATES, FormatError, WireFormat

ALL_PCM = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = bytes(range(256))
PCM16 = WireFormat(pb.PCM16, 16000)
ULAW = WireFormat(pb.MULAW, 8000)
ALAW = WireFormat(pb.ALAW, 8000)


def parse(encoding: int, rate: int, what: str = "input_format") -> WireFormat:
    return WireFormat.parse(pb.AudioFormat(encoding=encoding, sample_rate=rate), what)  # type: ignore[arg-type]


# -- parsing --


def test_the_supported_rates():
    assert PCM16_RATES == (8000, 16000, 24000, 48000)


@pytest.mark.parametrize(
    ("encoding", "rate", "law"),
    [(pb.PCM16, r, None) for r in (8000, 16000, 24000, 48000)]
    + [(pb.MULAW, 8000, "ulaw"), (pb.ALAW, 8000, "alaw")],
)
def test_valid_formats_parse_and_give_their_message_back(encoding: int, rate: int, law: str | None):
    fmt = parse(encoding, rate)
    assert fmt == WireFormat(encoding, rate) and fmt.law == law
    assert fmt.message() == pb.AudioFormat(encoding=encoding, sample_rate=rate)  # type: ignore[arg-type]
    assert WireFormat.parse(fmt.message(), "output_format") == fmt


@pytest.mark.parametrize("rate", [0, 11025, 16001, 22050, 44100, 96000])
def test_pcm16_at_another_rate_is_refused_naming_the_field_and_the_rate(rate: int):
    with pytest.raises(FormatError) as error:
        parse(pb.PCM16, rate, "output_format")
    message = str(error.value)
    assert message.startswith("output_format: ") and "PCM16" in message and "sample rates" in message
    assert message.endswith(f"not {rate}")


@pytest.mark.parametrize("encoding", [pb.MULAW, pb.ALAW])
@pytest.mark.parametrize("rate", [0, 16000, 48000])
def test_g711_at_another_rate_is_refused(encoding: int, rate: int):
    with pytest.raises(FormatError, match=f"^input_format: G.711 is 8000 Hz only, not {rate}$"):
        parse(encoding, rate)


@pytest.mark.parametrize("rate", [0, 8000, 16000])
def test_no_encoding_is_refused(rate: int):
    with pytest.raises(FormatError, match=r"^input_format: no encoding given \(PCM16, MULAW or ALAW\)$"):
        parse(pb.AUDIO_ENCODING_UNSPECIFIED, rate)


def test_an_unknown_encoding_is_refused_saying_which():
    # proto3 enums are open: a newer client can send a value this server has no name for.
    # The error must name the field and the value, not claim that none was given.
    with pytest.raises(FormatError) as error:
        parse(99, 8000)
    message = str(error.value)
    assert message.startswith("input_format: ") and "99" in message


def test_format_errors_are_value_errors():
    assert issubclass(FormatError, ValueError)


# -- PCM16 --


def test_pcm16_is_little_endian_on_the_wire():
    samples = np.array([1, -1, 32767, -32768, 256], np.int16)
    wire = b"\x01\x00\xff\xff\xff\x7f\x00\x80\x00\x01"
    assert PCM16.encode(samples) == wire
    decoded = PCM16.decode(wire)
    assert decoded.dtype == np.int16 and np.array_equal(decoded, samples)


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 48000])
def test_pcm16_round_trips_every_sample_at_every_rate(rate: int):
    fmt = WireFormat(pb.PCM16, rate)
    wire = fmt.encode(ALL_PCM)
    assert len(wire) == 2 * ALL_PCM.size
    assert np.array_equal(fmt.decode(wire), ALL_PCM)


@pytest.mark.parametrize("size", [1, 3, 641])
def test_pcm16_of_an_odd_byte_count_is_a_format_error(size: int):
    with pytest.raises(FormatError, match=f"whole 2-byte samples; got {size} bytes"):
        PCM16.decode(b"\x00" * size)


def test_decoded_samples_are_a_writable_copy():
    wire = bytearray(b"\x01\x00\x02\x00")
    for fmt in (PCM16, ULAW, ALAW):
        samples = fmt.decode(bytes(wire))
        assert samples.flags.writeable
        samples[0] = 99  # the caller may process in place; the bytes are not touched
    assert wire == bytearray(b"\x01\x00\x02\x00")


# -- G.711 --


@pytest.mark.parametrize(
    ("fmt", "encode", "decode"), [(ULAW, ulaw_encode, ulaw_decode), (ALAW, alaw_encode, alaw_decode)]
)
def test_g711_is_one_byte_a_sample_with_the_codec_tables(fmt: WireFormat, encode, decode):
    wire = fmt.encode(ALL_PCM)
    assert isinstance(wire, bytes) and len(wire) == ALL_PCM.size
    assert wire == encode(ALL_PCM).tobytes()
    decoded = fmt.decode(ALL_CODES)
    assert decoded.dtype == np.int16 and decoded.shape == (256,)
    assert np.array_equal(decoded, decode(ALL_CODES))


def test_g711_silence_codes():
    silence = np.zeros(3, np.int16)
    assert ULAW.encode(silence) == b"\xff\xff\xff" and ALAW.encode(silence) == b"\xd5\xd5\xd5"
    assert not ULAW.decode(b"\xff\x7f").any()  # both μ-law zeros
    assert np.array_equal(ALAW.decode(b"\xd5\x55"), [8, -8])


@pytest.mark.parametrize("fmt", [ULAW, ALAW], ids=["ulaw", "alaw"])
def test_g711_round_trips_every_code(fmt: WireFormat):
    assert fmt.decode(fmt.encode(fmt.decode(ALL_CODES))).tolist() == fmt.decode(ALL_CODES).tolist()
    # and an encode-decode pass stays within the coarsest step of the companding (~1/16 of the value)
    pcm = np.linspace(-32000, 32000, 4001).astype(np.int16)
    error = np.abs(fmt.decode(fmt.encode(pcm)).astype(np.int32) - pcm)
    assert error.max() <= 1024 and np.all(error <= np.abs(pcm.astype(np.int32)) // 16 + 16)


@pytest.mark.parametrize("size", [1, 3, 161])
@pytest.mark.parametrize("fmt", [ULAW, ALAW], ids=["ulaw", "alaw"])
def test_g711_takes_any_byte_count(fmt: WireFormat, size: int):
    assert fmt.decode(b"\x80" * size).shape == (size,)


# -- edges shared by every format --


@pytest.mark.parametrize("fmt", [PCM16, ULAW, ALAW], ids=["pcm16", "ulaw", "alaw"])
def test_empty_audio_is_empty_both_ways(fmt: WireFormat):
    decoded = fmt.decode(b"")
    assert decoded.dtype == np.int16 and decoded.shape == (0,)
    assert fmt.encode(np.zeros(0, np.int16)) == b""


@pytest.mark.parametrize(
    ("fmt", "reference"),
    [
        (WireFormat(pb.PCM16, 48000), lambda x: x),
        (ULAW, lambda x: ulaw_decode(ulaw_encode(x))),
        (ALAW, lambda x: alaw_decode(alaw_encode(x))),
    ],
    ids=["pcm16", "ulaw", "alaw"],
)
def test_a_large_chunk_has_no_limit_here(fmt: WireFormat, reference):
    # the size limit is gRPC's max message length (test_grpc); the codec takes a minute at once
    samples = np.random.default_rng(0).integers(-32768, 32768, fmt.sample_rate * 60).astype(np.int16)
    wire = fmt.encode(samples)
    assert len(wire) == samples.size * (2 if fmt.law is None else 1)
    assert np.array_equal(fmt.decode(wire), reference(samples))


@pytest.mark.parametrize("fmt", [PCM16, ULAW, ALAW], ids=["pcm16", "ulaw", "alaw"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_encoding_anything_but_int16_samples_is_a_type_error(fmt: WireFormat, dtype):
    # float audio in [-1, 1] cast to int16 is silence, int32 is wrapped: both are a bug upstream,
    # and every encoding must say so rather than send it.
    with pytest.raises(TypeError, match="int16"):
        fmt.encode(np.full(160, 0.5, dtype))
