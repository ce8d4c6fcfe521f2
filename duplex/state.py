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
from collections.abc import Callable


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


class StateMachine:
    def __init__(self, on_change: Callable[[State, State], None]) -> None:
        self.state = State.IDLE
        self._on_change = on_change

    def to(self, new: State) -> bool:
        """Move to `new`; True if the state changed. A move the table forbids is a bug."""
        old = self.state
        if new is old:
            return False
        assert new is State.CLOSED or new in _ALLOWED[old], f"session state {old.value} -> {new.value}"
        self.state = new
        self._on_change(old, new)
        return True
