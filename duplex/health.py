"""Readiness of the service's components, for ``/healthz`` and gRPC health."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class ComponentState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # it stopped while serving; the service is bringing it back
    FAILED = "failed"


@dataclass
class Component:
    state: ComponentState = ComponentState.STARTING
    detail: str = ""


class Readiness:
    """Named components, each starting, ready or failed; listeners are told of changes."""

    def __init__(self, names: list[str]) -> None:
        self._components = {name: Component() for name in names}
        self._listeners: list[Callable[[bool], None]] = []

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
        return all(c.state is ComponentState.READY for c in self._components.values())

    def snapshot(self) -> dict[str, object]:
        states = {c.state for c in self._components.values()}
        status = next(
            (s.value for s in (ComponentState.FAILED, ComponentState.RESTARTING) if s in states),
            "ready" if self.ready else "starting",
        )
        return {
            "status": status,
            "components": {
                name: {"state": c.state.value, "detail": c.detail} for name, c in self._components.items()
            },
        }
