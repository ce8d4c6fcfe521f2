"""The session's lifecycle: one Enum, every allowed transition in one table.

    idle ─► listening ◄──────────────┐
               │  ▲                  │
               ▼  │                  │ reply done
          user_speaking ─► responding ─┘
               ▲               │  ▲
    barge-in   │               ▼  │ false interruption: resume
               └──────── interrupted

Also allowed (`_ALLOWED` is the whole truth): listening -> responding (a text turn, or
`respond`), responding -> user_speaking (the caller speaks over a reply they may not
cut), interrupted -> listening (the reply ended or was cancelled meanwhile). `closed` is
reachable from every state and final.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)


class State(enum.Enum):
    IDLE = "idle"
    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    RESPONDING = "responding"
    INTERRUPTED = "interrupted"
    CLOSED = "closed"


_ALLOWED: dict[State, frozenset[State]] = {
    State.IDLE: frozenset({State.LISTENING}),
    State.LISTENING: frozenset({State.USER_SPEAKING, State.RESPONDING}),
    State.USER_SPEAKING: frozenset({State.LISTENING, State.RESPONDING}),
    State.RESPONDING: frozenset({State.LISTENING, State.INTERRUPTED, State.USER_SPEAKING}),
    State.INTERRUPTED: frozenset({State.RESPONDING, State.USER_SPEAKING, State.LISTENING}),
    State.CLOSED: frozenset(),
}


class Lifecycle(Generic[S]):
    """A state and its allowed moves (one table), for the session and its replies alike.
    A move the table forbids is a bug; ``final`` (if any) is reachable from every state."""

    def __init__(
        self,
        name: str,
        initial: S,
        allowed: Mapping[S, frozenset[S]],
        on_change: Callable[[S, S], None] = lambda old, new: None,
        final: S | None = None,
    ) -> None:
        self.name = name
        self.state = initial
        self._allowed = allowed
        self._on_change = on_change
        self._final = final

    def to(self, new: S) -> bool:
        """Move to `new`; True if the state changed."""
        old = self.state
        if new is old:
            return False
        assert new is self._final or new in self._allowed[old], f"{self.name} {old.value} -> {new.value}"
        self.state = new
        self._on_change(old, new)
        return True


class StateMachine(Lifecycle[State]):
    """The session's lifecycle."""

    def __init__(self, on_change: Callable[[State, State], None]) -> None:
        super().__init__("session state", State.IDLE, _ALLOWED, on_change, final=State.CLOSED)
