"""One turn of a conversation as plain data: what opened it (tool results, the user's
words), the reply, and the calls the reply made (`models.conversation` keeps them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.tools import ToolCall


@dataclass
class ToolResult:
    call_id: str
    text: str
    tokens: list[int]  # the whole tool turn: its framing and the text as data


@dataclass
class Turn:
    user_text: str
    user_tokens: list[int]
    id: str = ""  # the caller's name for the reply that began this turn (a response id)
    reply_text: str = ""  # what is spoken: never a character of a call's markup
    reply_tokens: list[int] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)  # before the user's words
    calls: list[ToolCall] = field(default_factory=list)  # at the end of the reply
    call_tokens: list[int] = field(default_factory=list)  # the calls' markup, as generated
