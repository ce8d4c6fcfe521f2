"""A SIP call's media: the caller's RTP in, decoded into the session, and the session's
audio out as RTP on the call's own clock. The dialog that sets a call up and ends it
is `duplex.transports.sip`; what both keep of a call is `duplex.transports.sip_call`.

    RTP in ─► the caller's source (latched), its payload type ─► JitterBuffer ─► G.711 ─► session
    session audio ─► 8 kHz G.711 (RtpWire) ─► send_rtp (a packet every 20 ms: reply or silence)

Media goes to the caller's own address (where its SIP came from), never to another host
its SDP names unless that host is on the allow-list: otherwise one INVITE would aim 50
packets a second at a third party. RTP is latched to the caller's actual source
(symmetric RTP: a caller behind NAT sends from another port than its SDP says); RTP
from any other source, or with a payload type not negotiated, is counted and dropped.
Our RTP starts only with the ACK or the caller's first RTP, so an INVITE alone, perhaps
from a forged address, starts no stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np
from prometheus_client import Counter

from audio_io.frame import AudioFrame, Int16Array
from audio_io.g711 import alaw_encode, ulaw_encode
from audio_io.outbox import Outbox
from audio_io.rtp import PCMU, RtpError, RtpPacket
from duplex.events import Event
from duplex.transports.output import Cursor
from duplex.transports.sip_call import Datagrams, SipCall

log = logging.getLogger("duplex.sip")

RATE = 8000
FRAME = 160  # 20 ms

RTP_DROPPED = Counter("duplex_sip_rtp_dropped_total", "RTP packets dropped", ["reason"])


class RtpWire:
    """A call's output: reply audio as 20 ms G.711 payloads, sent on the call's RTP
    clock (`send_rtp`); events have no place on the wire."""

    transport = "sip"
    rate = RATE

    def __init__(self, codec: int) -> None:
        self.encode = ulaw_encode if codec == PCMU else alaw_encode

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[bytes]:
        return [self.encode(samples).tobytes()]

    def event(self, event: Event) -> list[bytes]:
        return []

    def end_reply(self, cursor: Cursor, completed: bool) -> list[bytes]:
        return []

    def flushed(self) -> list[bytes]:
        return []


def media_host(offered: str, caller: str, gateway: Callable[[str], bool]) -> str:
    """Where a call's media goes: the caller's own (signalling) address, whatever its
    SDP says, unless the SDP names a ``gateway`` (an address on the allow-list: a media
    gateway). Never a third party the caller names: 50 packets a second of our audio
    would go there, a reflection amplifier."""
    if offered == caller or gateway(offered):
        return offered
    log.info("sip: the SDP names %s, the call's media goes to its caller %s", offered, caller)
    return caller


def heard_from(call: SipCall, addr: tuple[str, int]) -> bool:
    """Is this RTP the caller's? Symmetric RTP: the first packet from the caller's host
    fixes the port (a caller behind NAT sends from another port than its SDP says),
    and a packet from exactly the address in its SDP always wins it back."""
    offered = (call.offer.address, call.offer.port)
    if addr == call.media:
        call.latched = True
        return True
    if addr[0] != call.media[0] or (call.latched and addr != offered):
        return False
    call.media, call.latched = addr, True
    return True


async def open_rtp(call: SipCall, host: str) -> None:
    """The call's RTP socket, on ``host`` (the listener's address) and any port."""
    rtp = call.rtp = Datagrams(lambda data, addr: receive_rtp(call, data, addr))
    await asyncio.get_running_loop().create_datagram_endpoint(lambda: rtp, local_addr=(host, 0))


def close_rtp(call: SipCall) -> None:
    if call.rtp is not None and call.rtp.transport is not None:
        call.rtp.transport.close()


def receive_rtp(call: SipCall, data: bytes, addr: tuple[str, int]) -> None:
    """A datagram on the call's RTP socket: the caller's audio into its session, or a
    DTMF digit; anything else counted and dropped."""
    session = call.session
    if session is None or call.ended:
        return
    if not heard_from(call, addr):
        RTP_DROPPED.labels("unknown_source").inc()
        return
    try:
        packet = RtpPacket.parse(data)
    except RtpError:
        RTP_DROPPED.labels("malformed").inc()
        return
    call.media_ready.set()  # the caller is there, at the address we will send to
    if packet.payload_type == call.codec:
        for out in call.jitter.push(packet):
            if out.payload:
                samples = call.concealer.good(call.decode(out.payload))
            else:
                samples = call.concealer.conceal(out.concealed)
            session.push_audio(AudioFrame(samples, RATE))
    elif packet.payload_type == call.offer.telephone_event:
        try:
            digit = call.dtmf.push(packet)
        except RtpError:
            RTP_DROPPED.labels("malformed").inc()
            return
        if digit is not None:
            session.dtmf(digit)
    else:
        RTP_DROPPED.labels("payload_type").inc()


async def send_rtp(call: SipCall, outbox: Outbox[bytes]) -> None:
    """A packet every 20 ms on a drift-free clock: the reply's audio, or silence; from
    the ACK or the caller's first RTP on (an INVITE alone, perhaps from a forged
    address, starts no stream)."""
    await call.media_ready.wait()
    assert call.rtp is not None and call.rtp.transport is not None
    transport = call.rtp.transport
    silence = (ulaw_encode if call.codec == PCMU else alaw_encode)(np.zeros(FRAME, np.int16)).tobytes()
    ssrc = int.from_bytes(np.random.default_rng().bytes(4), "big")
    sequence, timestamp = int(np.random.default_rng().integers(65536)), 0
    start, k, first = time.monotonic(), 0, True
    while True:
        payload = outbox.next_audio() or silence
        packet = RtpPacket(call.codec, sequence, timestamp, ssrc, payload, marker=first)
        transport.sendto(packet.build(), call.media)
        first = False
        sequence, timestamp = (sequence + 1) % 65536, (timestamp + FRAME) % (1 << 32)
        k += 1
        delay = start + k * 0.020 - time.monotonic()
        if delay < -0.1:  # stalled: start the grid again rather than burst
            start, k, delay = time.monotonic(), 0, 0.0
        await asyncio.sleep(max(0.0, delay))
