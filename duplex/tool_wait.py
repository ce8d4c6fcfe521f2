"""`ToolWait`: what the caller hears while the client's functions run.

Once a reply that made calls has ended, the wait for their results begins. If no result has come within
``tool_filler_ms`` and nobody is speaking (the reply's own words before the call have
played out, the caller is quiet), the session says ``tool_filler_text`` once ("One
moment."). A result that comes while the filler plays is answered right after it (the
session's `respond` lets a reply play out when only results wait). A call with no result
after ``tool_timeout_s`` is closed with an error result in the history (a late result is
then refused: its call was answered), a ``duplex.tool.timeout`` event names it, and,
if nobody is speaking, the session says ``tool_timeout_text``; the conversation goes on.

The filler and the apology are the service's words, not the model's: they are spoken
but not put in the conversation, so the model's answer to the result follows on from
its own words before the call. One task per session, while calls wait; it ends when
every call told has a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Protocol

from duplex import events as ev
from duplex.session_config import SessionConfig
from duplex.state import State
from duplex.turn_ports import ReplyView
from models.conversation import Conversation
from models.tools import ToolCall

TIMED_OUT = json.dumps({"error": "the function gave no result in time"})


async def saying(text: str) -> AsyncIterator[str]:
    """The words of a reply of the service's own (`Session.say`): ``text``, at once."""
    yield text


class WaitHost(Protocol):
    """What the wait needs of its session."""

    config: SessionConfig  # tool_filler_ms, tool_filler_text, tool_timeout_s, tool_timeout_text

    @property
    def reply(self) -> ReplyView | None: ...

    @property
    def state(self) -> State: ...

    def say(self, text: str) -> None:
        """Speak the service's own words (not the model's, not in the conversation)."""
        ...

    def emit(self, type_: str, **data: object) -> None: ...


class ToolWait:
    def __init__(self, conversation: Conversation, host: WaitHost) -> None:
        self.conversation = conversation
        self.host = host
        self._calls: dict[str, tuple[ToolCall, float]] = {}  # waiting for a result: call, when told
        self._filler_due: float | None = None  # when the filler is said, if still waiting
        self._poked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.fillers = 0
        self.timeouts = 0

    @property
    def _quiet(self) -> bool:
        """Nobody speaks: no reply in progress, the caller silent."""
        return self.host.reply is None and self.host.state is State.LISTENING

    def watch(self, calls: list[ToolCall]) -> None:
        """These calls wait for their results (a reply that made them has ended): those
        not watched yet are awaited from now."""
        now = time.monotonic()
        new = [c for c in calls if c.call_id not in self._calls and not self.conversation.answered(c.call_id)]
        for call in new:
            self._calls[call.call_id] = (call, now)
        config = self.host.config
        if new and self._filler_due is None and config.tool_filler_ms > 0 and config.tool_filler_text:
            self._filler_due = now + config.tool_filler_ms / 1000
        if new and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="tool-wait")
        self.poke()

    def poke(self) -> None:
        """Something changed (a result came, a reply ended): look again now."""
        self._poked.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while self._calls:
            self._poked.clear()
            now = time.monotonic()
            for call_id in [i for i in self._calls if not self._waiting(i)]:
                del self._calls[call_id]
            if not self._calls:
                break
            timeout_s = self.host.config.tool_timeout_s
            late = [c for c, told in self._calls.values() if now >= told + timeout_s]
            if late:
                self._time_out(late)
                continue
            if self._filler_due is not None and now >= self._filler_due and self._quiet:
                self._filler_due = None
                self.fillers += 1
                self.host.say(self.host.config.tool_filler_text)
            deadlines = [told + timeout_s for _, told in self._calls.values()]
            if self._filler_due is not None and self._filler_due > now:
                deadlines.append(self._filler_due)  # (a filler due but not quiet: waits for a poke)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), max(0.0, min(deadlines) - now))
        self._filler_due = None

    def _waiting(self, call_id: str) -> bool:
        """Still without a result, and still in the conversation (a deleted turn, or one
        an overlong conversation dropped, takes its calls with it)."""
        return self.conversation.call(call_id) is not None and not self.conversation.answered(call_id)

    def _time_out(self, calls: list[ToolCall]) -> None:
        for call in calls:
            del self._calls[call.call_id]
            self.conversation.add_result(call.call_id, TIMED_OUT)
            self.timeouts += 1
            timeout_s = self.host.config.tool_timeout_s
            self.host.emit(ev.TOOL_TIMEOUT, call_id=call.call_id, name=call.name, timeout_s=timeout_s)
        if self._quiet and self.host.config.tool_timeout_text:
            self.host.say(self.host.config.tool_timeout_text)
        self._filler_due = None  # the apology, not a filler, if nothing else waits
