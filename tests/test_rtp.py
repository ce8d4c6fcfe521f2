"""RTP packets, the jitter buffer, concealment and DTMF (audio_io/rtp.py), bytes only.

tests/test_sip.py has one walk through each of these; here each behaviour is pinned
on its own, with its edges (wraparound, the misorder and gap limits, padding)."""

import struct

import numpy as np
import pytest

from audio_io.rtp import (
    EVENTS,
    MAX_GAP_SAMPLES,
    MAX_MISORDER,
    Concealer,
    DtmfReceiver,
    JitterBuffer,
    Released,
    RtpError,
    RtpPacket,
)

FRAME = 160  # 20 ms of G.711 at 8 kHz: one byte a sample


def packet(seq: int, ts: int | None = None, ssrc: int = 7, payload: bytes | None = None) -> RtpPacket:
    """Sequence ``seq`` (mod 2**16), 20 ms apart by default, its payload marked by ``seq``."""
    ts = seq * FRAME if ts is None else ts
    body = bytes([seq % 256]) * FRAME if payload is None else payload
    return RtpPacket(0, seq % 65536, ts % (1 << 32), ssrc, body)


def out(seq: int) -> Released:
    return Released(bytes([seq % 256]) * FRAME)


def lost(samples: int) -> Released:
    return Released(concealed=samples)


def header(first: int = 0x80, second: int = 0, seq: int = 1, ts: int = 2, ssrc: int = 3) -> bytes:
    return struct.pack("!BBHII", first, second, seq, ts, ssrc)


# -- packets --


@pytest.mark.parametrize(
    "p",
    [
        RtpPacket(0, 0, 0, 0, b""),
        RtpPacket(8, 65535, (1 << 32) - 1, (1 << 32) - 1, b"\xd5" * FRAME, marker=True),
        RtpPacket(101, 12345, 800, 0xDEADBEEF, b"\x05\x80\x01\xe0"),
        RtpPacket(127, 1, 1, 1, bytes(range(256)), marker=False),
    ],
    ids=["empty", "limits-marker", "dtmf", "pt127"],
)
def test_a_packet_round_trips(p: RtpPacket):
    assert RtpPacket.parse(p.build()) == p


def test_build_writes_the_rfc3550_header():
    p = RtpPacket(8, 0x1234, 0xDEADBEEF, 0x01020304, b"\xd5\xd5", marker=True)
    assert p.build() == bytes([0x80, 0x88, 0x12, 0x34, 0xDE, 0xAD, 0xBE, 0xEF, 1, 2, 3, 4, 0xD5, 0xD5])
    assert RtpPacket(0, 1, 2, 3, b"").build() == bytes([0x80, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3])


def test_parse_reads_marker_and_payload_type_from_one_byte():
    p = RtpPacket.parse(header(second=0x80 | 101) + b"x")
    assert (p.marker, p.payload_type, p.sequence, p.timestamp, p.ssrc) == (True, 101, 1, 2, 3)
    assert RtpPacket.parse(header(second=0x7F)).payload_type == 127
    assert RtpPacket.parse(header(second=0x7F)).marker is False


def test_csrcs_are_skipped():
    raw = header(first=0x82) + struct.pack("!II", 11, 12) + b"audio"
    assert RtpPacket.parse(raw).payload == b"audio"


def test_a_header_extension_is_skipped_by_its_length():
    extension = struct.pack("!HH", 0xBEDE, 2) + b"\x11" * 8
    assert RtpPacket.parse(header(first=0x90) + extension + b"audio").payload == b"audio"
    empty_extension = struct.pack("!HH", 0x1000, 0)
    assert RtpPacket.parse(header(first=0x90) + empty_extension + b"audio").payload == b"audio"


def test_padding_is_removed_by_its_count():
    assert RtpPacket.parse(header(first=0xA0) + b"audio" + b"\0\0\3").payload == b"audio"
    assert RtpPacket.parse(header(first=0xA0) + b"audio" + b"\1").payload == b"audio"
    assert RtpPacket.parse(header(first=0xA0) + b"\0\0\0\4").payload == b""  # all padding


def test_csrcs_extension_and_padding_together():
    raw = header(first=0xB1, second=0x80) + struct.pack("!I", 9) + struct.pack("!HH", 0xBEDE, 1) + b"\0" * 4
    p = RtpPacket.parse(raw + b"\x55" * FRAME + b"\0\0\3")
    assert p.payload == b"\x55" * FRAME and p.marker and (p.sequence, p.timestamp, p.ssrc) == (1, 2, 3)


def test_padding_only_bit_unset_keeps_the_trailing_bytes():
    assert RtpPacket.parse(header() + b"audio\0\0\3").payload == b"audio\0\0\3"


