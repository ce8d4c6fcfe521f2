"""`ToolCalls`: one session's tools: what the model is shown and held to, the calls its
replies make (told to the client as events of the reply that made them), and the
results the client gives back.

    transport ── declare / choose / result ──► ToolCalls ──► Conversation (tools, results)
    Reply (LLM words) ── each call, whole ──► `teller` ──► the reply's events:
        response.output_item.added (function_call) ─► response.function_call_arguments.delta
        ─► response.function_call_arguments.done

The events are the reply's (`Reply.emit`): a reply held back at a pause keeps them back
with its words, so a call decided while the caller pauses reaches the client only if
the turn was over; a held reply dropped takes its calls with it. The declarations and
results are checked here (`models.tools` holds the rules): a bad one is a typed
`SessionError`, and nothing changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from duplex import events as ev
from duplex.events import SessionError
from duplex.turn import TurnTimes
from models.conversation import Conversation
from models.llm_types import Constraint, LlmError
from models.tools import Tool, ToolCall, ToolChoice, ToolError, ToolLimits, parse_choice, parse_tools

log = logging.getLogger("duplex.tools")


class Emitter(Protocol):
    """A reply, as far as its calls go: its events and its times."""

    times: TurnTimes

    def emit(self, type_: str, **data: object) -> None: ...


def compact(call: ToolCall) -> str:
    """A call's arguments as the client is told them: compact JSON (the model's spacing,
    such as ``{\n    \n  }`` for ``{}``, stays in the history, where its KV is)."""
    try:
        return json.dumps(call.parsed(), ensure_ascii=False)
    except ValueError:
        return call.arguments


def refused(error: ToolError) -> SessionError:
    return SessionError(error.code, str(error))


class ToolCalls:
    def __init__(self, conversation: Conversation, limits: ToolLimits | None = None) -> None:
        self.conversation = conversation
        self.limits = limits or ToolLimits()
        self.choice = ToolChoice()
        self._next: ToolChoice | None = None  # the next response's own choice
        self._last_result: float | None = None  # when the newest result came
        self._compiling: asyncio.Task[None] | None = None  # the declared tools' grammars, ahead
        self._compiled = itertools.count()

    @property
    def declared(self) -> tuple[Tool, ...]:
        return self.conversation.tools

    async def parse(self, raw_tools: Any, raw_choice: Any = None) -> tuple[tuple[Tool, ...], ToolChoice]:
        """A client's function tools and ``tool_choice`` (None: the current one, or auto
        if it named a tool no longer declared), checked against the session's limits, on
        a thread: a declaration at the limits takes jsonschema some 40 ms to check, and
        every session's audio waits while the event loop does not turn."""
        return await asyncio.to_thread(self._parse, raw_tools, raw_choice)

    def _parse(self, raw_tools: Any, raw_choice: Any) -> tuple[tuple[Tool, ...], ToolChoice]:
        try:
            tools = parse_tools(raw_tools, self.limits)
            if raw_choice is not None:
                return tools, parse_choice(raw_choice, tools)
        except ToolError as e:
            raise refused(e) from None
        named = self.choice.mode == "named" and self.choice.name not in {t.name for t in tools}
        return tools, ToolChoice() if named else self.choice

    def declare(self, tools: tuple[Tool, ...], choice: ToolChoice) -> None:
        """The tools and choice from the next turn on (in the system block: a change
        re-prefills the KV once, like new instructions)."""
        if tools != self.declared:
            try:
                self.conversation.set_tools(tools)
            except ToolError as e:
                raise refused(e) from None
        self.choice = choice
        if self._compiling is not None:
            self._compiling.cancel()
        self._compiling = asyncio.create_task(self._compile(choice), name="tool-grammar")

    async def _compile(self, choice: ToolChoice) -> None:
        """Have the LLM compile the grammars of replies under ``choice`` (and of replies to
        results, held to `auto`) now, not at the first reply: a one-token request each on
        the system block, which the LLM's prefix cache then holds for the first turn too.
        Best effort: a failure is the first reply's to meet."""
        chat = self.conversation
        for tag in dict.fromkeys([chat.constraint_for(choice), chat.constraint_for(ToolChoice())]):
            if tag is None:
                continue
            request = f"{chat.session}-grammar{next(self._compiled)}"
            started = time.perf_counter()
            try:
                async for _ in chat.engine.generate(request, chat.system, 1, constraint=Constraint(tag)):
                    pass
            except LlmError as e:
                log.info("%s: the tools' grammar was not compiled ahead: %s", chat.session, e)
                return
            spent_ms = (time.perf_counter() - started) * 1000
            log.debug("%s: a grammar compiled, the system block prefilled: %.0f ms", chat.session, spent_ms)

    async def close(self) -> None:
        if self._compiling is not None:
            self._compiling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._compiling

    def choose(self, raw_choice: Any) -> None:
        """The next response's own ``tool_choice`` (``response.create``'s override)."""
        try:
            self._next = parse_choice(raw_choice, self.declared)
        except ToolError as e:
            raise refused(e) from None

    def bind(self, reply: Emitter) -> tuple[ToolChoice, Callable[[ToolCall], None]]:
        """For a reply begun now: the choice it is held to, and what tells the client of
        the calls it writes (`teller`)."""
        choice, self._next = self._next or self.choice, None
        if self.waiting:  # it answers results: the time from the client's last to its audio
            reply.times.result, self._last_result = self._last_result, None
        return choice, self.teller(reply)

    def result(self, call_id: Any, output: Any) -> None:
        """The client's result for a call: it opens the next turn."""
        if not isinstance(call_id, str) or not call_id:
            raise SessionError("invalid_call_id", "a result needs the call_id of the call it answers")
        if not isinstance(output, str):
            raise SessionError("invalid_tool_output", "a tool's output is a string")
        if len(output) > self.limits.max_output_chars:
            limit = self.limits.max_output_chars
            raise SessionError("tool_output_too_large", f"a tool's output is at most {limit} characters")
        try:
            self.conversation.add_result(call_id, output)
        except ToolError as e:
            raise refused(e) from None
        self._last_result = time.monotonic()

    @property
    def waiting(self) -> bool:
        """Results are waiting to be answered (a response may be created for them)."""
        return bool(self.conversation.pending)

    @property
    def complete(self) -> bool:
        """Results wait, and every call of the last reply has its result."""
        return self.waiting and not self.conversation.unanswered()

    def teller(self, reply: Emitter) -> Callable[[ToolCall], None]:
        """What tells the client of each call a reply makes, once its arguments are
        whole (so that a call the reply repeats is never told: `Conversation.reply`):
        the item, its arguments as one delta, and their end."""
        told = 0

        def tell(call: ToolCall) -> None:
            nonlocal told
            common: dict[str, object] = {"call_id": call.call_id, "call_index": told}
            told += 1
            if reply.times.call is None:
                reply.times.call = time.monotonic()
            arguments = compact(call)
            reply.emit(ev.CALL_ADDED, **common, name=call.name)
            reply.emit(ev.CALL_DELTA, **common, delta=arguments)
            reply.emit(ev.CALL_DONE, **common, name=call.name, arguments=arguments)

        return tell
