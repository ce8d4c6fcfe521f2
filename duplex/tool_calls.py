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

from collections.abc import Callable
from typing import Any, Protocol

from duplex import events as ev
from duplex.events import SessionError
from models.conversation import Conversation
from models.tools import Tool, ToolCall, ToolChoice, ToolError, ToolLimits, parse_choice, parse_tools


class Emitter(Protocol):
    def emit(self, type_: str, **data: object) -> None: ...


def refused(error: ToolError) -> SessionError:
    return SessionError(error.code, str(error))


class ToolCalls:
    def __init__(self, conversation: Conversation, limits: ToolLimits | None = None) -> None:
        self.conversation = conversation
        self.limits = limits or ToolLimits()
        self.choice = ToolChoice()
        self._next: ToolChoice | None = None  # the next response's own choice

    @property
    def declared(self) -> tuple[Tool, ...]:
        return self.conversation.tools

    def parse(self, raw_tools: Any, raw_choice: Any = None) -> tuple[tuple[Tool, ...], ToolChoice]:
        """A client's function tools and ``tool_choice`` (None: the current one, or auto
        if it named a tool no longer declared), checked against the session's limits."""
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
            reply.emit(ev.CALL_ADDED, **common, name=call.name)
            reply.emit(ev.CALL_DELTA, **common, delta=call.arguments)
            reply.emit(ev.CALL_DONE, **common, name=call.name, arguments=call.arguments)

        return tell
