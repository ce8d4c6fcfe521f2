"""`Link`: one session tied to one connection, whichever ends first ends the other, once.

    connection ends (socket closed, BYE, ICE failed) ─► link.close()
    session ends (idle timeout, shutdown) ─► watcher ──► link.close()
        link.close(): the connection's tasks cancelled and awaited, the output stage
        closed (nothing more queued), the session closed, the connection closed.

`close` is idempotent and shielded: aiohttp cancels a handler when its client drops
the connection, and the session must close all the same. Every task of the
connection is handed to the link (`own`), so none outlives it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from aiohttp import WSCloseCode, web

from audio_io.outbox import Outbox
from duplex.transports.output import OutputStage
from duplex.transports.port import SessionPort

log = logging.getLogger("duplex.transports")


class Link:
    def __init__(
        self,
        session: SessionPort,
        close_session: Callable[[], Awaitable[None]],
        close_connection: Callable[[], Awaitable[None]],
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.session = session
        self._close_session = close_session
        self._close_connection = close_connection
        self._on_close = on_close  # e.g. the output stage stops queueing
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: asyncio.Future[None] | None = None
        self.ended_by_session = False  # the session ended first (idle timeout, shutdown)
        self.closed = asyncio.Event()
        self.own(self._watch(), "link")

    def own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a task of the connection (a writer, a reader, a clock) until the link closes."""
        task = asyncio.create_task(coro, name=f"{self.session.id}-{name}")
        task.add_done_callback(self._failed)
        self._tasks.append(task)
        return task

    async def close(self) -> None:
        """End both sides (idempotent; every caller waits for the one close to finish)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _watch(self) -> None:
        await self.session.closed.wait()
        self.ended_by_session = self._closing is None
        await self.close()

    async def _close(self) -> None:
        self._on_close()
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._close_session()
        finally:
            await self._close_connection()
            self.closed.set()

    def _failed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())


class _Sessions(Protocol):
    async def close(self, session: SessionPort) -> None: ...


def websocket_link(
    sessions: _Sessions, session: SessionPort, stage: OutputStage[Any], ws: web.WebSocketResponse
) -> Link:
    """The link of a session on a WebSocket (Twilio Media Streams, the Realtime API):
    a session that ends first closes the socket with 1001."""

    async def close_socket() -> None:
        if link.ended_by_session:
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"session ended")
        else:
            await ws.close()

    link = Link(session, lambda: sessions.close(session), close_socket, stage.close)
    return link


T = TypeVar("T")


async def send_all(outbox: Outbox[T], send: Callable[[T], Awaitable[None]]) -> None:
    """A writer task: the outbox's messages to the connection, in order, as they come."""
    while True:
        await send(await outbox.get())
