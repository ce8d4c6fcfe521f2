"""The session object of the OpenAI Realtime API (GA) for ``WS /v1/realtime``: what a
client may set with ``session.update``, checked field by field, and the full object the
server reports in ``session.created`` / ``session.updated``.

Supported: ``instructions``; ``audio.input.format`` and ``audio.output.format``
(``audio/pcm`` at 24 kHz, ``audio/pcmu``, ``audio/pcma``); ``audio.input.turn_detection``
(``server_vad``, or null for manual turns; ``silence_duration_ms`` ends a turn;
``threshold`` is the VAD's speech probability, applied within 0.2-0.95;
``prefix_padding_ms`` is the audio kept before the detected start; ``create_response``
false holds each turn for ``response.create``; ``interrupt_response`` false lets the
reply play on while the caller speaks, and answers them after it);
``audio.output.voice`` (any name: the server has one voice); ``output_modalities``
``["audio"]``; ``tools`` (function tools) and ``tool_choice``, checked by the session
(`duplex.tool_calls`) before anything is applied. Accepted and ignored (reported back
as set): ``audio.input.transcription`` (transcription always runs, with the server's
model), ``noise_reduction``, ``speed``, ``tracing``, ``truncation``, ``include``,
``prompt``, ``model``, ``max_output_tokens`` (each at most `MAX_ECHO_DEPTH` deep and
`MAX_ECHO_CHARS` long as JSON: they are kept and sent back with every update). Refused
with an ``invalid_request_error``: anything else, and values out of range. A client's
value is quoted in an error only when it is a string, cut short.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from models.tools import Tool, ToolChoice

FORMATS = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}
LAWS = {"audio/pcmu": "ulaw", "audio/pcma": "alaw", "audio/pcm": None}  # for encode_wire / decode_wire
IGNORED_KEYS = ("tracing", "truncation", "include", "prompt", "model", "max_output_tokens")
MAX_ECHO_DEPTH = 8  # nesting of an accepted-and-ignored value (the API's own go 4 deep)
MAX_ECHO_CHARS = 16384  # ... and its length as JSON
MAX_VOICE_NAME = 64


class RealtimeError(Exception):
    """A client event the server refuses: becomes an ``error`` event."""

    def __init__(
        self,
        message: str,
        code: str = "invalid_value",
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.code, self.param, self.kind = code, param, kind

    def body(self, event_id: str | None) -> dict[str, Any]:
        return {
            "type": self.kind,
            "code": self.code,
            "message": str(self),
            "param": self.param,
            "event_id": event_id,
        }


@dataclass(frozen=True)
class TurnDetection:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "idle_timeout_ms": None,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RealtimeError(f"Invalid type for '{param}': expected an object.", "invalid_type", param)
    return value


def shown(value: Any) -> str:
    """A client's value in an error message: a string, cut short; anything else by its
    type (the repr of a huge or deeply nested list is slow, or raises RecursionError)."""
    return repr(value[:40]) if isinstance(value, str) else f"a JSON {type(value).__name__}"


def _echo(value: Any, param: str) -> Any:
    """An accepted-and-ignored value, kept to be sent back: small and shallow."""
    level, depth = [value], 0
    while level:  # breadth first, without recursion: a client may nest 1000 deep
        depth += 1
        if depth > MAX_ECHO_DEPTH:
            raise RealtimeError(f"'{param}' is nested more than {MAX_ECHO_DEPTH} deep.", param=param)
        level = [
            child
            for v in level
            if isinstance(v, (dict, list))
            for child in (v.values() if isinstance(v, dict) else v)
            if isinstance(child, (dict, list))
        ]
    if len(json.dumps(value)) > MAX_ECHO_CHARS:
        raise RealtimeError(f"'{param}' is over {MAX_ECHO_CHARS} characters as JSON.", param=param)
    return value


def _format(value: Any, param: str) -> dict[str, Any]:
    fmt = _object(value, param)
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in FORMATS:  # a list or an object is unhashable
        raise RealtimeError(
            f"Invalid value for '{param}.type': {shown(kind)}; supported: {', '.join(FORMATS)}.",
            param=f"{param}.type",
        )
    rate = fmt.get("rate", FORMATS[kind])
    if rate != FORMATS[kind]:
        raise RealtimeError(f"Invalid '{param}.rate': {kind} is {FORMATS[kind]} Hz.", param=f"{param}.rate")
    return {"type": kind, "rate": 24000} if kind == "audio/pcm" else {"type": kind}


def _number(obj: dict[str, Any], key: str, param: str, low: float, high: float, integer: bool) -> Any:
    value = obj[key]
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise RealtimeError(
            f"Invalid '{param}.{key}': expected {what} from {low:g} to {high:g}.", param=f"{param}.{key}"
        )
    return value


def _turn_detection(value: Any, current: TurnDetection | None) -> TurnDetection | None:
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    td = _object(value, param)
    if td.get("type") != "server_vad":
        raise RealtimeError(
            f"Invalid '{param}.type': only 'server_vad' (or null) is supported.", param=f"{param}.type"
        )
    base = current or TurnDetection()
    fields: dict[str, Any] = {}
    for key, low, high, integer in (
        ("threshold", 0.0, 1.0, False),
        ("prefix_padding_ms", 0, 2000, True),
        ("silence_duration_ms", 200, 5000, True),
    ):
        if key in td:
            fields[key] = _number(td, key, param, low, high, integer)
    for key in ("create_response", "interrupt_response"):
        if key in td:
            if not isinstance(td[key], bool):
                raise RealtimeError(f"Invalid '{param}.{key}': expected a boolean.", param=f"{param}.{key}")
            fields[key] = td[key]
    unknown = set(td) - {"type", "idle_timeout_ms", *fields}
    if unknown:
        raise RealtimeError(f"Unknown parameter '{param}.{sorted(unknown)[0]}'.", "unknown_parameter")
    return TurnDetection(**{**base.__dict__, **fields})


class RealtimeSessionConfig:
    """One connection's session settings, as the API shows them."""

    def __init__(self, session_id: str, voice: str, instructions: str, max_instructions: int) -> None:
        self.id = session_id
        self.voice = voice
        self.instructions = instructions
        self.max_instructions = max_instructions
        self.input_format: dict[str, Any] = {"type": "audio/pcm", "rate": 24000}
        self.output_format: dict[str, Any] = {"type": "audio/pcm", "rate": 24000}
        self.turn_detection: TurnDetection | None = TurnDetection()
        self.echoed: dict[str, Any] = {}  # accepted-and-ignored settings, reported back as set
        self.audio_started = False  # the voice may not change once audio went out
        self.tools: tuple[Tool, ...] = ()  # as the session took them (`RealtimeConnection`)
        self.tool_choice = ToolChoice()

    def update(self, raw: Any) -> None:
        """Apply a ``session.update``'s ``session``, all or nothing."""
        session = _object(raw, "session")
        staged = copy.copy(self)
        staged.echoed = dict(self.echoed)
        if session.get("type", "realtime") != "realtime":
            raise RealtimeError("Only 'realtime' sessions are supported.", param="session.type")
        for key, value in session.items():
            if key in ("type", "tools", "tool_choice"):  # tools: checked and applied by the session
                continue
            if key == "instructions":
                if not isinstance(value, str) or len(value) > self.max_instructions:
                    raise RealtimeError(
                        f"'session.instructions' must be a string of at most "
                        f"{self.max_instructions} characters.",
                        param="session.instructions",
                    )
                staged.instructions = value
            elif key == "output_modalities":
                if value != ["audio"]:
                    raise RealtimeError(
                        "Only output_modalities ['audio'] is supported.", param="session.output_modalities"
                    )
            elif key == "audio":
                staged._audio(_object(value, "session.audio"))
            elif key in IGNORED_KEYS:
                staged.echoed[key] = _echo(value, f"session.{key}")
            else:
                raise RealtimeError(
                    f"Unknown parameter 'session.{key}'.", "unknown_parameter", f"session.{key}"
                )
        self.__dict__.update(staged.__dict__)

    def _audio(self, audio: dict[str, Any]) -> None:
        for side in audio:
            if side not in ("input", "output"):
                raise RealtimeError(f"Unknown parameter 'session.audio.{side}'.", "unknown_parameter")
        inp = _object(audio.get("input", {}), "session.audio.input")
        for key, value in inp.items():
            if key == "format":
                self.input_format = _format(value, "session.audio.input.format")
            elif key == "turn_detection":
                self.turn_detection = _turn_detection(value, self.turn_detection)
            elif key in ("transcription", "noise_reduction"):
                self.echoed[f"input.{key}"] = _echo(value, f"session.audio.input.{key}")
            else:
                raise RealtimeError(f"Unknown parameter 'session.audio.input.{key}'.", "unknown_parameter")
        out = _object(audio.get("output", {}), "session.audio.output")
        for key, value in out.items():
            if key == "format":
                self.output_format = _format(value, "session.audio.output.format")
            elif key == "voice":
                name = value.get("id") if isinstance(value, dict) else value
                if not isinstance(name, str) or not 0 < len(name) <= MAX_VOICE_NAME:
                    raise RealtimeError(
                        f"'session.audio.output.voice' must be a voice name of at most "
                        f"{MAX_VOICE_NAME} characters.",
                        param="session.audio.output.voice",
                    )
                if self.audio_started and name != self.voice:
                    raise RealtimeError(
                        "Cannot update a session's voice after audio has been output.",
                        param="session.audio.output.voice",
                    )
                self.voice = name
            elif key == "speed":
                self.echoed["output.speed"] = _echo(value, "session.audio.output.speed")
            else:
                raise RealtimeError(f"Unknown parameter 'session.audio.output.{key}'.", "unknown_parameter")

    def as_dict(self) -> dict[str, Any]:
        """The full session object of ``session.created`` / ``session.updated``, as the
        openai SDK types it (its session-create shape: no ``id``, ``object`` or
        ``expires_at``)."""
        return {
            "type": "realtime",
            "model": self.echoed.get("model", "duplex"),
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "tools": [{"type": "function", **tool.declaration()["function"]} for tool in self.tools],
            "tool_choice": self.tool_choice.wire(),
            "max_output_tokens": self.echoed.get("max_output_tokens", "inf"),
            "tracing": self.echoed.get("tracing"),
            "truncation": self.echoed.get("truncation", "auto"),
            "prompt": self.echoed.get("prompt"),
            "include": self.echoed.get("include"),
            "audio": {
                "input": {
                    "format": self.input_format,
                    "transcription": self.echoed.get("input.transcription"),
                    "noise_reduction": self.echoed.get("input.noise_reduction"),
                    "turn_detection": self.turn_detection.as_dict() if self.turn_detection else None,
                },
                "output": {
                    "format": self.output_format,
                    "voice": self.voice,
                    "speed": self.echoed.get("output.speed", 1.0),
                },
            },
        }
