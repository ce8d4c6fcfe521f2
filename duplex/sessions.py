"""`Sessions`: every open session of the process, and the limits on them.

Transports open and close sessions only through here, so the limits hold for all of
them together: at most ``max_sessions`` at once (one more is refused with a typed
error before any work is done for it), and a session whose transport has sent nothing
for ``session_idle_timeout_s`` (no audio, not even silence: a vanished client, a call
that never sent BYE) is told why and closed. At shutdown every session is closed
before the engines stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from duplex.engines import Engines
from duplex.events import SessionError
from duplex.session import Session
from duplex.session_config import SessionConfig
from duplex.transports.port import SessionPort, Sink, Voice

log = logging.getLogger("duplex.sessions")


class Sessions:
    def __init__(self, max_sessions: int, idle_timeout_s: float) -> None:
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.engines: Engines | None = None  # set once the models are loaded
        self._open: set[Session] = set()
        self._watchdog: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def attach(self, engines: Engines) -> None:
        self.engines = engines

    def check_room(self) -> Voice:
        """Raise the `SessionError` that `open` would for lack of models or room: for a
        transport to call before it spends work on a connection. The voice sessions
        speak with, if there is room."""
        if self.engines is None:
            raise SessionError("not_ready", "the models are still loading; try again shortly")
        if len(self._open) >= self.max_sessions:
            raise SessionError(
                "too_many_sessions", f"the server is at its limit of {self.max_sessions} sessions"
            )
        return Voice(self.engines.tts.name, self.engines.tts.sample_rate)

    async def open(self, sink: Sink, config: SessionConfig | None = None) -> Session:
        """A started session for this transport connection, or a `SessionError`."""
        self.check_room()
        assert self.engines is not None
        session = Session(self.engines, sink, config)
        self._open.add(session)
        try:
            await session.start()
        except BaseException:
            await self.close(session)
            raise
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="sessions-idle-watchdog")
        return session

    async def close(self, session: SessionPort) -> None:
        """Close one of these sessions (idempotent)."""
        found = next((s for s in self._open if s.id == session.id), None)  # a transport holds a port
        if found is not None:
            self._open.discard(found)
            await found.close()

    async def close_all(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        await asyncio.gather(*(self.close(s) for s in list(self._open)))

    async def _watch(self) -> None:
        period = min(1.0, self.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session in [s for s in self._open if now - s.last_input > self.idle_timeout_s]:
                log.info("session %s: idle for %.0f s, closed", session.id, now - session.last_input)
                session.send_error(SessionError("session_timeout", f"no input for {self.idle_timeout_s:g} s"))
                await self.close(session)
