"""``WS /v1/realtime``: the OpenAI Realtime API (GA event protocol), so a client written
for it can talk to this server (base URL on our host, any key unless ``auth_token`` is
set). `RealtimeEndpoint` upgrades the request and hands the socket to one of two
handlers, by whether it names a call:

    /v1/realtime                  ─► realtime.serve: a session of the client's own
    /v1/realtime?call_id=<a call> ─► realtime_join.join: the client joins a call's session

Both serve the client with the same parts below them (`RealtimeConnection`,
`RealtimeWire`, `read`); the choice is made here, above both, so neither imports the
other.

A frame over ``max_message_bytes`` (1 MiB by default: 16 s of 24 kHz PCM in one append)
is refused by the WebSocket itself from its header, before any of it is buffered:
close 1009. Longer recordings go in several appends, or the operator raises
``max_message_bytes``; aiohttp unmasks and decodes a frame in one go on the event loop,
and the limit bounds that too (figures: docs/performance.md, "Realtime transport").
Text that is not UTF-8: close 1007.
"""

from __future__ import annotations

from aiohttp import web

from duplex.config import Config
from duplex.sessions import Sessions
from duplex.transports.link import CLOSE_TIMEOUT_S
from duplex.transports.realtime import serve
from duplex.transports.realtime_join import join

PATH = "/v1/realtime"


class RealtimeEndpoint:
    def __init__(self, config: Config, sessions: Sessions) -> None:
        self.config = config
        self.sessions = sessions

    def routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.connect)

    async def connect(self, request: web.Request) -> web.WebSocketResponse:
        # the frame limit is checked from each frame's header, before its payload is read
        ws = web.WebSocketResponse(
            max_msg_size=self.config.max_message_bytes, heartbeat=None, timeout=CLOSE_TIMEOUT_S
        )
        await ws.prepare(request)
        call_id = request.query.get("call_id")
        if call_id is not None:  # a client joining a call
            return await join(request, ws, self.config, self.sessions, call_id)
        return await serve(request, ws, self.config, self.sessions)