@pytest.mark.parametrize("size", range(12))
def test_shorter_than_a_header_is_an_error(size: int):
    with pytest.raises(RtpError, match="shorter than an RTP header"):
        RtpPacket.parse(header()[:size])


def test_exactly_a_header_is_an_empty_packet():
    assert RtpPacket.parse(header()).payload == b""


@pytest.mark.parametrize("version", [0, 1, 3])
def test_other_versions_are_an_error(version: int):
    with pytest.raises(RtpError, match=f"RTP version {version}"):
        RtpPacket.parse(header(first=version << 6) + b"audio")


@pytest.mark.parametrize(
    "raw",
    [
        header(first=0x8F) + b"\0" * 56,  # 15 CSRCs announced, 14 present
        header(first=0x90),  # extension bit, no extension header
        header(first=0x90) + b"\xbe\xde",  # half an extension header
        header(first=0x90) + struct.pack("!HH", 0xBEDE, 3) + b"\0" * 8,  # 3 words announced, 2 present
        header(first=0xA0) + b"\0\x10",  # 16 bytes of padding in a 2-byte payload
        header(first=0xA0) + b"\xff",  # padding into the header
        header(first=0xA1) + struct.pack("!I", 9) + b"\x06",  # padding over the CSRC
    ],
    ids=["csrcs", "no-ext", "half-ext", "short-ext", "padding", "pad-header", "pad-csrc"],
)
def test_truncated_or_overpadded_packets_are_an_error(raw: bytes):
    with pytest.raises(RtpError):
        RtpPacket.parse(raw)


def test_a_padding_count_of_zero_is_an_error():
    # RFC 3550 5.1: the last padding octet counts the padding *including itself*, so 0 is
    # impossible; a packet claiming it is malformed (aiortc refuses it too).
    with pytest.raises(RtpError):
        RtpPacket.parse(header(first=0xA0) + b"audio\0")


# -- the jitter buffer --


def push_all(buffer: JitterBuffer, *packets: RtpPacket) -> list[list[Released]]:
    return [buffer.push(p) for p in packets]


def test_in_order_packets_are_released_at_once():
    buffer = JitterBuffer()
    assert push_all(buffer, *(packet(s) for s in range(40, 50))) == [[out(s)] for s in range(40, 50)]
    assert (buffer.received, buffer.lost, buffer.late, buffer.restarts) == (10, 0, 0, 0)


def test_the_first_packet_starts_the_stream_wherever_it_is():
    assert JitterBuffer().push(packet(60000, ts=123)) == [out(60000)]


def test_a_reordered_packet_within_depth_releases_the_held_ones():
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, packet(5), packet(6), packet(8), packet(9), packet(7)) == [
        [out(5)],
        [out(6)],
        [],
        [],
        [out(7), out(8), out(9)],
    ]
    assert (buffer.lost, buffer.late) == (0, 0)


def test_a_gap_is_given_up_when_depth_packets_wait_behind_it():
    # the module's diagram: 5 6 8 9 10 11 -> 5 6 | (hold 8 9 10) | [conceal 7] 8 9 10 11
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, packet(5), packet(6), packet(8), packet(9), packet(10), packet(11)) == [
        [out(5)],
        [out(6)],
        [],
        [],
        [lost(FRAME), out(8), out(9), out(10)],
        [out(11)],
    ]
    assert buffer.lost == 1
    assert buffer.push(packet(7)) == [] and buffer.late == 1  # too late now


def test_depth_one_gives_a_gap_up_at_once():
    buffer = JitterBuffer(depth=1)
    assert push_all(buffer, packet(5), packet(8)) == [[out(5)], [lost(2 * FRAME), out(8)]]
    assert buffer.lost == 2


def test_concealment_follows_the_timestamps_not_the_numbering():
    # 6 is lost, and the sender sent nothing for 320 samples of silence after it: 5 ends
    # at 960, 7 starts at 1440, so 480 samples are concealed for one lost packet
    buffer = JitterBuffer(depth=3)
    buffer.push(packet(5, ts=800))
    held = [packet(s, ts=1440 + (s - 7) * FRAME) for s in (7, 8, 9)]
    assert push_all(buffer, *held) == [[], [], [lost(480), out(7), out(8), out(9)]]
    assert buffer.lost == 1


def test_only_one_gap_is_given_up_at_a_time():
    buffer = JitterBuffer(depth=3)
    buffer.push(packet(5))
    assert push_all(buffer, packet(7), packet(9), packet(10)) == [[], [], [lost(FRAME), out(7)]]
    assert buffer.push(packet(8)) == [out(8), out(9), out(10)]  # the second gap filled in time
    assert buffer.lost == 1


