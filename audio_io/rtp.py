"""RTP (RFC 3550) for G.711 calls: packets, a reordering jitter buffer with loss
concealment, and RFC 4733 telephone events (DTMF).

`JitterBuffer` takes packets as they arrive and gives back 20 ms payloads in order:

    arrive:  5 6 8 9 7 ...      ─►  release: 5 6 | (hold 8 9) | 7 8 9
    arrive:  5 6 8 9 10 11      ─►  release: 5 6 | (hold 8 9 10) | [conceal 7] 8 9 10 11

A packet in order is released at once; one after a gap is held until the missing one
comes or ``depth`` packets wait behind it (60 ms by default), then the gap is given up
and filled, by the RTP timestamps, with concealment (the last frame repeated, fading
out over two frames, then silence), so the session's clock stays the caller's. Late
and repeated packets are dropped. A new SSRC, or a jump in numbering or timestamps
no reordering explains, starts the stream afresh.

Bookkeeping only: bytes in, bytes out, no sockets, no clock.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from audio_io.frame import Int16Array

HEADER = struct.Struct("!BBHII")
VERSION = 2
PCMU, PCMA = 0, 8
MAX_MISORDER = 100  # further behind than this: the sender restarted its numbering
MAX_GAP_SAMPLES = 8000  # a gap longer than a second is a new stream, not loss
EVENTS = "0123456789*#ABCD"  # RFC 4733 DTMF events 0-15


class RtpError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RtpPacket:
    payload_type: int
    sequence: int
    timestamp: int
    ssrc: int
    payload: bytes
    marker: bool = False

    @classmethod
    def parse(cls, data: bytes) -> RtpPacket:
        if len(data) < HEADER.size:
            raise RtpError(f"{len(data)} bytes is shorter than an RTP header")
        first, second, sequence, timestamp, ssrc = HEADER.unpack_from(data)
        if first >> 6 != VERSION:
            raise RtpError(f"RTP version {first >> 6}, not 2")
        offset = HEADER.size + 4 * (first & 0x0F)  # CSRCs
        if first & 0x10:  # a header extension: its length is in 32-bit words
            if len(data) < offset + 4:
                raise RtpError("truncated header extension")
            offset += 4 + 4 * struct.unpack_from("!H", data, offset + 2)[0]
        end = len(data)
        if first & 0x20:  # padding: the last byte says how much, itself included (never 0)
            if data[-1] == 0:
                raise RtpError("RTP padding of 0 bytes")
            end -= data[-1]
        if offset > end:
            raise RtpError("truncated RTP packet")
        return cls(second & 0x7F, sequence, timestamp, ssrc, bytes(data[offset:end]), bool(second & 0x80))

    def build(self) -> bytes:
        second = (0x80 if self.marker else 0) | self.payload_type
        return HEADER.pack(VERSION << 6, second, self.sequence, self.timestamp, self.ssrc) + self.payload


@dataclass(frozen=True, slots=True)
class Released:
    """Audio to hand on: ``payload`` codes, or ``concealed`` samples for a lost span."""

    payload: bytes = b""
    concealed: int = 0  # samples of concealment (payload is empty then)


class JitterBuffer:
    def __init__(self, depth: int = 3) -> None:
        self.depth = depth
        self._ssrc: int | None = None
        self._next: int | None = None  # sequence number expected next
        self._next_ts = 0  # its timestamp
        self._held: dict[int, RtpPacket] = {}
        self.received = self.lost = self.late = self.restarts = 0

    def push(self, packet: RtpPacket) -> list[Released]:
        self.received += 1
        if self._ssrc != packet.ssrc or self._next is None:
            return self._restart(packet)
        ahead = (packet.sequence - self._next) % 65536
        if ahead >= 65536 - MAX_MISORDER:  # behind what was released: late or repeated
            self.late += 1
            return []
        if ahead > MAX_MISORDER or (packet.timestamp - self._next_ts) % (1 << 32) > MAX_GAP_SAMPLES:
            return self._restart(packet)
        self._held[packet.sequence] = packet
        out = self._release()
        if len(self._held) >= self.depth:  # waited long enough: give the gap up
            expected = self._next
            first = min(self._held.values(), key=lambda p: (p.sequence - expected) % 65536)
            gap = (first.sequence - expected) % 65536
            samples = (first.timestamp - self._next_ts) % (1 << 32)
            self.lost += gap
            self._next, self._next_ts = first.sequence, first.timestamp
            out.append(Released(concealed=samples))
            out += self._release()
        return out

    def _restart(self, packet: RtpPacket) -> list[Released]:
        if self._ssrc is not None:
            self.restarts += 1
        self._ssrc, self._held = packet.ssrc, {}
        self._next, self._next_ts = packet.sequence, packet.timestamp
        self._held[packet.sequence] = packet
        return self._release()

    def _release(self) -> list[Released]:
        out = []
        while self._next in self._held:
            packet = self._held.pop(self._next)
            out.append(Released(packet.payload))
            self._next = (self._next + 1) % 65536
            self._next_ts = (packet.timestamp + len(packet.payload)) % (1 << 32)
        return out


class Concealer:
    """Samples for a lost span: the last good frame again, fading out over two frames,
    then silence (a simple form of G.711 Appendix I's repetition)."""

    FADE_FRAMES = 2

    def __init__(self) -> None:
        self._last: Int16Array = np.zeros(0, np.int16)

    def good(self, samples: Int16Array) -> Int16Array:
        self._last = samples
        return samples

    def conceal(self, count: int) -> Int16Array:
        out = np.zeros(count, np.int16)
        last = self._last
        if last.size:
            span = min(count, last.size * self.FADE_FRAMES)
            repeated = np.resize(last, span).astype(np.float32)
            out[:span] = (repeated * np.linspace(1.0, 0.0, span, dtype=np.float32)).astype(np.int16)
        self._last = np.zeros(0, np.int16)
        return out


class DtmfReceiver:
    """RFC 4733 telephone events: each key press once (its packets share a timestamp,
    and the end packet is sent three times)."""

    def __init__(self) -> None:
        self._last: int | None = None  # timestamp of the last event reported

    def push(self, packet: RtpPacket) -> str | None:
        if len(packet.payload) < 4:
            raise RtpError("a telephone-event payload is 4 bytes")
        event = packet.payload[0]
        if event >= len(EVENTS):
            return None
        if self._last is not None and not 0 < (packet.timestamp - self._last) % (1 << 32) < 1 << 31:
            return None  # this press (its repeats), or a late packet of an earlier one
        self._last = packet.timestamp
        return EVENTS[event]
