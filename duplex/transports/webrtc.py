"""``POST /webrtc/offer``: a browser's SDP offer in, the answer out, and a session that
lives as long as its peer connection.

Request: ``{"type": "offer", "sdp": "...", "config": {...}}`` (``config`` optional:
``system_prompt``, ``end_of_turn_ms``, ...). Answer: ``{"type": "answer", "sdp": "...",
"session_id": "..."}``, every ICE candidate in it (no trickle). Errors are JSON
``{"error": {"type", "code", "message"}}`` with 400 (a bad offer: ``bad_offer``,
``bad_sdp``, ``no_audio``, ``bad_config``; one over the limits that
`audio_io.webrtc.check_offer` sets before aiortc parses anything:
``too_many_candidates``, ``offer_too_large``; one without Opus: ``unsupported_codec``),
409 (an offer for a peer connection that already exists), 415 (not
``application/json``), 429 (the session limit) or 503 (models loading). A refused offer
leaves no peer connection and no session behind.

On the ``events`` data channel the server sends the session's events as the Realtime
API's server events, in the shapes ``WS /v1/realtime`` sends them (`RealtimeWire`:
items, responses, content parts, ``event_id``s; no audio deltas, the audio is on the
track), beside duplex's own, named ``duplex.*`` (``duplex.state``,
``duplex.turn.metrics``, ``duplex.response.resumed``; and for what the API's events do
not carry, ``duplex.item.heard``: the text of a reply cut by a barge-in that the
caller heard, after ``conversation.item.truncated``, and ``duplex.item.words``: a
final transcript's word times, with ``word_times`` on). It takes control messages:

- ``{"type": "input_text", "text": "..."}``: a user turn as text;
- ``{"type": "cancel"}``: stop the reply in progress (kept as far as it was heard);
- ``{"type": "config", ...}``: change turn-taking settings (`Session.configure`);
- ``{"type": "respond"}``: answer the turns held while ``answer_turns`` is false, and
  tool results (``tool_choice``, optional: this reply's own);
- ``{"type": "tools", "tools": [...], "tool_choice": ...}``: the functions the assistant
  may call, as ``session.update`` takes them on ``/v1/realtime``; its calls come as the
  Realtime API's function-call events;
- ``{"type": "tool_result", "call_id": "...", "output": "..."}``: a call's result (then
  ``respond``, once the reply that made the call is done).

The peer connection and the session close together, whichever goes first. The session
opens with the answer, so a peer that never connects holds one of ``max_sessions``
until ``webrtc_connect_timeout_s``, then both close. A browser that takes no events
(its SCTP acknowledges none) for ``slow_reader_timeout_s``, or lets
`audio_io.webrtc.MAX_BUFFERED_BYTES` of them pile up, is closed with ``slow_reader``;
audio cannot pile up (the track sends on its own clock and never waits).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from audio_io.frame import AudioFrame, Int16Array
from audio_io.webrtc import OfferError, WebRtcPeer, ice_ufrag
from audio_io.webrtc_audio import RATE
from duplex import events as ev
from duplex.config import Config
from duplex.events import Event, SessionError
from duplex.port import SessionPort
from duplex.session_config import SessionConfig
from duplex.sessions import Sessions
from duplex.transports.link import Link
from duplex.transports.output import Cursor, OutputStage
from duplex.transports.realtime_config import RealtimeSessionConfig
from duplex.transports.realtime_events import RealtimeItems, RealtimeWire

log = logging.getLogger("duplex.webrtc")

MAX_CONTROL_BYTES = 64 * 1024
OFFER_CONFIG_KEYS = ("system_prompt", *SessionConfig.RUNTIME_KEYS)
HEARD = "duplex.item.heard"  # a cut reply's text as far as the caller heard it
WORDS = "duplex.item.words"  # a final transcript's word times (``word_times``)


class PeerWire:
    """A peer connection's output: 20 ms frames at 48 kHz for its track (which sends
    them on its own clock), events as JSON on the ``events`` data channel: the Realtime
    API's server events (`RealtimeWire`) and duplex's own (``duplex.*``)."""

    transport = "webrtc"

    rate = RATE

    def __init__(self, peer: WebRtcPeer) -> None:
        self.peer = peer
        self.items = RealtimeItems(RealtimeSessionConfig("", "", "", 0))  # what the events refer to
        self.realtime = RealtimeWire(self.items)

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[Int16Array]:
        return [samples]

    def event(self, event: Event) -> list[Int16Array]:
        if event.type.startswith("duplex."):
            self.peer.send(json.dumps(event.as_dict()))
            return []
        self.realtime.event(event)
        for message in self.items.outbox.take():
            self.peer.send(message)
        d = event.data
        if event.type == ev.TRUNCATED:
            heard = {"type": HEARD, "item_id": d["item_id"], "transcript": d["transcript"]}
            self.peer.send(json.dumps(heard))
        elif event.type == ev.TRANSCRIPT_DONE and "words" in d:
            self.peer.send(json.dumps({"type": WORDS, "item_id": d["item_id"], "words": d["words"]}))
        return []

    def end_reply(self, cursor: Cursor, completed: bool) -> list[Int16Array]:
        return []

    def flushed(self) -> list[Int16Array]:
        return []


def _error(status: int, code: str, message: str) -> web.Response:
    body = {"error": {"type": "invalid_request_error", "code": code, "message": message}}
    return web.json_response(body, status=status)


def _session_config(raw: Any) -> SessionConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SessionError("bad_config", "config must be an object")
    unknown = sorted(set(raw) - set(OFFER_CONFIG_KEYS))
    if unknown:
        raise SessionError("bad_config", f"unknown config keys {unknown} (known: {list(OFFER_CONFIG_KEYS)})")
    try:
        return SessionConfig(input_rate=RATE, **raw)
    except TypeError as e:
        raise SessionError("bad_config", str(e)) from None


_STATUS = {"not_ready": 503, "too_many_sessions": 429}


class _Inbound:
    """Where a peer's audio and messages go: the session, once it is open (a frame
    that comes before is dropped)."""

    def __init__(self) -> None:
        self.session: SessionPort | None = None
        self._control: Callable[[SessionPort, str], Awaitable[None]] | None = None

    def attach(self, session: SessionPort, control: Callable[[SessionPort, str], Awaitable[None]]) -> None:
        self.session, self._control = session, control

    def push(self, frame: AudioFrame) -> None:
        if self.session is not None:
            self.session.push_audio(frame)

    async def control(self, text: str) -> None:
        if self.session is not None and self._control is not None:
            await self._control(self.session, text)


class WebRtcEndpoint:
    """Every peer connection of the process, each with its session."""

    def __init__(self, config: Config, sessions: Sessions) -> None:
        self.config = config
        self.sessions = sessions
        self.peers: dict[str, WebRtcPeer] = {}  # by session id
        self._ufrags: set[str] = set()  # ICE ufrags of offers being answered
        self._links: dict[str, Link] = {}  # by session id

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/webrtc/offer", self.offer)
        app.router.add_get("/webrtc/ice", self.ice)

    async def ice(self, request: web.Request) -> web.Response:
        """The ICE servers a browser should use (none by default: direct connections)."""
        servers: list[dict[str, Any]] = [{"urls": url} for url in self.config.webrtc_ice_urls]
        for server in servers:
            if self.config.webrtc_ice_username is not None:
                server["username"] = self.config.webrtc_ice_username
            if self.config.webrtc_ice_credential is not None:
                server["credential"] = self.config.webrtc_ice_credential
        return web.json_response({"iceServers": servers})

    async def offer(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":  # a form or text/plain: a cross-site post
            return _error(415, "bad_content_type", "the offer is application/json")
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "bad_offer", 'the body must be JSON: {"type": "offer", "sdp": ...}')
        if not isinstance(body, dict) or body.get("type") != "offer" or not isinstance(body.get("sdp"), str):
            return _error(400, "bad_offer", 'expected {"type": "offer", "sdp": "..."}')
        if body.get("session_id") is not None:
            return _error(409, "offer_in_use", "renegotiating a session's peer connection is not supported")
        sdp: str = body["sdp"]
        ufrag = ice_ufrag(sdp)
        if ufrag and (ufrag in self._ufrags or any(p.remote_ufrag == ufrag for p in self.peers.values())):
            return _error(409, "offer_in_use", "this offer's peer connection already has a session")
        try:
            config = _session_config(body.get("config"))
            self.sessions.check_room()  # before any work is spent on the offer
        except SessionError as e:
            return _error(_STATUS.get(e.code, 400), e.code, str(e))
        self._ufrags.add(ufrag)
        try:
            return await self._answer(sdp, config)
        finally:
            self._ufrags.discard(ufrag)  # an answered peer holds it in self.peers

    async def _answer(self, sdp: str, config: SessionConfig) -> web.Response:
        peer = WebRtcPeer(
            self.config.webrtc_ice_urls,
            self.config.webrtc_ice_username,
            self.config.webrtc_ice_credential,
            connect_timeout_s=self.config.webrtc_connect_timeout_s,
        )
        inbound = _Inbound()
        stage = OutputStage(PeerWire(peer), peer.track.outbox)
        session: SessionPort | None = None
        try:
            answer = await peer.answer(sdp, inbound.push, inbound.control)
            session = await self.sessions.open(stage, config)
        except (OfferError, SessionError) as e:
            await peer.close()
            return _error(_STATUS.get(e.code, 400), e.code, str(e))
        except BaseException:  # the client went away mid-offer, or a bug: nothing is left open
            if session is not None:
                await self.sessions.close(session)
            await peer.close()
            raise
        inbound.attach(session, self._control)
        self.peers[session.id] = peer
        self._link(session, peer, stage)
        log.info("webrtc session %s: answered", session.id)
        return web.json_response({"type": "answer", "sdp": answer, "session_id": session.id})

    def _link(self, session: SessionPort, peer: WebRtcPeer, stage: OutputStage[Any]) -> None:
        """The session and its peer connection close together, whichever goes first."""

        async def close_peer() -> None:
            self.peers.pop(session.id, None)
            self._links.pop(session.id, None)
            await peer.close()
            log.info("webrtc session %s: closed", session.id)

        async def when_peer_closes() -> None:
            await peer.closed.wait()
            await link.close()

        link = Link(session, lambda: self.sessions.close(session), close_peer, stage.close)
        link.own(when_peer_closes(), "webrtc-peer")
        link.watch_reader(peer, self.config.slow_reader_timeout_s)  # events the browser does not take
        self._links[session.id] = link

    async def _control(self, session: SessionPort, text: str) -> None:
        """A control message from the browser; bad ones get an ``error`` event."""
        try:
            if len(text) > MAX_CONTROL_BYTES:
                raise SessionError(
                    "message_too_large", f"control messages are at most {MAX_CONTROL_BYTES} bytes"
                )
            try:
                message = json.loads(text)
            except ValueError:
                raise SessionError("bad_message", "control messages are JSON objects") from None
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "input_text":
                if not isinstance(message.get("text"), str):
                    raise SessionError("bad_message", "input_text needs a string 'text'")
                await session.push_text(message["text"])
            elif kind == "cancel":
                await session.cancel()
            elif kind == "respond":
                if "tool_choice" in message:  # for this reply alone
                    session.tools.choose(message["tool_choice"])
                await session.respond()
            elif kind == "config":
                session.configure({k: v for k, v in message.items() if k != "type"})
            elif kind == "tools":
                session.tools.declare(
                    *await session.tools.parse(message.get("tools", []), message.get("tool_choice"))
                )
            elif kind == "tool_result":
                session.tools.result(message.get("call_id"), message.get("output"))
            else:
                raise SessionError("bad_message", f"unknown control message type {kind!r}")
        except SessionError as e:
            session.send_error(e)

    async def close_all(self) -> None:
        await asyncio.gather(*(link.close() for link in list(self._links.values())))
