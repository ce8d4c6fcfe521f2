"""``WS /telephony/twilio``: phone calls through Twilio Media Streams, one session each;
``POST /telephony/twilio/voice``: the TwiML that routes a call there.

    provider ─ connected, start ─► (token check) ─► Session(input 8 kHz μ-law)
             ─ media ───────────► decode ─► session.push_audio (gaps in timestamps: silence)
             ─ dtmf ────────────► session.dtmf
             ─ mark (echo) ─────► session.playback(position the mark stood for)
    session ─ audio ─► 8 kHz, μ-law, 20 ms ─► media ... mark every 100 ms, and at a reply's end
            ─ flush (barge-in) ─► clear, and every mark still out is forgotten

Marks go out every 100 ms of audio and after each reply's last frame, not only at
phrase ends: a barge-in then truncates the reply to within 100 ms of what was played,
where a mark per phrase would lose up to a phrase. A mark's name is
``<response id>:<ms of that reply sent before it>``. Once a ``clear`` is sent, marks
echoed for the dropped audio (Twilio echoes them all at a clear) are ignored: they say
nothing about what the caller heard. At most `MAX_MARKS_OUT` marks wait for their echo
(the oldest are forgotten beyond): a caller that never echoes holds no more than that.

A socket holds one of ``max_sessions`` from its upgrade (`Sessions.hold`), and one
that has not sent ``start`` within ``handshake_timeout_s`` is closed (1008): sockets
that never begin a call cannot pile up. A caller that stops reading is closed too: the
socket's send buffers are kept small (`SEND_BUFFER_BYTES`, a few seconds of media), so
its writer blocks soon, and once nothing has been taken for ``slow_reader_timeout_s``
the session ends and the socket closes with 1008 ``slow_reader`` (aborted if the caller
does not take even that within the same time).

Messages are handled one per turn of the event loop, so a caller's flood of them
(thousands of mark echoes, keys, bad messages) delays no other call. A malformed
message is dropped and counted; a call that sends nothing but bad messages
(``MAX_BAD_MESSAGES`` in a row), or anything before ``start`` but ``connected``, is
closed with a WebSocket close code that says why (1002, 1003 for a binary frame, 1007,
1008, 1009 for an oversized frame, 1013 when the server is full or loading).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web
from prometheus_client import Counter

from audio_io import twilio
from audio_io.frame import AudioFrame, Int16Array
from audio_io.g711 import ulaw_decode, ulaw_encode
from audio_io.outbox import Outbox
from duplex import events as ev
from duplex.config import Config
from duplex.events import Event, SessionError
from duplex.port import SessionPort
from duplex.session_config import SessionConfig
from duplex.sessions import Sessions
from duplex.transports.link import Link
from duplex.transports.output import Cursor, OutputStage

log = logging.getLogger("duplex.twilio")

PATH = "/telephony/twilio"
MARK_EVERY = 5  # frames: a mark per 100 ms of audio
MAX_MESSAGE_BYTES = 64 * 1024  # a 20 ms media message is ~300 bytes
MAX_QUEUED_MEDIA = 250  # 5 s of audio waiting for the socket: more is dropped
MAX_BAD_MESSAGES = 20  # in a row
MAX_GAP_MS = 1000  # silence filled for a gap in media timestamps, at most
MAX_MARKS_OUT = 600  # marks awaiting their echo: a minute of audio, far beyond Twilio's buffer
SEND_BUFFER_BYTES = 16 * 1024  # unsent, in the kernel (twice this) and in asyncio: ~3 s of media

BAD_MESSAGES = Counter(
    "duplex_twilio_bad_messages_total", "malformed Media Streams messages dropped", ["code"]
)
MEDIA_DROPPED = Counter("duplex_twilio_media_dropped_total", "reply audio frames dropped for a slow socket")


class TwilioWire:
    """A call's output on the wire: 20 ms μ-law media, marks, ``clear``."""

    transport = "twilio"
    rate = twilio.RATE

    def __init__(self, stream_sid: str, voice_rate: int) -> None:
        self.stream_sid = stream_sid
        self.voice_rate = voice_rate
        self._cursor = Cursor()  # the reply being sent (stream positions at the voice's rate)
        self._reply_sent = 0  # its samples sent, at 8 kHz
        self._since_mark = 0  # media messages since the last mark
        self._marks: dict[str, int] = {}  # out, not yet echoed: name -> stream position
        self.played = 0  # stream position of the last echoed mark

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[str]:
        if cursor is not self._cursor:
            self._cursor, self._reply_sent = cursor, 0
        self._reply_sent += samples.size
        self._since_mark += 1
        media = twilio.media(self.stream_sid, ulaw_encode(samples).tobytes())
        return [media, self._mark()] if self._since_mark >= MARK_EVERY else [media]

    def _mark(self) -> str:
        """A mark at the end of the audio sent so far."""
        cursor = self._cursor
        sent = self._reply_sent * self.voice_rate // twilio.RATE
        position = min(cursor.end, cursor.start + sent)  # the last frame is padded
        name = f"{cursor.response_id}:{(position - cursor.start) * 1000 // self.voice_rate}"
        self._marks[name] = position
        if len(self._marks) > MAX_MARKS_OUT:  # never echoed: the oldest says the least
            del self._marks[next(iter(self._marks))]
        self._since_mark = 0
        return twilio.mark(self.stream_sid, name)

    def end_reply(self, cursor: Cursor, completed: bool) -> list[str]:
        return [self._mark()] if completed and self._since_mark else []  # the reply's last mark

    def event(self, event: Event) -> list[str]:
        if event.type == ev.ERROR:
            log.info("twilio %s: %s", self.stream_sid, event.data["error"]["message"])
        return []

    def flushed(self) -> list[str]:
        self._marks.clear()
        self._since_mark = 0
        return [twilio.clear(self.stream_sid)]

    def echoed(self, name: str) -> int | None:
        """The stream position a mark's echo says was played (None: not one of ours,
        or dropped by a clear)."""
        position = self._marks.pop(name, None)
        if position is None:
            return None
        for older in [n for n, p in self._marks.items() if p <= position]:
            del self._marks[older]  # echoes come in order; a skipped one is moot
        self.played = max(self.played, position)
        return self.played


