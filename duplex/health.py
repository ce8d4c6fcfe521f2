"""Readiness of the service's components, for ``/healthz``, ``/readyz`` and gRPC health.

``/healthz`` is the detail (each component, and the start-up's phases while it lasts);
``/readyz`` only says whether a call may begin now, and if not, why in one line
(`Readiness.reason`): starting (and in which phase), an engine restarting, shutting
down. A service that is shutting down is not ready, whatever its components say.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from duplex.startup import PHASES, Startup


class ComponentState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # it stopped while serving; the service is bringing it back
    UNREACHABLE = "unreachable"  # a service it needs (the LLM at llm_url) does not answer
    FAILED = "failed"


@dataclass
class Component:
    state: ComponentState = ComponentState.STARTING
    detail: str = ""


class Readiness:
    """Named components, each starting, ready or failed; listeners are told of changes."""

    def __init__(self, names: list[str], startup: Startup | None = None) -> None:
        self._components = {name: Component() for name in names}
        self._listeners: list[Callable[[bool], None]] = []
        self.startup = startup
        self.shutting_down = False

    def shut_down(self) -> None:
        """The service is stopping: not ready from now on (listeners are not told; the
        gRPC listener is about to stop)."""
        self.shutting_down = True

    def set(self, name: str, state: ComponentState, detail: str = "") -> None:
        component = self._components[name]
        if (component.state, component.detail) == (state, detail):
            return
        was_ready = self.ready
        component.state, component.detail = state, detail
        if self.ready != was_ready:
            for listener in self._listeners:
                listener(self.ready)

    def detail(self, name: str) -> str:
        return self._components[name].detail

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    @property
    def ready(self) -> bool:
        return not self.shutting_down and all(
            c.state is ComponentState.READY for c in self._components.values()
        )

    @property
    def status(self) -> str:
        """ready, starting, restarting, unreachable, failed or shutting_down."""
        if self.shutting_down:
            return "shutting_down"
        states = {c.state for c in self._components.values()}
        return next(
            (
                s.value
                for s in (ComponentState.FAILED, ComponentState.RESTARTING, ComponentState.UNREACHABLE)
                if s in states
            ),
            "ready" if self.ready else "starting",
        )

    def reason(self) -> str:
        """Why calls cannot begin now, in one line ("" when they can)."""
        status = self.status
        if status == "ready":
            return ""
        if status == "shutting_down":
            return "the server is shutting down"
        if status == "starting":
            current = self.startup.current if self.startup is not None else None
            if current is None:
                return "starting"
            name, seconds = current
            return f"starting: {PHASES[name]} ({seconds:.0f} s so far)"
        name, component = next(
            (n, c) for n, c in self._components.items() if c.state is ComponentState(status)
        )
        return f"{name}: {component.detail or status}"

    def snapshot(self) -> dict[str, object]:
        snapshot: dict[str, object] = {
            "status": self.status,
            "components": {
                name: {"state": c.state.value, "detail": c.detail} for name, c in self._components.items()
            },
        }
        if self.startup is not None:
            snapshot["startup"] = self.startup.snapshot()
        return snapshot
