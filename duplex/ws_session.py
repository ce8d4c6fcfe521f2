"""A session tied to one WebSocket (Twilio Media Streams, the Realtime API): whichever
ends first ends the other."""

from __future__ import annotations

import asyncio

from aiohttp import WSCloseCode, web

from duplex.session import Session
from duplex.sessions import Sessions


def hang_up_when_closed(session: Session, ws: web.WebSocketResponse, name: str) -> asyncio.Task[None]:
    """A task that closes the socket (1001) if the session ends first: idle timeout,
    shutdown."""

    async def hang_up() -> None:
        await session.closed.wait()
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"session ended")

    return asyncio.create_task(hang_up(), name=name)


async def end(
    sessions: Sessions, session: Session, ws: web.WebSocketResponse, *tasks: asyncio.Task[None]
) -> None:
    """The socket's handler is done: stop its tasks, close the session, then the socket.
    Shielded: aiohttp cancels the handler when the client drops the connection, and the
    session must close all the same."""
    await asyncio.shield(_end(sessions, session, ws, tasks))


async def _end(
    sessions: Sessions, session: Session, ws: web.WebSocketResponse, tasks: tuple[asyncio.Task[None], ...]
) -> None:
    await sessions.close_with(session, *tasks)
    await ws.close()
