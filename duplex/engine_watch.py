"""`EngineWatch`: keeps the engines running, and health and admission honest about them.

    every 0.2 s:  llm.errored?  ─► /healthz 503, gRPC NOT_SERVING, new sessions refused
                  asr/tts worker   (`llm_unavailable`, ...), restart with backoff
                  thread dead?  ─► ready again, sessions admitted again

A remote LLM (``llm_url``, `models.remote_llm`) is not restarted from here: it is
probed every second (every round while it does not answer), health says
``unreachable`` while it does not, and sessions are admitted again when it does.

vLLM watches its engine-core process itself and marks the engine dead the moment the
process ends (its ``MPClientEngineMonitor``); every request in flight then fails, which
each live session reports as a typed ``llm_unavailable`` error on a reply whose status
is ``failed`` (`duplex.reply`). The engine is restarted in place (`LlmEngine.restart`),
so sessions keep their conversations; each one's next turn prefills its whole prompt
again. Restarts back off (1, 2, 4, 8, 16 s between failed attempts); an engine that
cannot be restarted, or that died more than `MAX_DEATHS` times in `DEATH_WINDOW_S`,
ends the service with a non-zero exit status, for its supervisor (systemd, Kubernetes)
to act on. An ASR or TTS worker thread that ended is replaced at once; the work queued
for it waits and then runs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from duplex.engines import Engines
from duplex.events import SessionError
from duplex.health import ComponentState, Readiness
from duplex.sessions import Sessions
from duplex.supervise import every

log = logging.getLogger("duplex.engines")

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)  # waits after each failed attempt
MAX_DEATHS = 5  # in DEATH_WINDOW_S: a crash loop, which restarting will not cure
DEATH_WINDOW_S = 600.0
PERIOD_S = 0.2
PROBE_PERIOD_S = 1.0  # a remote LLM's health check, while it answers (every round while it does not)

RESTARTS = Counter("duplex_engine_restarts_total", "engines restarted after they stopped", ["component"])


class EngineWatch:
    def __init__(
        self,
        engines: Engines,
        readiness: Readiness,
        sessions: Sessions,
        give_up: Callable[[str], None],
        backoff_s: tuple[float, ...] = RESTART_BACKOFF_S,
    ) -> None:
        self.engines = engines
        self.readiness = readiness
        self.sessions = sessions
        self._give_up = give_up  # the service ends, non-zero
        self._backoff_s = backoff_s
        self._down: dict[str, SessionError] = {}  # component -> why sessions are refused
        self._details: dict[str, str] = {}  # component -> its detail while it was up (the model)
        self._deaths: collections.deque[float] = collections.deque()
        self._probed = 0.0  # when a remote LLM was last asked

    async def run(self) -> None:
        await every(PERIOD_S, self.check, "engine watch")

    async def check(self) -> None:
        """One round: any engine that stopped is marked down and restarted."""
        llm = self.engines.llm
        if not llm.restartable:
            await self._watch_service()
        elif llm.errored or not llm.started:
            await self._restart_llm()
        for component, engine in (("asr", self.engines.asr), ("tts", self.engines.tts)):
            if not engine.alive:
                self._mark_down(component, "its worker stopped; restarting")
                restarted = engine.restart()
                log.error("the %s worker stopped; %d restarted", component, restarted)
                RESTARTS.labels(component).inc(restarted)
                self._mark_up(component)

    async def _watch_service(self) -> None:
        """A remote LLM: health follows whether it answers (`PROBE_PERIOD_S`, and at once
        when a request found nobody listening); nothing here can restart it."""
        now = time.monotonic()
        if now - self._probed < PROBE_PERIOD_S and not self.engines.llm.errored:
            return
        self._probed = now
        if await self.engines.llm.probe():
            if "llm" in self._down:
                self._mark_up("llm")
        elif "llm" not in self._down:
            self._mark_down(
                "llm",
                "the LLM service does not answer",
                "the LLM service is unreachable; calls are taken again when it answers",
                ComponentState.UNREACHABLE,
            )

    async def _restart_llm(self) -> None:
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths[0] < now - DEATH_WINDOW_S:
            self._deaths.popleft()
        self._mark_down("llm", "the engine stopped; restarting")
        if len(self._deaths) > MAX_DEATHS:
            return self._give_up(f"the LLM engine stopped {len(self._deaths)} times in {DEATH_WINDOW_S:g} s")
        log.error("the LLM engine stopped; restarting it")
        for attempt, wait_s in enumerate(self._backoff_s, 1):
            try:
                await self.engines.llm.restart()
            except Exception:
                log.exception("restarting the LLM engine failed (attempt %d); next in %g s", attempt, wait_s)
                await asyncio.sleep(wait_s)
                continue
            RESTARTS.labels("llm").inc()
            log.info("the LLM engine is back (attempt %d)", attempt)
            return self._mark_up("llm")
        self._give_up(f"the LLM engine could not be restarted in {len(self._backoff_s)} attempts")

    def _mark_down(
        self,
        component: str,
        detail: str,
        message: str = "",
        state: ComponentState = ComponentState.RESTARTING,
    ) -> None:
        """Refuse sessions (``message``: what they are told) until `_mark_up`."""
        if component not in self._down:
            self._details[component] = self.readiness.detail(component)
        self.readiness.set(component, state, detail)
        message = message or f"the {component.upper()} engine stopped; it is being restarted"
        self._down[component] = SessionError(f"{component}_unavailable", message)
        self.sessions.set_unavailable(next(iter(self._down.values())))

    def _mark_up(self, component: str) -> None:
        self.readiness.set(component, ComponentState.READY, self._details.pop(component, ""))
        self._down.pop(component, None)
        self.sessions.set_unavailable(next(iter(self._down.values()), None))
