"""A SIP call's state, shared by its two sides: the dialog (`duplex.transports.sip`:
the INVITE, the tags that name the dialog, the ACK, who hangs up) and the media
(`duplex.transports.sip_media`: the RTP socket, where RTP goes and comes from, the
receive path's jitter buffer, concealment and DTMF); and the messages of its dialog
that are built from that state alone (our 200's headers and SDP answer, our BYE).
What happens to a call happens in those two modules.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from audio_io import sip
from audio_io.frame import Int16Array
from audio_io.g711 import alaw_decode, ulaw_decode
from audio_io.rtp import PCMU, Concealer, DtmfReceiver, JitterBuffer
from duplex.port import SessionPort
from duplex.transports.link import Link
from duplex.transports.output import OutputStage

log = logging.getLogger("duplex.sip")

ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS"


class Datagrams(asyncio.DatagramProtocol):
    """A UDP socket's datagrams handed to ``receive``: the listener's SIP, a call's RTP."""

    def __init__(self, receive: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.receive = receive
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.receive(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("sip: socket error %s", exc)  # e.g. ICMP port unreachable from a gone peer


@dataclass(eq=False)
class SipCall:
    call_id: str
    invite: sip.SipMessage
    signaling: tuple[str, int]  # where the caller's SIP comes from (responses and our BYE go there)
    to_tag: str
    offer: sip.Offer
    codec: int
    local_address: str
    rtp: Datagrams | None = None
    session: SessionPort | None = None
    stage: OutputStage[bytes] | None = None
    link: Link | None = None
    final: bytes = b""  # the final response to the INVITE, for retransmissions
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    media_ready: asyncio.Event = field(default_factory=asyncio.Event)  # ACK or the caller's RTP: ours may go
    ended: bool = False
    hang_up: bool = True  # we end the call (BYE); False once the caller has (BYE, CANCEL)
    media: tuple[str, int] = ("", 0)  # where our RTP goes and theirs must come from (`heard_from`)
    latched: bool = False  # RTP has come from ``media``: it is the caller's actual source
    jitter: JitterBuffer = field(default_factory=JitterBuffer)
    concealer: Concealer = field(default_factory=Concealer)
    dtmf: DtmfReceiver = field(default_factory=DtmfReceiver)
    cseq: int = 1  # our requests in this dialog

    @property
    def rtp_port(self) -> int:
        assert self.rtp is not None and self.rtp.transport is not None
        return int(self.rtp.transport.get_extra_info("sockname")[1])

    def decode(self, payload: bytes) -> Int16Array:
        return ulaw_decode(payload) if self.codec == PCMU else alaw_decode(payload)


@dataclass(eq=False)
class Answering:
    """An INVITE whose session is being opened: what a CANCEL or the INVITE again must
    match, and a place among the unconfirmed calls."""

    invite: sip.SipMessage
    signaling: tuple[str, int]
    task: asyncio.Task[None]
    to_tag: str = ""  # none given yet: only the INVITE's own transaction matches


def ok_headers(call: SipCall, port: int) -> list[tuple[str, str]]:
    """Headers of a 200 OK with our SDP; ``port``: the listener's SIP port."""
    return [
        ("contact", f"<sip:duplex@{call.local_address}:{port}>"),
        ("allow", ALLOW),
        ("content-type", "application/sdp"),
    ]


def answer_sdp(call: SipCall) -> bytes:
    return sip.answer_sdp(
        call.local_address, call.rtp_port, call.codec, call.offer.telephone_event, id(call) % 10**9
    )


def bye_request(call: SipCall, port: int) -> sip.SipMessage:
    """Our BYE in the call's dialog, to the caller's Contact; the dialog's next CSeq."""
    invite = call.invite
    contact = re.search(r"<([^>]+)>", invite.get("contact")) or re.search(r"<([^>]+)>", invite.get("from"))
    uri = contact.group(1) if contact else invite.uri
    call.cseq += 1
    via = f"SIP/2.0/UDP {call.local_address}:{port};branch={sip.new_branch()};rport"
    headers = [
        ("via", via),
        ("max-forwards", "70"),
        (
            "from",
            f"{invite.get('to')};tag={call.to_tag}" if "tag=" not in invite.get("to") else invite.get("to"),
        ),
        ("to", invite.get("from")),
        ("call-id", call.call_id),
        ("cseq", f"{call.cseq} BYE"),
    ]
    return sip.SipMessage(method="BYE", uri=uri, headers=headers)
