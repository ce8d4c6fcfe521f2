"""What a session tells its client: events named after the OpenAI Realtime API.

Where the Realtime API has a name for something, the event uses it, so that people
who know one protocol know the other; what it has no name for is prefixed ``duplex.``.
Every event is a type and a flat JSON-able payload; transports translate them to
their wire formats (a data channel, gRPC messages, Realtime JSON).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

SPEECH_STARTED = "input_audio_buffer.speech_started"
SPEECH_STOPPED = "input_audio_buffer.speech_stopped"
TRANSCRIPT_DELTA = "conversation.item.input_audio_transcription.delta"
TRANSCRIPT_DONE = "conversation.item.input_audio_transcription.completed"
RESPONSE_CREATED = "response.created"
AUDIO_DELTA = "response.output_audio.delta"
TEXT_DELTA = "response.output_audio_transcript.delta"
RESPONSE_DONE = "response.done"
TRUNCATED = "conversation.item.truncated"
ERROR = "error"
STATE = "duplex.state"  # the session's state machine moved
RESUMED = "duplex.response.resumed"  # a false interruption: the reply goes on where it paused
METRICS = "duplex.turn.metrics"  # per-turn latency breakdown
# a reply's call of a client's function (duplex.tool_calls): call_id, call_index, then
# name; delta; name and arguments (the function_call item's events in the Realtime API)
CALL_ADDED = "response.output_item.added"
CALL_DELTA = "response.function_call_arguments.delta"
CALL_DONE = "response.function_call_arguments.done"
# a call had no result in time (duplex.tool_wait): call_id, name, timeout_s
TOOL_TIMEOUT = "duplex.tool.timeout"
DTMF = "input_audio_buffer.dtmf_event_received"  # the caller pressed a key (telephony): event, received_at


@dataclass(frozen=True)
class Event:
    type: str
    data: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.data}


class SessionError(Exception):
    """Bad input from a client: sent back as an ``error`` event; the session goes on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def event(self) -> Event:
        return Event(
            ERROR, {"error": {"type": "invalid_request_error", "code": self.code, "message": str(self)}}
        )