def test_sequence_numbers_wrap_from_65535_to_0():
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, *(packet(s) for s in (65534, 65535, 65536, 65537))) == [
        [out(65534)],
        [out(65535)],
        [out(0)],
        [out(1)],
    ]
    assert buffer.restarts == 0 and buffer.late == 0


def test_reordering_and_loss_across_the_wrap():
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, packet(65534), packet(65536), packet(65535)) == [
        [out(65534)],
        [],
        [out(65535), out(0)],
    ]
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, packet(65534), packet(65536), packet(65537), packet(65538)) == [
        [out(65534)],
        [],
        [],
        [lost(FRAME), out(0), out(1), out(2)],
    ]
    assert buffer.lost == 1 and buffer.restarts == 0
    assert buffer.push(packet(65535)) == [] and buffer.late == 1


def test_timestamps_wrap_too():
    buffer = JitterBuffer()
    top = (1 << 32) - FRAME
    assert push_all(buffer, packet(1, ts=top), packet(2, ts=0), packet(3, ts=FRAME)) == [
        [out(1)],
        [out(2)],
        [out(3)],
    ]
    assert buffer.restarts == 0


def test_a_repeated_packet_is_dropped_and_counted_late():
    buffer = JitterBuffer()
    assert push_all(buffer, packet(5), packet(6), packet(6), packet(5)) == [[out(5)], [out(6)], [], []]
    assert (buffer.received, buffer.late) == (4, 2)


def test_a_repeated_held_packet_is_released_once_and_counts_once_toward_depth():
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, packet(5), packet(7), packet(7), packet(7)) == [[out(5)], [], [], []]
    assert buffer.push(packet(6)) == [out(6), out(7)]
    assert buffer.lost == 0


def test_the_misorder_limit():
    buffer = JitterBuffer(depth=3)
    buffer.push(packet(1000, ts=0))
    # the next expected is 1001; up to MAX_MISORDER behind it is late
    assert buffer.push(packet(1001 - MAX_MISORDER, ts=0)) == [] and buffer.late == 1
    assert buffer.restarts == 0
    # one further behind: the sender restarted its numbering
    behind = packet(1000 - MAX_MISORDER, ts=FRAME)
    assert buffer.push(behind) == [out(behind.sequence)] and buffer.restarts == 1


def test_the_jump_limit_in_numbering():
    buffer = JitterBuffer(depth=3)
    buffer.push(packet(0, ts=0))
    ahead = packet(1 + MAX_MISORDER, ts=FRAME)  # far ahead, but a small timestamp step
    assert buffer.push(ahead) == [] and buffer.restarts == 0  # held: reordering explains it
    further = packet(2 + MAX_MISORDER, ts=2 * FRAME)
    buffer = JitterBuffer(depth=3)
    buffer.push(packet(0, ts=0))
    assert buffer.push(further) == [out(further.sequence)] and buffer.restarts == 1


def test_the_jump_limit_in_timestamps():
    buffer = JitterBuffer()
    buffer.push(packet(1, ts=0))
    assert buffer.push(packet(2, ts=FRAME + MAX_GAP_SAMPLES)) == [out(2)]
    assert buffer.restarts == 0
    next_ts = 2 * FRAME + MAX_GAP_SAMPLES
    assert buffer.push(packet(3, ts=next_ts + MAX_GAP_SAMPLES + 1)) == [out(3)]
    assert buffer.restarts == 1
    assert buffer.push(packet(4, ts=0)) == [out(4)]  # timestamps going back: a new stream too
    assert buffer.restarts == 2 and buffer.lost == 0


def test_a_new_ssrc_starts_afresh_and_drops_what_was_held():
    buffer = JitterBuffer(depth=3)
    assert push_all(buffer, packet(5), packet(7), packet(5, ssrc=8)) == [[out(5)], [], [out(5)]]
    assert buffer.restarts == 1
    assert buffer.push(packet(6, ssrc=8)) == [out(6)]  # not the old source's 7 after it
    assert buffer.push(packet(7, ssrc=8)) == [out(7)]
    assert buffer.push(packet(8)) == [out(8)] and buffer.restarts == 2  # the old source again: afresh
    assert buffer.lost == 0


def test_a_restart_drops_the_held_packets():
    buffer = JitterBuffer(depth=3)
    jump = 6 * FRAME + MAX_GAP_SAMPLES + 1  # 6 comes a second and more after 5: a new stream
    assert push_all(buffer, packet(5), packet(7), packet(6, ts=jump)) == [[out(5)], [], [out(6)]]
    assert buffer.restarts == 1
    assert buffer.push(packet(8, ts=jump + 2 * FRAME)) == []  # 7 of the old stream is gone


# -- concealment --


