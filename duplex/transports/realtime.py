"""``WS /v1/realtime`` without ``call_id``: a Realtime client with a session of its own.

    socket ─► `serve`: the session opened (or refused: ``error``, close 1013)
           ─► ``session.created`` ─► `read` the client's events until either side ends
    session's output ─► OutputStage ─► `RealtimeWire` ─► the connection's outbox ─► socket

The socket and the session are tied by a `Link` (duplex/transports/link.py): the
socket's end closes the session, the session's end (idle timeout, shutdown) closes the
socket with 1001. A client that reads nothing for ``slow_reader_timeout_s`` (its
socket's buffers full) is closed, its socket aborted: a close frame would wait behind
all it did not read. The client's events are `RealtimeConnection`'s
(realtime_client.py); a client joining a session it did not open is realtime_join.py's.
"""

from __future__ import annotations

import json

from aiohttp import WSCloseCode, web

from duplex.config import Config
from duplex.events import SessionError
from duplex.session_config import MAX_SYSTEM_PROMPT, SessionConfig
from duplex.sessions import Sessions
from duplex.transports.link import send_all, websocket_link
from duplex.transports.output import OutputStage
from duplex.transports.realtime_audio import RUNTIME_INPUT_RATE
from duplex.transports.realtime_client import RealtimeConnection, read
from duplex.transports.realtime_config import RealtimeError, RealtimeSessionConfig
from duplex.transports.realtime_events import RealtimeWire


async def serve(
    request: web.Request, ws: web.WebSocketResponse, config: Config, sessions: Sessions
) -> web.WebSocketResponse:
    """Serve one client, on an upgraded socket, with a new session until either ends."""
    try:
        voice = sessions.check_room()
        settings = RealtimeSessionConfig("", voice.name, config.system_prompt or "", MAX_SYSTEM_PROMPT)
        connection = RealtimeConnection(ws, settings)
        stage = OutputStage(RealtimeWire(connection), connection.outbox)
        session = await sessions.open(stage, SessionConfig(input_rate=RUNTIME_INPUT_RATE))
    except SessionError as e:
        refused = RealtimeError(str(e), e.code, kind="server_error").body(None)
        await ws.send_str(json.dumps({"type": "error", "event_id": "event_0", "error": refused}))
        await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=e.code.encode())
        return ws
    settings.id = session.id
    connection.session = session
    connection.apply_turn_detection()  # the API's defaults, as session.created shows them
    connection.send("session.created", session=settings.as_dict())
    link = websocket_link(session, lambda: sessions.close(session), stage.close, ws, request.transport)
    link.own(send_all(connection.outbox, ws.send_str), "realtime-send")
    link.watch_reader(connection.outbox, config.slow_reader_timeout_s)
    try:
        await read(ws, connection, link)
    finally:
        await link.close()
    return ws
