"""Tools a client declares: checked, shown to the model, and held to by the decoder.

A tool is a function the client runs (`Tool`: a name, a description, a JSON Schema for
its arguments). The model sees the tools in its system block, in the Hermes form that
Qwen2.5-style templates use (`tools_text`; a chat template with its own tools branch
renders them instead: `models.chat_format`), and calls one by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

at the end of its reply. Every call is well-formed by construction, not by parsing and
retrying: `structural_tag` gives vLLM's structured outputs (xgrammar) a grammar for the
reply that the chosen `ToolChoice` allows:

    auto       any text; once the model writes ``<tool_call>`` the rest of that call is
               one of the tools, its arguments valid against the schema; then the reply
               ends (one call per response)
    required   one or more calls, one per line, and nothing else
    named      exactly one call of that tool
    none       any text that never contains ``<tool_call>``

`CallReader` splits the reply's text as it streams into what is spoken (never a
character of the markup) and the calls, with their arguments as they are written.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
# whitespace in a row inside a call's arguments: enough for pretty-printed JSON three
# objects deep; held to its schema alone, the bundled model wrote newlines and spaces
# inside `{` until its tokens ran out (the call never closed)
MAX_WHITESPACE = 16
CALL_CLOSE = "}\n</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A declaration, choice or result the service refuses; ``code`` is the error's type."""

    def __init__(self, message: str, code: str = "invalid_tool") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ToolLimits:
    max_tools: int = 64
    max_description_chars: int = 1024
    max_schema_bytes: int = 16_384
    max_schema_depth: int = 16  # objects and arrays nested in one schema
    # all the tools together, as JSON: what the model reads before every turn (and what
    # checking them costs: 64 tools of the sizes above took 1.5 s of jsonschema's checks
    # and were 310,376 tokens, far over any context we serve)
    max_declaration_bytes: int = 32_768
    max_output_chars: int = 16_384  # one result: what a spoken answer can use, with room


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object

    def declaration(self) -> dict[str, Any]:
        """The tool as OpenAI's function-tool shape (what the model is shown)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def call_begin(self) -> str:
        """What a call of this tool starts with, up to its arguments."""
        return call_begin(self.name)


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto | none | required | named
    name: str | None = None  # for `named`

    def wire(self) -> str | dict[str, str]:
        """As the Realtime API writes it."""
        return {"type": "function", "name": self.name or ""} if self.mode == "named" else self.mode


@dataclass
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments object, as the model wrote it
    call_id: str = field(default_factory=lambda: f"call_{secrets.token_urlsafe(12)}")

    def key(self) -> tuple[str, str]:
        """What makes two calls the same call: the name and the arguments' value."""
        try:
            return self.name, json.dumps(json.loads(self.arguments), sort_keys=True)
        except ValueError:
            return self.name, self.arguments

    def function(self) -> dict[str, str]:
        return {"name": self.name, "arguments": self.arguments}

    def parsed(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError("arguments are not a JSON object")
        return value


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def parse_tool(raw: Any, limits: ToolLimits) -> Tool:
    """One function tool in the Realtime shape (``{"type": "function", "name", "description",
    "parameters"}``; the Chat Completions nesting under ``"function"`` is taken too)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(raw, dict):
        raise ToolError("a tool must be an object")
    if raw.get("type", "function") != "function":
        raise ToolError(f"tool type {raw.get('type')!r} is not supported: only function tools")
    body = raw.get("function", raw) if isinstance(raw.get("function"), dict) else raw
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError("a tool name must be 1-64 letters, digits, '_' or '-'")
    description = body.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"tool {name}: description must be a string")
    if len(description) > limits.max_description_chars:
        raise ToolError(f"tool {name}: description over {limits.max_description_chars} characters")
    parameters = body.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(f"tool {name}: parameters must be a JSON Schema object")
    if len(json.dumps(parameters)) > limits.max_schema_bytes:
        raise ToolError(f"tool {name}: parameters schema over {limits.max_schema_bytes} bytes")
    if _depth(parameters) > limits.max_schema_depth:
        raise ToolError(f"tool {name}: parameters schema nested deeper than {limits.max_schema_depth}")
    if parameters.get("type", "object") != "object":
        raise ToolError(f"tool {name}: parameters must describe an object")
    parameters = {"type": "object", **parameters}  # arguments are an object, said or not
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        raise ToolError(f"tool {name}: parameters are not a valid JSON Schema: {e.message}") from None
    return Tool(name, description, parameters)


def parse_tools(raw: Any, limits: ToolLimits) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise ToolError("tools must be a list")
    if len(raw) > limits.max_tools:
        raise ToolError(f"{len(raw)} tools, more than the {limits.max_tools} allowed")
    try:
        size = len(json.dumps(raw))
    except (TypeError, ValueError, RecursionError):
        raise ToolError("tools must be JSON") from None
    if size > limits.max_declaration_bytes:
        most = limits.max_declaration_bytes
        raise ToolError(f"the tools are {size} bytes as JSON, more than the {most} allowed")
    tools = tuple(parse_tool(item, limits) for item in raw)
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ToolError("two tools have the same name")
    return tools


def parse_choice(raw: Any, tools: Iterable[Tool]) -> ToolChoice:
    """``"auto" | "none" | "required" | {"type": "function", "name": ...}``."""
    if raw in ("auto", "none", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name", (raw.get("function") or {}).get("name"))
        if name not in {tool.name for tool in tools}:
            raise ToolError(f"tool_choice names {name!r}, not a declared tool", "invalid_tool_choice")
        return ToolChoice("named", name)
    raise ToolError("tool_choice must be auto, none, required or a function", "invalid_tool_choice")


TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_OUTRO = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_text(tools: Iterable[Tool]) -> str:
    """The Hermes tools block that follows the instructions in the system turn."""
    lines = "".join(json.dumps(tool.declaration(), ensure_ascii=False) + "\n" for tool in tools)
    return TOOLS_INTRO + lines + TOOLS_OUTRO


def _tag(tool: Tool) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": tool.call_begin(),
        "content": {
            "type": "json_schema",
            "json_schema": closed(tool.parameters),
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": CALL_CLOSE,
    }


def closed(schema: Any) -> Any:
    """The schema with every object that does not say otherwise closed to the properties
    it names (``additionalProperties: false``), for the grammar only: JSON Schema lets an
    object have any other keys, and the bundled model, held to the page's
    ``{"type": "object", "properties": {}}``, wrote keys until the reply's tokens ran out,
    so the call never closed. What the grammar allows still validates against the
    client's schema (a part of what it allows)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def structural_tag(tools: tuple[Tool, ...], choice: ToolChoice) -> str | None:
    """vLLM's ``structured_outputs.structural_tag`` for a reply under ``choice``; None
    when no tool is declared (the reply is not constrained at all)."""
    if not tools:
        return None
    tags = [_tag(tool) for tool in tools]
    fmt: dict[str, Any]
    if choice.mode == "none":
        # not even the start of a call's markup: the bundled model, held from calling
        # only at ``<tool_call>``'s end, wrote ``<tool_call`` and ended there (nothing said)
        fmt = {"type": "regex", "pattern": "[^<]*"}
    elif choice.mode == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    elif choice.mode == "named":
        fmt = next(tag for tool, tag in zip(tools, tags, strict=True) if tool.name == choice.name)
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "stop_after_first": True}
    return json.dumps({"type": "structural_tag", "format": fmt})