def test_with_no_good_frame_concealment_is_silence():
    filled = Concealer().conceal(FRAME)
    assert filled.dtype == np.int16 and filled.shape == (FRAME,) and not filled.any()
    assert Concealer().conceal(0).shape == (0,)


def test_good_frames_pass_through():
    concealer = Concealer()
    frame = np.arange(FRAME, dtype=np.int16)
    assert concealer.good(frame) is frame


def test_concealment_repeats_the_last_frame_fading_over_two_frames_then_silence():
    concealer = Concealer()
    concealer.good(np.full(FRAME, 1000, np.int16))
    filled = concealer.conceal(3 * FRAME)
    assert filled.dtype == np.int16 and filled.shape == (3 * FRAME,)
    assert filled[0] == 1000 and filled[2 * FRAME - 1] == 0
    assert filled[FRAME] == 498  # 1000 * (1 - 160/319): a linear fade over 320 samples
    assert np.all(np.diff(filled[: 2 * FRAME].astype(np.int32)) <= 0)  # never louder again
    assert filled[FRAME - 1] > filled[FRAME + 1]  # and falling across the frame boundary
    assert not filled[2 * FRAME :].any()


def test_concealment_repeats_the_waveform_not_a_level():
    concealer = Concealer()
    concealer.good(np.tile(np.array([2000, -2000], np.int16), FRAME // 2))
    filled = concealer.conceal(2 * FRAME)[:-1]  # the last sample is faded to 0
    assert np.all(filled[::2] > 0) and np.all(filled[1::2] < 0)
    assert np.all(np.diff(np.abs(filled[::2].astype(np.int32))) <= 0)


def test_a_short_span_fades_within_itself_and_a_second_span_is_silent():
    concealer = Concealer()
    concealer.good(np.full(FRAME, -32768, np.int16))
    filled = concealer.conceal(100)
    assert filled.shape == (100,) and filled[0] == -32768 and filled[-1] == 0
    assert not concealer.conceal(FRAME).any()  # the faded frame is not repeated again
    concealer.good(np.full(FRAME, 7, np.int16))
    assert concealer.conceal(FRAME)[0] == 7  # a good frame rearms it


# -- DTMF (RFC 4733) --


def event(key: int, ts: int, duration: int, end: bool = False, seq: int = 1) -> RtpPacket:
    payload = struct.pack("!BBH", key, (0x80 if end else 0) | 10, duration)
    return RtpPacket(101, seq, ts, 7, payload)


def press(key: int, ts: int) -> list[RtpPacket]:
    """One key press as a sender writes it: updates every 20 ms, the end packet three times."""
    updates = [event(key, ts, d) for d in (FRAME, 2 * FRAME, 3 * FRAME)]
    return updates + [event(key, ts, 4 * FRAME, end=True)] * 3


def test_a_press_is_reported_once_at_its_first_packet():
    dtmf = DtmfReceiver()
    assert [dtmf.push(p) for p in press(5, 800)] == ["5", None, None, None, None, None]


def test_repeated_end_packets_count_once_even_without_the_start():
    dtmf = DtmfReceiver()
    ends = [event(11, 800, 4 * FRAME, end=True)] * 3
    assert [dtmf.push(p) for p in ends] == ["#", None, None]


def test_the_same_key_twice_is_two_presses():
    dtmf = DtmfReceiver()
    reported = [dtmf.push(p) for p in press(1, 800) + press(1, 2400)]
    assert [d for d in reported if d is not None] == ["1", "1"]


@pytest.mark.parametrize("key", range(16))
def test_every_dtmf_event_maps_to_its_key(key: int):
    assert DtmfReceiver().push(event(key, 800, FRAME)) == "0123456789*#ABCD"[key] == EVENTS[key]


@pytest.mark.parametrize("key", [16, 32, 255])
def test_other_telephone_events_are_ignored(key: int):
    dtmf = DtmfReceiver()
    assert dtmf.push(event(key, 800, FRAME)) is None
    assert dtmf.push(event(3, 2400, FRAME)) == "3"


@pytest.mark.parametrize("payload", [b"", b"\x05", b"\x05\x80\x00"])
def test_a_short_event_payload_is_an_error(payload: bytes):
    with pytest.raises(RtpError, match="4 bytes"):
        DtmfReceiver().push(RtpPacket(101, 1, 800, 7, payload))


def test_a_late_end_packet_of_an_earlier_press_is_not_a_new_press():
    # The end packet is sent three times; one of them, delayed, may arrive after the next
    # press began. Its timestamp is older than the last reported one: the same press.
    dtmf = DtmfReceiver()
    first, second = press(1, 800), press(2, 2400)
    reported = [dtmf.push(p) for p in [*first[:4], *second[:2], first[4]]]
    assert reported == ["1", None, None, None, "2", None, None]