class _CallEnd(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class TwilioEndpoint:
    """Every Media Streams call of the process."""

    def __init__(self, config: Config, sessions: Sessions) -> None:
        self.config = config
        self.sessions = sessions
        self.calls: dict[str, SessionPort] = {}  # by stream sid

    def routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.stream)
        app.router.add_post(PATH + "/voice", self.voice)

    async def voice(self, request: web.Request) -> web.Response:
        """The TwiML for a provider's voice webhook: connect the call to our stream.
        (The webhook itself passes the HTTP listener's token check.)"""
        url = self.config.twilio_stream_url
        if not url:
            scheme = "wss" if request.secure or request.headers.get("X-Forwarded-Proto") == "https" else "ws"
            url = f"{scheme}://{request.host}{PATH}"
        # Twilio drops query strings from stream URLs: the token travels as a parameter
        params = {"token": self.config.auth_token} if self.config.auth_token else {}
        return web.Response(text=twilio.twiml(url, params), content_type="text/xml")

    async def stream(self, request: web.Request) -> web.WebSocketResponse:
        # ``timeout``: how long a close waits for the caller's own close frame
        wait_s = self.config.slow_reader_timeout_s
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=None, timeout=wait_s)
        await ws.prepare(request)
        transport = request.transport
        if transport is None:  # gone already
            return ws
        _small_send_buffer(transport)
        try:
            await self._call(ws, request.query.get("token", ""), transport)
        except _CallEnd as e:
            log.info("twilio: call refused: %s", e)
            await ws.close(code=e.code, message=str(e).encode()[:120])
        return ws

    def _authorized(self, query_token: str, start: twilio.Start) -> bool:
        token = self.config.auth_token
        if not token:
            return True
        given = query_token or start.custom_parameters.get("token", "")
        return hmac.compare_digest(given.encode(), token.encode())

    async def _start(self, ws: web.WebSocketResponse) -> twilio.Start:
        """Read up to the ``start`` message (`_CallEnd` if anything else comes, or nothing
        in time)."""
        timeout = self.config.handshake_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._read_start(ws)
        except TimeoutError:
            raise _CallEnd(WSCloseCode.POLICY_VIOLATION, f"no 'start' within {timeout:g} s") from None

    @staticmethod
    async def _read_start(ws: web.WebSocketResponse) -> twilio.Start:
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:  # (an oversized frame: aiohttp has closed with 1009)
                raise _CallEnd(WSCloseCode.UNSUPPORTED_DATA, "Media Streams messages are JSON text")
            try:
                message = twilio.parse(msg.data)
            except twilio.ProtocolError as e:
                raise _CallEnd(WSCloseCode.INVALID_TEXT, f"{e.code}: {e}") from None
            if isinstance(message, twilio.Start):
                return message
            if not isinstance(message, twilio.Connected):
                raise _CallEnd(
                    WSCloseCode.PROTOCOL_ERROR, f"expected 'start', got {type(message).__name__.lower()}"
                )
            await asyncio.sleep(0)  # (a flood of 'connected' takes turns too)
        raise _CallEnd(WSCloseCode.GOING_AWAY, "the stream ended before 'start'")

    async def _call(self, ws: web.WebSocketResponse, query_token: str, transport: asyncio.Transport) -> None:
        try:
            with self.sessions.hold():  # from the upgrade on: sockets that never start count
                start = await self._start(ws)
                if not self._authorized(query_token, start):
                    raise _CallEnd(WSCloseCode.POLICY_VIOLATION, "missing or wrong token")
                if start.stream_sid in self.calls:
                    raise _CallEnd(WSCloseCode.POLICY_VIOLATION, "this streamSid already has a call")
                voice = self.sessions.check_room(holding=True)
                wire = TwilioWire(start.stream_sid, voice.sample_rate)
                stage = OutputStage(wire, Outbox(MAX_QUEUED_MEDIA, on_drop=MEDIA_DROPPED.inc))
                session = await self.sessions.open(
                    stage, SessionConfig(input_rate=twilio.RATE, playback_acks=True), holding=True
                )
        except SessionError as e:
            raise _CallEnd(WSCloseCode.TRY_AGAIN_LATER, f"{e.code}: {e}") from None
        self.calls[start.stream_sid] = session
        self.sessions.name(session, start.call_sid)  # for a Realtime client joining it (?call_id=)
        log.info("twilio call %s (stream %s): session %s", start.call_sid, start.stream_sid, session.id)
        link = self._link(session, stage, ws, transport)
        link.own(_send(stage.outbox, ws, transport), "twilio-send")
        link.watch_reader(stage.outbox, self.config.slow_reader_timeout_s)
        # the link owns the receiver too: a close begun by the session's end or a stall
        # stops it first, so the close frame is followed by the closing handshake
        receiving = link.own(self._media(ws, session, wire), "twilio-receive")
        try:
            await asyncio.wait([receiving])
        finally:
            self.calls.pop(start.stream_sid, None)
            await link.close()
            log.info("twilio call %s: ended", start.call_sid)

    def _link(
        self,
        session: SessionPort,
        stage: OutputStage[str],
        ws: web.WebSocketResponse,
        transport: asyncio.Transport,
    ) -> Link:
        """The call's `Link`: the socket closes with 1001 if the session ended first, and
        with 1008 if the caller stopped reading; a caller that does not take even that
        close frame within ``slow_reader_timeout_s`` has its connection aborted."""
        grace = self.config.slow_reader_timeout_s

        async def close_socket() -> None:
            if link.ended_by_session:
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"session ended")
            elif not link.stalled:
                await ws.close()
            else:
                reason = f"slow_reader: nothing was read for {grace:g} s".encode()
                try:
                    async with asyncio.timeout(grace):  # the frame waits behind what it never read
                        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=reason)
                except TimeoutError:
                    transport.abort()  # else what waits for it holds the socket open for good

        link = Link(session, lambda: self.sessions.close(session), close_socket, stage.close)
        return link

    async def _media(self, ws: web.WebSocketResponse, session: SessionPort, wire: TwilioWire) -> None:
        bad = 0
        next_ms: int | None = None  # the timestamp the next media should carry
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                if msg.type == WSMsgType.ERROR:
                    break
                BAD_MESSAGES.labels("not_text").inc()
                bad += 1
            else:
                try:
                    message = twilio.parse(msg.data)
                except twilio.ProtocolError as e:
                    BAD_MESSAGES.labels(e.code).inc()
                    log.debug("twilio %s: dropped a message: %s", session.id, e)
                    bad += 1
                else:
                    bad = 0
                    if isinstance(message, twilio.Media):
                        if message.track == "inbound" and message.payload:
                            next_ms = self._push(session, message, next_ms)
                    elif isinstance(message, twilio.Mark):
                        position = wire.echoed(message.name)
                        if position is not None:
                            session.playback(position)
                    elif isinstance(message, twilio.Dtmf):
                        session.dtmf(message.digit)
                    elif isinstance(message, twilio.Stop):
                        return
            if bad >= MAX_BAD_MESSAGES:
                await ws.close(code=WSCloseCode.INVALID_TEXT, message=b"too many malformed messages")
                return
            await asyncio.sleep(0)  # messages already read come without a wait: a flood takes turns

    @staticmethod
    def _push(session: SessionPort, media: twilio.Media, next_ms: int | None) -> int | None:
        """Decode and hand over one media message; a gap in the timestamps (audio the
        provider never got) becomes silence, so the session's clock stays the call's."""
        if media.timestamp_ms is not None and next_ms is not None:
            gap = min(media.timestamp_ms - next_ms, MAX_GAP_MS)
            if gap >= 20:
                session.push_audio(AudioFrame(np.zeros(gap * twilio.RATE // 1000, np.int16), twilio.RATE))
        session.push_audio(AudioFrame(ulaw_decode(media.payload), twilio.RATE))
        if media.timestamp_ms is None:
            return None
        return media.timestamp_ms + len(media.payload) * 1000 // twilio.RATE


async def _send(outbox: Outbox[str], ws: web.WebSocketResponse, transport: asyncio.Transport) -> None:
    """The writer: the outbox's messages, in order. A socket that holds
    `SEND_BUFFER_BYTES` unsent is waited out here, a frame's time at a time (the outbox
    meanwhile counts as stalled), never inside aiohttp's drain: a writer cancelled there
    leaves the socket's shared drain future cancelled, and the close frame after it fails."""
    while True:
        message = await outbox.get()
        while transport.get_write_buffer_size() > SEND_BUFFER_BYTES:  # noqa: ASYNC110 (no event says "writable")
            await asyncio.sleep(0.02)
        await ws.send_str(message)


def _small_send_buffer(transport: asyncio.BaseTransport) -> None:
    """Keep what waits in the kernel for a slow socket small. Media is ~16 kB/s, so a
    few seconds of it is plenty on any network; with the kernel's default (it grows to
    megabytes) a caller that stops reading would take minutes to block our writer, and
    audio sitting in buffers is audio a ``clear`` cannot take back."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