def call_begin(name: str) -> str:
    """What a call of ``name`` starts with, up to its arguments (the grammar's tag opens
    with it; `CallReader` reads it back)."""
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": '


def call_text(call: ToolCall) -> str:
    """A call as the model writes it."""
    return call_begin(call.name) + call.arguments + CALL_CLOSE


@dataclass
class CallEvent:
    """What `CallReader` saw: a call begun (``arguments`` empty), part of its arguments,
    or its end (``done``: ``call.arguments`` complete)."""

    call: ToolCall
    delta: str = ""
    done: bool = False


class CallReader:
    """The reply's text as it streams: `feed` returns the text that may be spoken and
    what happened to calls. Text that could be the start of ``<tool_call>`` is held
    until it is known not to be. Everything from ``<tool_call>`` on is markup."""

    _HEAD = re.compile(
        r'<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)'
    )

    def __init__(self) -> None:
        self._pending = ""  # spoken text held back, or the markup not yet read
        self._call: ToolCall | None = None
        self.calls: list[ToolCall] = []
        self.in_markup = False

    def feed(self, text: str) -> tuple[str, list[CallEvent]]:
        self._pending += text
        events: list[CallEvent] = []
        spoken = ""
        if not self.in_markup:
            at = self._pending.find(CALL_OPEN)
            if at < 0:
                spoken, self._pending = _hold(self._pending, CALL_OPEN)
                return spoken, events
            spoken, self._pending = self._pending[:at], self._pending[at:]
            self.in_markup = True
        while True:
            if self._call is None:
                self._pending = self._pending.lstrip()  # between calls: their separator
                head = self._HEAD.match(self._pending)
                if head is None:
                    break
                self._call = ToolCall(head.group(1), "")
                self.calls.append(self._call)
                events.append(CallEvent(self._call))
                self._pending = self._pending[head.end() :]
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                delta, self._pending = _hold(self._pending, CALL_CLOSE)
                if delta:
                    self._call.arguments += delta
                    events.append(CallEvent(self._call, delta))
                break
            delta = self._pending[:end]
            self._call.arguments += delta
            if delta:
                events.append(CallEvent(self._call, delta))
            events.append(CallEvent(self._call, done=True))
            self._call = None
            self._pending = self._pending[end + len(CALL_CLOSE) :]
        return spoken, events

    def finish(self) -> None:
        """The reply ended. Text still held back is dropped: it is a beginning of
        ``<tool_call>`` (a reply cut off as it began a call), never words."""
        self._pending = ""

    @property
    def unfinished(self) -> bool:
        """Markup was begun but no call completed in it (a reply cut off mid-call)."""
        return self.in_markup and (self._call is not None or not self.calls)


def _hold(text: str, marker: str) -> tuple[str, str]:
    """``text`` split before its longest end that could begin ``marker``: (what is
    known not to be the marker, what must wait for the next text)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, ""
