"""`RealtimeWire`: what ``WS /v1/realtime`` tells its client of its session, in the GA
API's shapes. The session's events already carry the Realtime names; the wire adds what
the protocol wraps around them (item and response objects, content parts, transcript
deltas as increments, base64 audio in the client's output format) and sends them
through the connection's item store (`RealtimeItems`, realtime_items.py), which
remembers what each names.

Every shape here is checked in the tests against the openai SDK's own model for its
type (tests/realtime_shapes.py): no field missing, mistyped, or made up. One is
deliberately without ``event_id``: ``input_audio_buffer.dtmf_event_received``, which
the API defines as ``type``, ``event`` (the key) and ``received_at`` (Unix seconds).
"""

from __future__ import annotations

import base64
import json

from audio_io.frame import Int16Array
from audio_io.g711 import encode_wire
from duplex import events as ev
from duplex.events import Event
from duplex.transports.output import Cursor
from duplex.transports.realtime_config import FORMATS, LAWS
from duplex.transports.realtime_items import RealtimeItems


class RealtimeWire:
    """A connection's output on the wire: runtime events and audio as GA server events
    (sent through the connection's bookkeeping of items and responses)."""

    transport = "realtime"

    def __init__(self, connection: RealtimeItems) -> None:
        self.connection = connection
        self._transcripts: dict[str, str] = {}  # response id -> text so far (one reply at a time)
        self._partial = ("", "")  # the user item being transcribed, and its transcript deltas sent

    @property
    def rate(self) -> int:
        return FORMATS[self.connection.config.output_format["type"]]

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[str]:
        c = self.connection
        c.config.audio_started = True
        law = LAWS[c.config.output_format["type"]]
        data = base64.b64encode(encode_wire(samples, law)).decode()
        return [c.message("response.output_audio.delta", **c.part(cursor.response_id), delta=data)]

    def end_reply(self, cursor: Cursor, completed: bool) -> list[str]:
        return []

    def flushed(self) -> list[str]:
        return []

    def event(self, event: Event) -> list[str]:
        """Sent as they are made (`RealtimeItems.send`): nothing returned."""
        c, d = self.connection, event.data
        if event.type == ev.SPEECH_STARTED:
            c.send(
                "input_audio_buffer.speech_started", audio_start_ms=d["audio_start_ms"], item_id=d["item_id"]
            )
        elif event.type == ev.SPEECH_STOPPED:
            c.send("input_audio_buffer.speech_stopped", audio_end_ms=d["audio_end_ms"], item_id=d["item_id"])
            c.user_item(d["item_id"], committed=True)
        elif event.type == ev.TRANSCRIPT_DELTA:
            item, sent = self._partial
            sent = sent if item == d["item_id"] else ""  # user turns come one after another
            if d["delta"].startswith(sent) and len(d["delta"]) > len(sent):  # deltas only append
                c.send(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=d["item_id"],
                    content_index=0,
                    delta=d["delta"][len(sent) :],
                )
                self._partial = (d["item_id"], d["delta"])
        elif event.type == ev.TRANSCRIPT_DONE:
            self._partial = ("", "")
            c.user_item(d["item_id"], committed=True)
            c.send(
                "conversation.item.input_audio_transcription.completed",
                item_id=d["item_id"],
                content_index=0,
                transcript=d["transcript"],
                usage=d.get("usage", {"type": "duration", "seconds": 0.0}),
            )
            c.item_done(d["item_id"], "user", [{"type": "input_audio", "transcript": d["transcript"]}])
            if d["transcript"]:  # a turn of the session's (an empty one, its reply's echo, is none)
                c.given(d["item_id"], d["transcript"])
        elif event.type == ev.DTMF:  # the API's shape: no event_id
            c.outbox.put(
                [json.dumps({"type": ev.DTMF, "event": d["event"], "received_at": d["received_at"]})]
            )
        elif event.type == ev.RESPONSE_CREATED:
            c.response_created(d["response_id"], d["item_id"])
        elif event.type == ev.TEXT_DELTA:
            self._transcripts[d["response_id"]] = self._transcripts.get(d["response_id"], "") + d["delta"]
            c.send("response.output_audio_transcript.delta", **c.part(d["response_id"]), delta=d["delta"])
        elif event.type == ev.CALL_ADDED:
            c.call_added(d["response_id"], d["call_id"], d["name"])
        elif event.type == ev.CALL_DELTA:
            c.call_delta(d["response_id"], d["call_id"], d["delta"])
        elif event.type == ev.CALL_DONE:
            c.call_done(d["response_id"], d["call_id"], d["name"], d["arguments"])
        elif event.type == ev.RESPONSE_DONE:
            c.response_done(d["response_id"], d["status"], self._transcripts.pop(d["response_id"], ""))
        elif event.type == ev.TRUNCATED:
            c.truncated(d["item_id"], d["audio_end_ms"])
        elif event.type == ev.ERROR:
            error = d["error"]
            c.send(
                "error",
                error={
                    "type": error.get("type", "invalid_request_error"),
                    "code": error["code"],
                    "message": error["message"],
                    "param": None,
                    "event_id": None,
                },
            )
        return []
