"""The SIP/RTP listener (``--sip-port``): phone calls from a SIP phone, PBX or trunk,
one session each. Here the signalling: the dialogs, from the INVITE to the BYE. A
call's media (RTP both ways, G.711 to and from the session) is
`duplex.transports.sip_media`; the state both keep of a call, `duplex.transports.sip_call`.

    datagram ─► allow-list (before a byte is read) ─► parse
    INVITE (SDP offer) ─► digest auth ─► room for one more unconfirmed call ─► 100
        ─► codec (PCMU/PCMA, DTMF) ─► RTP socket + Session ─► 200 (SDP answer), resent until the ACK
    ACK (or the caller's first RTP) ─► our RTP starts
    BYE either way, CANCEL before the ACK, no ACK in time, the session's own end (idle
    timeout, shutdown) ─► the call and the session end together

Responses follow RFC 3261 for a UAS over UDP: Vias copied (with ``received`` and
``rport``), a To tag per dialog, retransmitted requests answered with the same
response. What is refused, and how: a source not on the allow-list gets nothing at all
(its datagrams are counted and dropped unread: no parsing, no reply), missing or wrong
credentials 401 (with a challenge), a malformed request 400, a body that is not SDP
415, no common codec 488, too many unconfirmed calls 503 (with Retry-After), no room
486 (503 while the models load), unknown methods 501. A request with the Call-ID of a
call (or of an INVITE being answered) belongs to it only if it has the dialog's tags
(`sip.in_dialog`: the caller's From tag, our To tag) and comes from the address and
port the INVITE came from; any other BYE, CANCEL or INVITE gets 481 and does not touch
the call (an ACK: nothing), as do requests outside any dialog. A datagram that cannot
be answered is counted and dropped.

An INVITE flood that never ACKs holds bounded state: calls being answered or answered
and not yet ACKed are at most `MAX_UNACKED` (8) in all and `MAX_UNACKED_PER_SOURCE`
(2) per source address (beyond, 503 before any work: no session, no socket); each is
sent no RTP, gets its 200 again after T1, 2*T1, ... (at most T2 apart), and without an
ACK in 64*T1 (``ack_timeout_s``, 32 s) it ends as RFC 3261 13.3.1.4 says: our BYE, its
session and RTP socket closed. The per-source cap also bounds what a spoofed source
makes us send its victim (a few 200s and a BYE per call, two calls at a time); it
bounds state, not availability: a flood from many addresses can keep the unconfirmed
calls full, and digest auth (``sip_username``) is what keeps strangers out.

A host name in the SDP is refused (400): it would be looked up on the event loop for
every packet.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Coroutine
from typing import Any

from prometheus_client import Counter

from audio_io import sip
from audio_io.rtp import PCMU
from duplex.config import Config
from duplex.events import SessionError
from duplex.port import SessionPort
from duplex.session_config import SessionConfig
from duplex.sessions import Sessions
from duplex.transports.link import Link
from duplex.transports.output import OutputStage
from duplex.transports.sip_call import (
    ALLOW,
    Answering,
    Datagrams,
    SipCall,
    answer_sdp,
    bye_request,
    ok_headers,
)
from duplex.transports.sip_media import RATE, RtpWire, close_rtp, media_host, open_rtp, send_rtp

log = logging.getLogger("duplex.sip")

T1, T2, ACK_TIMEOUT_S = 0.5, 4.0, 64 * 0.5  # RFC 3261 timers: 200 OK resent until the ACK
# Calls being answered or answered and not yet ACKed, in all and from one address: an
# honest caller ACKs within a round trip, so few are ever waiting; a flood that never
# ACKs holds no more than this many sessions and sockets for ACK_TIMEOUT_S.
MAX_UNACKED, MAX_UNACKED_PER_SOURCE = 8, 2

BAD_SIP = Counter("duplex_sip_bad_messages_total", "SIP datagrams refused or dropped", ["reason"])


def parse_networks(spec: str | None) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(n.strip(), strict=False) for n in (spec or "").split(",") if n.strip()]


def _route_address(peer: str) -> str:
    """Our address on the route to ``peer`` (for SDP when listening on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sip: %s failed", task.get_name(), exc_info=task.exception())


class SipListener:
    """A SIP user agent server on UDP; every call a session.

    ``ack_timeout_s``, ``max_unacked`` and ``max_unacked_per_source``: the bounds on
    calls answered and not yet ACKed (module docstring); tests make them small."""

    def __init__(
        self,
        config: Config,
        sessions: Sessions,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        max_unacked: int = MAX_UNACKED,
        max_unacked_per_source: int = MAX_UNACKED_PER_SOURCE,
    ) -> None:
        self.config = config
        self.sessions = sessions
        self.ack_timeout_s = ack_timeout_s
        self.max_unacked = max_unacked
        self.max_unacked_per_source = max_unacked_per_source
        self.allow = parse_networks(config.sip_allow)
        self.auth = (
            sip.DigestAuth(config.sip_username, config.sip_password)
            if config.sip_username and config.sip_password
            else None
        )
        self.calls: dict[str, SipCall] = {}  # by Call-ID
        self._pending: dict[str, Answering] = {}  # INVITEs being answered, by Call-ID
        self._tasks: set[asyncio.Task[None]] = set()
        self._endpoint: Datagrams | None = None

    @property
    def port(self) -> int:
        assert self._endpoint is not None and self._endpoint.transport is not None
        return int(self._endpoint.transport.get_extra_info("sockname")[1])

    async def start(self) -> None:
        endpoint = self._endpoint = Datagrams(self._datagram)
        await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: endpoint, local_addr=(self.config.host, self.config.sip_port or 0)
        )
        log.info("sip: listening on udp %s:%d", self.config.host, self.port)

    async def stop(self) -> None:
        tasks = [answering.task for answering in self._pending.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(self._end(c, bye=True) for c in list(self.calls.values())))
        if self._endpoint is not None and self._endpoint.transport is not None:
            self._endpoint.transport.close()

    # -- signaling --

    def _send(self, message: sip.SipMessage, addr: tuple[str, int]) -> bytes:
        data = message.to_bytes()
        if self._endpoint is not None and self._endpoint.transport is not None:
            self._endpoint.transport.sendto(data, addr)
        return data

    def _reply(self, request: sip.SipMessage, addr: tuple[str, int], status: int, to_tag: str = "",
               extra: list[tuple[str, str]] | None = None, body: bytes = b"") -> bytes:  # fmt: skip
        return self._send(sip.response(request, status, to_tag, extra, body, source=addr), addr)

    def _allowed(self, host: str) -> bool:
        if not self.allow:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.allow)

    def _media_host(self, offered: str, caller: str) -> str:
        """Where a call's media goes (`sip_media.media_host`): an address in its SDP only
        if that is the caller's own or on the allow-list."""
        return media_host(offered, caller, lambda host: bool(self.allow) and self._allowed(host))

    def _datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        if not self._allowed(addr[0]):
            BAD_SIP.labels("forbidden").inc()
            return  # unread and unanswered: a stranger costs no parsing and learns nothing
        if data.strip() == b"":
            return  # a keep-alive (CRLF ping)
        try:
            message = sip.parse(data)
        except sip.SipError as e:
            BAD_SIP.labels("malformed").inc()
            partial = e.partial
            if partial is not None and partial.is_request and partial.get("via") and partial.method != "ACK":
                self._reply(partial, addr, 400, extra=[("warning", f'399 duplex "{str(e)[:80]}"')])
            log.debug("sip: dropped a malformed datagram from %s: %s", addr, e)
            return
        if not message.is_request:
            return  # responses to our BYEs: nothing to do
        handler = {
            "INVITE": self._invite,
            "ACK": self._ack,
            "BYE": self._bye,
            "CANCEL": self._cancel,
            "OPTIONS": self._options,
        }.get(message.method)
        if handler is None:
            BAD_SIP.labels("not_implemented").inc()
            self._reply(message, addr, 501, extra=[("allow", ALLOW)])
            return
        handler(message, addr)

    def _options(self, request: sip.SipMessage, addr: tuple[str, int]) -> None:
        self._reply(request, addr, 200, sip.new_tag(), [("allow", ALLOW), ("accept", "application/sdp")])

    def _dialog(self, request: sip.SipMessage, addr: tuple[str, int]) -> SipCall | Answering | None:
        """The call (or INVITE being answered) with this request's Call-ID, if the request
        is of its dialog and comes from where its INVITE came from; None otherwise (and,
        when the Call-ID alone matched, counted)."""
        known: SipCall | Answering | None = self.calls.get(request.call_id)
        if known is None:  # a call wins: its answering task may not have popped itself yet
            known = self._pending.get(request.call_id)
        if known is None:
            return None
        if addr != known.signaling or not sip.in_dialog(request, known.invite, known.to_tag):
            BAD_SIP.labels("not_in_dialog").inc()
            log.debug(
                "sip: a %s for call %s from %s is not of its dialog", request.method, request.call_id, addr
            )
            return None
        return known

    def _unacked(self, host: str) -> tuple[int, int]:
        """Calls being answered or answered and not yet ACKed: in all, and from ``host``."""
        sources = [a.signaling[0] for cid, a in self._pending.items() if cid not in self.calls]
        sources += [c.signaling[0] for c in self.calls.values() if not c.acked.is_set()]
        return len(sources), sources.count(host)

    def _invite(self, request: sip.SipMessage, addr: tuple[str, int]) -> None:
        if request.call_id in self.calls or request.call_id in self._pending:
            known = self._dialog(request, addr)
            if known is None:
                self._reply(request, addr, 481)
            elif isinstance(known, SipCall) and not sip.param(request.get("to"), "tag"):  # the INVITE again
                if known.final:
                    self._endpoint.transport.sendto(known.final, addr)  # type: ignore[union-attr]
            elif isinstance(known, SipCall):  # a re-INVITE (refresh, hold): the same media, still here
                self._reply(request, addr, 200, known.to_tag, ok_headers(known, self.port), answer_sdp(known))
            return  # (being answered: the 100 already went)
        if self.auth is not None and not self.auth.check(request):
            BAD_SIP.labels("unauthorized").inc()
            self._reply(request, addr, 401, sip.new_tag(), [("www-authenticate", self.auth.challenge())])
            return
        waiting, from_there = self._unacked(addr[0])
        if waiting >= self.max_unacked or from_there >= self.max_unacked_per_source:
            BAD_SIP.labels("unacked").inc()
            self._reply(request, addr, 503, sip.new_tag(), [("retry-after", "2")])
            return
        self._reply(request, addr, 100)
        call_id = request.call_id
        task = asyncio.create_task(self._answer(request, addr), name=f"sip-invite-{call_id[:16]}")
        self._pending[call_id] = Answering(request, addr, task)
        task.add_done_callback(lambda _: self._pending.pop(call_id, None))
        task.add_done_callback(_log_failure)

    async def _answer(self, request: sip.SipMessage, addr: tuple[str, int]) -> None:
        to_tag = sip.new_tag()
        content_type = request.get("content-type", "application/sdp").split(";")[0].strip().lower()
        if not request.body or content_type != "application/sdp":
            self._reply(request, addr, 415 if request.body else 488, to_tag, [("accept", "application/sdp")])
            return
        try:
            offer = sip.parse_offer(request.body)
        except sip.SipError as e:
            self._reply(request, addr, 400, to_tag, [("warning", f'399 duplex "{str(e)[:80]}"')])
            return
        if not offer.codecs:
            BAD_SIP.labels("no_codec").inc()
            self._reply(request, addr, 488, to_tag, [("warning", '304 duplex "PCMU or PCMA only"')])
            return
        try:
            self.sessions.check_room()
        except SessionError as e:
            status = 503 if e.code == "not_ready" else 486
            self._reply(request, addr, status, to_tag, [("retry-after", "5")] if status == 503 else [])
            return
        host = self.config.sip_public_address or self.config.host
        if host in ("0.0.0.0", "::"):
            host = _route_address(addr[0])
        call = SipCall(request.call_id, request, addr, to_tag, offer, offer.codecs[0], host)
        call.media = (self._media_host(offer.address, addr[0]), offer.port)
        try:
            session = await self._open(call)
        except SessionError as e:
            close_rtp(call)
            self._reply(request, addr, 503 if e.code == "not_ready" else 486, to_tag)
            return
        except BaseException:  # cancelled (CANCEL, shutdown) or a bug: nothing stays open
            close_rtp(call)
            raise
        self.calls[call.call_id] = call
        call.final = self._reply(request, addr, 200, to_tag, ok_headers(call, self.port), answer_sdp(call))
        assert call.stage is not None
        link = call.link = Link(
            session, lambda: self.sessions.close(session), lambda: self._hang_up(call), call.stage.close
        )
        link.own(self._resend_until_ack(call), "sip-ack")
        link.own(send_rtp(call, call.stage.outbox), "sip-rtp")
        codec = "PCMU" if call.codec == PCMU else "PCMA"
        log.info("sip call %s from %s: session %s, %s", call.call_id, addr[0], session.id, codec)

    async def _open(self, call: SipCall) -> SessionPort:
        """The call's RTP socket (on the listener's address, any port) and session."""
        await open_rtp(call, self.config.host)
        call.stage = OutputStage(RtpWire(call.codec))
        call.session = await self.sessions.open(call.stage, SessionConfig(input_rate=RATE))
        self.sessions.name(call.session, call.call_id)  # for a Realtime client joining it (?call_id=)
        return call.session

    def _ack(self, request: sip.SipMessage, addr: tuple[str, int]) -> None:
        call = self._dialog(request, addr)
        if isinstance(call, SipCall):  # (an ACK is never answered, whatever it is)
            call.acked.set()
            call.media_ready.set()

    def _bye(self, request: sip.SipMessage, addr: tuple[str, int]) -> None:
        call = self._dialog(request, addr)
        if not isinstance(call, SipCall):
            self._reply(request, addr, 481)
            return
        self._reply(request, addr, 200, call.to_tag)
        self._spawn(self._end(call, bye=False), f"sip-bye-{call.call_id[:16]}")

    def _cancel(self, request: sip.SipMessage, addr: tuple[str, int]) -> None:
        known = self._dialog(request, addr)
        if known is None:
            self._reply(request, addr, 481)
            return
        self._reply(request, addr, 200)  # the CANCEL; the INVITE gets 487 (if not ACKed yet)
        if isinstance(known, Answering):
            known.task.cancel()
            invite = request  # same Call-ID, CSeq number and Via branch as the INVITE
            self._reply(sip.SipMessage(method="INVITE", uri=invite.uri, headers=[
                (n, v.replace("CANCEL", "INVITE") if n == "cseq" else v) for n, v in invite.headers]),
                addr, 487, sip.new_tag())  # fmt: skip
        elif not known.acked.is_set():  # it crossed our 200: the call ends all the same
            self._send(sip.response(known.invite, 487, known.to_tag, source=addr), addr)
            self._spawn(self._end(known, bye=False), f"sip-cancel-{known.call_id[:16]}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    async def _resend_until_ack(self, call: SipCall) -> None:
        """The 200 again after T1, 2*T1, 4*T1, ... (at most T2 apart) until the ACK; none
        within ``ack_timeout_s`` (64*T1): the call ends with our BYE (RFC 3261 13.3.1.4)."""
        interval, waited = T1, 0.0
        while waited < self.ack_timeout_s:
            step = min(interval, self.ack_timeout_s - waited)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(call.acked.wait(), step)
                return
            waited += step
            if waited < self.ack_timeout_s:
                self._endpoint.transport.sendto(call.final, call.signaling)  # type: ignore[union-attr]
            interval = min(interval * 2, T2)
        log.info("sip call %s: no ACK in %g s, hanging up", call.call_id, self.ack_timeout_s)
        self._spawn(self._end(call, bye=True), f"sip-noack-{call.call_id[:16]}")

    async def _end(self, call: SipCall, bye: bool) -> None:
        """End the call: with our BYE (``bye``), or because the caller ended it."""
        if not call.ended:
            call.hang_up = bye
        call.ended = True
        self.calls.pop(call.call_id, None)
        if call.link is not None:
            await call.link.close()

    async def _hang_up(self, call: SipCall) -> None:
        """The connection's side of the call's end (`Link`): BYE if it is ours, and the
        RTP socket closed. The session ended first (idle timeout, shutdown) counts as ours."""
        call.ended = True
        self.calls.pop(call.call_id, None)
        if call.hang_up:
            self._send(bye_request(call, self.port), call.signaling)
        close_rtp(call)
        who = "we hung up" if call.hang_up else "the caller hung up"
        log.info("sip call %s: ended (%s)", call.call_id, who)
