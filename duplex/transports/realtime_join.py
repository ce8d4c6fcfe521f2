"""``WS /v1/realtime?call_id=...``: a Realtime client joins a session it did not open (a
phone call), as the GA API's sideband connection to a SIP call does
(``client.realtime.connect(call_id=...)`` in the openai SDK).

    phone ─► Twilio / SIP transport ─► Session ─► the call's own wire
                                          └─ watch ─► RealtimeWire ─► this socket
    this socket ─► client events ─► the same Session

``call_id`` is the call's own id (Twilio ``CallSid``, SIP ``Call-ID``) or the session's
(``sess_N``, in the transport's log line). The client is told what happens from when
it joins: ``session.created``, then the call's events in the API's shapes, among them
``input_audio_buffer.dtmf_event_received`` for each key the caller presses. It may
steer the call as its own client would (``session.update`` for instructions and turn
detection, text items, ``response.create``/``cancel``, ``conversation.item.*`` for the
items it has seen); the call's audio stays on its line: no ``response.output_audio``
deltas come here, and ``input_audio_buffer.*`` events are refused (``not_supported``).

The call goes on when the socket closes; the socket closes (1001) when the call ends.
At most `MAX_JOINED` clients per call. A call that is not open: an ``error``
(``call_not_found``), then close 1008. A joined client that stops reading is closed,
its socket aborted, after ``slow_reader_timeout_s``; the call does not hear of it.
"""

from __future__ import annotations

import json
import logging

from aiohttp import WSCloseCode, web

from duplex.config import Config
from duplex.events import Event
from duplex.session_config import MAX_SYSTEM_PROMPT
from duplex.sessions import Sessions
from duplex.transports.link import send_all, websocket_link
from duplex.transports.realtime_client import RealtimeConnection, read
from duplex.transports.realtime_config import RealtimeError, RealtimeSessionConfig
from duplex.transports.realtime_events import RealtimeWire

log = logging.getLogger("duplex.realtime")

MAX_JOINED = 4  # Realtime clients joined to one call at once
MAX_CALL_ID = 256


async def _refuse(ws: web.WebSocketResponse, error: RealtimeError) -> web.WebSocketResponse:
    await ws.send_str(json.dumps({"type": "error", "event_id": "event_0", "error": error.body(None)}))
    await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=error.code.encode())
    return ws


async def _goes_on() -> None:
    """The call is not this client's to close."""


async def join(
    request: web.Request, ws: web.WebSocketResponse, config: Config, sessions: Sessions, call_id: str
) -> web.WebSocketResponse:
    """Serve one joined client on an upgraded socket until it or the call ends."""
    session = sessions.find(call_id) if len(call_id) <= MAX_CALL_ID else None
    if session is None or session.closed.is_set():
        return await _refuse(
            ws, RealtimeError(f"No open call {call_id[:64]!r}.", "call_not_found", "call_id")
        )
    settings = RealtimeSessionConfig(
        session.id, session.voice.name, config.system_prompt or "", MAX_SYSTEM_PROMPT
    )
    connection = RealtimeConnection(ws, settings)
    connection.session, connection.joined = session, True
    wire = RealtimeWire(connection)

    def watch(event: Event) -> None:
        try:
            wire.event(event)
        except (KeyError, TypeError, ValueError):  # a bug here must not break the call's tasks
            log.exception("realtime %s: no event for %s", session.id, event.type)

    unwatch = session.watch(watch, MAX_JOINED)
    if unwatch is None:
        return await _refuse(
            ws,
            RealtimeError(f"At most {MAX_JOINED} clients may join one call.", "too_many_joined", "call_id"),
        )
    log.info("realtime: a client joined call %s (session %s)", call_id, session.id)
    connection.send("session.created", session=settings.as_dict())
    link = websocket_link(session, _goes_on, unwatch, ws, request.transport, ended=b"call ended")
    link.own(send_all(connection.outbox, ws.send_str), "realtime-joined-send")
    link.watch_reader(connection.outbox, config.slow_reader_timeout_s, tell_session=False)
    try:
        await read(ws, connection, link)
    finally:
        await link.close()
    return ws
