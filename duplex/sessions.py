"""`Sessions`: every open session of the process, and the limits on them.

Transports open and close sessions only through here, so the limits hold for all of
them together: at most ``max_sessions`` at once (one more is refused with a typed
error before any work is done for it), and a session whose transport has sent nothing
for ``session_idle_timeout_s`` (no audio, not even silence: a vanished client, a call
that never sent BYE) is told why and closed, as is one older than ``max_session_s``.
A connection that will become a session (a Twilio socket before ``start``, a gRPC
stream before its ``SessionConfig``) holds a place meanwhile (`hold`), so sockets that
never begin a session cannot pile up beyond the limit either. While the LLM is out
(`set_unavailable`), new sessions are refused with a typed error. At shutdown every
session is closed before the engines stop.

``/metrics`` counts the sessions open by transport (`transport_of`: the name of the
wire its sink writes) and the refusals by error code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from duplex import metrics
from duplex.engines import Engines
from duplex.events import SessionError
from duplex.port import SessionPort, Sink, Voice
from duplex.session import Session
from duplex.session_config import SessionConfig
from duplex.supervise import every

log = logging.getLogger("duplex.sessions")


def transport_of(sink: Sink) -> str:
    """The transport a session's sink belongs to: the name its wire gives (an
    `OutputStage` around a transport's `Wire`); anything else (a benchmark's or a test's
    own sink) is in-process."""
    name = getattr(getattr(sink, "wire", None), "transport", None)
    return name if name in metrics.TRANSPORTS else "in-process"


class Sessions:
    def __init__(self, max_sessions: int, idle_timeout_s: float, max_session_s: float = 14_400.0) -> None:
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_session_s = max_session_s
        self.engines: Engines | None = None  # set once the models are loaded
        self.unavailable: SessionError | None = None  # why new sessions are refused (an engine is out)
        self._open: set[Session] = set()
        self._opened_at: dict[Session, float] = {}
        self._transport: dict[Session, str] = {}
        self._held = 0  # connections holding a place before their session (`hold`)
        self._names: dict[str, Session] = {}  # a call's own id (Twilio CallSid, SIP Call-ID) -> its session
        self._watchdog: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def attach(self, engines: Engines) -> None:
        self.engines = engines

    def set_unavailable(self, error: SessionError | None) -> None:
        """New sessions are refused with ``error`` until this is called with None."""
        self.unavailable = error

    def check_room(self, holding: bool = False) -> Voice:
        """Raise the `SessionError` that `open` would for lack of models or room: for a
        transport to call before it spends work on a connection (``holding``: the
        caller holds a place already, `hold`). The voice sessions speak with, if there
        is room."""
        if self.engines is None:
            raise _refused(SessionError("not_ready", "the models are still loading; try again shortly"))
        if self.unavailable is not None:
            raise _refused(self.unavailable)
        self._check_places(taken=len(self._open) + self._held - holding)
        return Voice(self.engines.tts.name, self.engines.tts.sample_rate)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold a place among ``max_sessions`` for a connection that has not begun its
        session yet (`SessionError` if there is none): `open` it with ``holding=True``
        inside this block. Bounds the sockets waiting for a first message; it is the
        transport's job to time them out (``handshake_timeout_s``)."""
        self._check_places(taken=len(self._open) + self._held)
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def _check_places(self, taken: int) -> None:
        if taken >= self.max_sessions:
            raise _refused(
                SessionError(
                    "too_many_sessions", f"the server is at its limit of {self.max_sessions} sessions"
                )
            )

    async def open(self, sink: Sink, config: SessionConfig | None = None, holding: bool = False) -> Session:
        """A started session for this transport connection, or a `SessionError`."""
        self.check_room(holding)
        assert self.engines is not None
        session = Session(self.engines, sink, config)
        self._open.add(session)
        self._opened_at[session] = time.monotonic()
        self._transport[session] = transport = transport_of(sink)
        metrics.SESSIONS_OPEN.labels(transport).inc()
        try:
            await session.start()
        except BaseException:
            await self.close(session)
            raise
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="sessions-watchdog")
        return session

    def name(self, session: SessionPort, call_id: str) -> None:
        """The call's own id names the session too (`find`), while it is open."""
        found = next((s for s in self._open if s.id == session.id), None)
        if found is not None and call_id and call_id not in self._names:
            self._names[call_id] = found

    def find(self, name: str) -> Session | None:
        """An open session by its id, or by its call's own id (`name`)."""
        found = self._names.get(name) or next((s for s in self._open if s.id == name), None)
        return found if found is not None and found in self._open else None

    async def close(self, session: SessionPort) -> None:
        """Close one of these sessions (idempotent)."""
        found = next((s for s in self._open if s.id == session.id), None)  # a transport holds a port
        if found is not None:
            self._open.discard(found)
            self._opened_at.pop(found, None)
            metrics.SESSIONS_OPEN.labels(self._transport.pop(found, "in-process")).dec()
            for name in [n for n, s in self._names.items() if s is found]:
                del self._names[name]
            await found.close()

    async def close_all(self, reason: SessionError | None = None) -> None:
        """Close every session (at shutdown), each told ``reason`` first if given."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        if reason is not None:
            for session in self._open:
                session.send_error(reason)
        await asyncio.gather(*(self.close(s) for s in list(self._open)))

    async def _watch(self) -> None:
        period = min(1.0, self.idle_timeout_s / 4, self.max_session_s / 4)
        await every(period, self._expire, "sessions watchdog")

    async def _expire(self) -> None:
        now = time.monotonic()
        for session in list(self._open):
            if now - session.last_input > self.idle_timeout_s:
                log.info("session %s: idle for %.0f s, closed", session.id, now - session.last_input)
                error = SessionError("session_timeout", f"no input for {self.idle_timeout_s:g} s")
            elif now - self._opened_at.get(session, now) > self.max_session_s:
                log.info("session %s: at its longest, %g s; closed", session.id, self.max_session_s)
                error = SessionError("session_expired", f"sessions last at most {self.max_session_s:g} s")
            else:
                continue
            session.send_error(error)
            await self.close(session)


def _refused(error: SessionError) -> SessionError:
    """Count a refusal (``duplex_sessions_refused_total``) of a session not begun."""
    metrics.SESSIONS_REFUSED.labels(error.code).inc()
    return error
