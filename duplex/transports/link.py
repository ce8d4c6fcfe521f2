"""`Link`: one session tied to one connection, whichever ends first ends the other, once.

    connection ends (socket closed, BYE, ICE failed) ─► link.close()
    session ends (idle timeout, shutdown) ─► watcher ──► link.close()
        link.close(): the connection's tasks cancelled and awaited, the output stage
        closed (nothing more queued), the session closed, the connection closed.

`close` is idempotent and shielded: aiohttp cancels a handler when its client drops
the connection, and the session must close all the same. Every task of the
connection is handed to the link (`own`), so none outlives it. `watch_reader` ends a
link whose client stops reading (its outbox stalls), so that it holds neither a
session nor memory for long. A connection may also follow a session it did not open (a
Realtime client joined to a call): its link leaves the session open when it closes, and
its reader watch does not tell the session (`watch_reader`'s ``tell_session``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from aiohttp import WSCloseCode, WSMsgType, web

from audio_io.outbox import Outbox
from duplex.events import SessionError
from duplex.port import SessionPort

log = logging.getLogger("duplex.transports")

SLICE_S = 0.005  # a writer yields to the event loop at least this often
CLOSE_TIMEOUT_S = 2.0  # for a WebSocket client to take our close frame, then the socket is aborted


class Backlog(Protocol):
    """What waits to go out to a client (an `Outbox`, a WebRTC data channel's buffer)."""

    overflowed: bool  # something was dropped for lack of room

    def stalled_s(self) -> float:
        """Seconds things have waited with none taken (0 when nothing waits)."""
        ...


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
        self.stalled = False  # ended by `watch_reader`: the client stopped reading
        self.close_with: tuple[int, bytes] | None = None  # the close code and reason, if not 1000
        self.closed = asyncio.Event()
        self.own(self._watch(), "link")

    def own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a task of the connection (a writer, a reader, a clock) until the link closes."""
        task = asyncio.create_task(coro, name=f"{self.session.id}-{name}")
        task.add_done_callback(self._failed)
        self._tasks.append(task)
        return task

    def watch_reader(self, backlog: Backlog, timeout_s: float, tell_session: bool = True) -> None:
        """Close the link once ``backlog`` has waited ``timeout_s`` with nothing taken,
        or dropped what it could not hold: a client that stopped reading. The session
        gets a ``slow_reader`` error for its client, unless ``tell_session`` is False:
        the session is not this client's (a Realtime client joined to a call), and its
        own transport has nothing to hear of it. Checked about 4 times per ``timeout_s``."""
        self.own(self._watch_reader(backlog, timeout_s, tell_session), "reader-watch")

    async def _watch_reader(self, backlog: Backlog, timeout_s: float, tell_session: bool) -> None:
        while backlog.stalled_s() <= timeout_s and not backlog.overflowed:  # noqa: ASYNC110 (polled: time passing is the event)
            await asyncio.sleep(min(1.0, timeout_s / 4))
        why = "its backlog overflowed" if backlog.overflowed else f"it read nothing for {timeout_s:g} s"
        log.info("%s: the client is not reading (%s); closed", self.session.id, why)
        self.stalled = True
        if tell_session:
            self.session.send_error(SessionError("slow_reader", f"the client is not reading: {why}"))
        await self.close()

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


def websocket_link(
    session: SessionPort,
    close_session: Callable[[], Awaitable[None]],
    on_close: Callable[[], None],
    ws: web.WebSocketResponse,
    transport: asyncio.Transport | None,
    ended: bytes = b"session ended",
) -> Link:
    """The link of a session on a WebSocket (the Realtime API); `Link` says what
    ``close_session`` and ``on_close`` are for.

    Its close always ends soon and never reads: the close frame goes out (1001 with the
    reason ``ended`` when the session ended first, else `Link.close_with` or 1000),
    waiting at most `CLOSE_TIMEOUT_S` for the client to take it (not at all for a
    client found not reading), then the socket is aborted. aiohttp's own close would
    read on until the client's close frame: a client that reads nothing would hold it,
    and the socket, forever, and a fast client's backlog would be drained without
    yielding to the loop (figures: docs/performance.md, "Realtime transport")."""

    async def close_socket() -> None:
        if not link.stalled and not ws.closed:
            code, reason = link.close_with or (WSCloseCode.OK, b"")
            if link.ended_by_session:
                code, reason = WSCloseCode.GOING_AWAY, ended
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await ws.send_frame(int(code).to_bytes(2, "big") + reason, WSMsgType.CLOSE)
                    while transport is not None and transport.get_write_buffer_size():  # noqa: ASYNC110 (no event for it)
                        await asyncio.sleep(0.01)
            except (TimeoutError, ConnectionError):
                pass
        if transport is not None:
            transport.abort()

    link = Link(session, close_session, close_socket, on_close)
    return link


T = TypeVar("T")


async def send_all(outbox: Outbox[T], send: Callable[[T], Awaitable[None]]) -> None:
    """A writer task: the outbox's messages to the connection, in order, as they come.

    It yields to the loop every `SLICE_S`: a backlog of reply audio, each message
    compressed as it goes, would otherwise go out in one step (figures:
    docs/performance.md, "Realtime transport"). A client that vanishes while it is sent
    to is a normal end: its reader sees the connection end too, and the link closes."""
    slice_end = time.monotonic() + SLICE_S
    with contextlib.suppress(ConnectionError):
        while True:
            await send(await outbox.get())
            if time.monotonic() > slice_end:
                await asyncio.sleep(0)
                slice_end = time.monotonic() + SLICE_S
