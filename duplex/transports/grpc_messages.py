"""The messages of `Duplex.Converse` (proto/duplex.proto) that stand for the session's
own: its events as `ServerEvent`s (`server_event`, written by `GrpcWire`, which also
follows whether a reply is under way, for a tool result to wait on), and the tools a
`SessionConfig` declares (`Tooling`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from audio_io._proto import duplex_pb2 as pb
from audio_io.frame import Int16Array
from audio_io.grpc_codec import WireFormat
from duplex import events as ev
from duplex.events import Event
from duplex.transports.output import Cursor
from models.tools import Tool, ToolChoice, ToolError, ToolLimits, parse_choice, parse_tools

_TURN = {
    ev.SPEECH_STARTED: pb.TurnEvent.SPEECH_STARTED,
    ev.SPEECH_STOPPED: pb.TurnEvent.SPEECH_STOPPED,
    ev.RESPONSE_CREATED: pb.TurnEvent.RESPONSE_STARTED,
    ev.RESPONSE_DONE: pb.TurnEvent.RESPONSE_DONE,
    ev.TRUNCATED: pb.TurnEvent.INTERRUPTED,
    ev.RESUMED: pb.TurnEvent.RESUMED,
}


def server_event(event: Event) -> pb.ServerEvent | None:
    """A session event as the API's message (None: not part of the API)."""
    d: dict[str, Any] = event.data
    if event.type in (ev.TRANSCRIPT_DELTA, ev.TRANSCRIPT_DONE):
        final = event.type == ev.TRANSCRIPT_DONE
        text = d["transcript"] if final else d["delta"]
        words = [pb.Word(**w) for w in d.get("words", ())]
        transcript = pb.Transcript(item_id=d["item_id"], text=text, final=final, words=words)
        return pb.ServerEvent(transcript=transcript)
    if event.type == ev.TEXT_DELTA:
        text = pb.AssistantText(response_id=d["response_id"], item_id=d["item_id"], delta=d["delta"])
        return pb.ServerEvent(text=text)
    if event.type == ev.METRICS:
        steps = {k: float(v) for k, v in d.items() if k.endswith("_ms") and k != "voice_to_voice_ms"}
        voice = float(d.get("voice_to_voice_ms", 0.0))  # a reply to text input has none
        metrics = pb.Metrics(
            response_id=d["response_id"],
            voice_to_voice_ms=voice,
            steps_ms=steps,
            prompt_tokens=d.get("prompt_tokens", 0),
            cached_tokens=d.get("cached_tokens", 0),
            end_of_turn_score=d.get("end_of_turn_score"),
        )
        return pb.ServerEvent(metrics=metrics)
    if event.type == ev.ERROR:
        return pb.ServerEvent(error=pb.Error(code=d["error"]["code"], message=d["error"]["message"]))
    if event.type == ev.CALL_DONE:  # a call is told once, whole (its item and deltas are Realtime's)
        call = pb.ToolCall(
            response_id=d["response_id"], call_id=d["call_id"], name=d["name"], arguments_json=d["arguments"]
        )
        return pb.ServerEvent(tool_call=call)
    if event.type in (ev.CALL_ADDED, ev.CALL_DELTA):
        return None
    if event.type == ev.TOOL_TIMEOUT:  # the client's failure to answer, as the error it is
        said = f"call {d['call_id']} ({d['name']}) had no result in {d['timeout_s']:g} s; answered as failed"
        return pb.ServerEvent(error=pb.Error(code="tool_timeout", message=said))
    kind = _TURN.get(event.type)
    if kind is None:
        return None  # duplex.state: the turn events say it
    turn = pb.TurnEvent(
        kind=kind,
        item_id=d.get("item_id", ""),
        response_id=d.get("response_id", ""),
        audio_ms=int(d.get("audio_start_ms", d.get("audio_end_ms", 0))),
        heard_text=d.get("transcript", ""),
        status=d.get("status", ""),
    )
    return pb.ServerEvent(turn=turn)


class GrpcWire:
    """A stream's output on the wire: reply audio in the client's format, events as messages."""

    transport = "grpc"

    def __init__(self, output: WireFormat) -> None:
        self.output = output
        self.rate = output.sample_rate
        self._sequence = 0
        self.replying = False  # a reply the client has been told of is under way

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[pb.ServerEvent]:
        chunk = pb.AudioChunk(
            data=self.output.encode(samples), sequence=self._sequence, response_id=cursor.response_id
        )
        self._sequence += 1
        return [pb.ServerEvent(audio=chunk)]

    def event(self, event: Event) -> list[pb.ServerEvent]:
        if event.type == ev.RESPONSE_CREATED:
            self.replying = True
        elif event.type == ev.RESPONSE_DONE:
            self.replying = False
        message = server_event(event)
        return [] if message is None else [message]

    def end_reply(self, cursor: Cursor, completed: bool) -> list[pb.ServerEvent]:
        return []

    def flushed(self) -> list[pb.ServerEvent]:
        return []


@dataclass(frozen=True)
class Tooling:
    """A stream's tools, from its SessionConfig."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice()
    manual_replies: bool = False  # a ToolResult does not start the reply by itself

    @classmethod
    def parse(cls, message: pb.SessionConfig) -> Tooling:
        raw = []
        for tool in message.tools:
            try:
                parameters = json.loads(tool.parameters_json) if tool.parameters_json else {}
            except ValueError:
                raise ToolError(f"tool {tool.name}: parameters_json is not JSON") from None
            declared = {"name": tool.name, "description": tool.description, "parameters": parameters}
            raw.append({"type": "function", **declared})
        tools = parse_tools(raw, ToolLimits())
        mode = pb.ToolChoice.Mode.Name(message.tool_choice.mode).lower()
        wanted = {"type": "function", "name": message.tool_choice.name} if mode == "function" else mode
        return cls(tools, parse_choice(wanted, tools), message.manual_tool_replies)
