"""What ``WS /v1/realtime`` tells its client, in the GA API's shapes: `RealtimeWire`
turns the session's events and audio into server events, and `RealtimeItems` keeps
what they refer to (the conversation's items, the responses, the user words each turn
holds) and sends them, each with its ``event_id``.

Every shape here is checked in the tests against the openai SDK's own model for its
type (tests/realtime_shapes.py): no field missing, mistyped, or made up. One is
deliberately without ``event_id``: ``input_audio_buffer.dtmf_event_received``, which
the API defines as ``type``, ``event`` (the key) and ``received_at`` (Unix seconds).
"""

from __future__ import annotations

import base64
import collections
import itertools
import json
from typing import Any

from audio_io.frame import Int16Array
from audio_io.g711 import encode_wire
from audio_io.outbox import Outbox
from duplex import events as ev
from duplex.events import Event
from duplex.transports.output import Cursor
from duplex.transports.realtime_config import FORMATS, RealtimeError, RealtimeSessionConfig

MAX_QUEUED = 2000  # events waiting for a client that does not read
MAX_ITEMS = 1000  # conversation items (and responses) remembered, for truncate and previous_item_id
LAWS = {"audio/pcmu": "ulaw", "audio/pcma": "alaw", "audio/pcm": None}  # for encode_wire / decode_wire


def user_message(item_id: str, part: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [part],
    }


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


class RealtimeItems:
    """One connection's conversation as its client sees it (the latest `MAX_ITEMS` items
    and responses, for truncate, retrieve, delete and previous_item_id), and the events
    to send it."""

    _events = itertools.count()

    def __init__(self, config: RealtimeSessionConfig) -> None:
        self.config = config
        self.outbox: Outbox[str] = Outbox(max_control=MAX_QUEUED)  # a client that reads nothing gets no more
        self._items: dict[str, dict[str, Any]] = {}  # by item id, as the client sees them
        self._order: collections.deque[str] = collections.deque()
        self._responses: dict[str, str] = {}  # response id -> its item id, oldest first
        # user items the session took as words of a turn: their text (as given), the reply
        # whose turn holds it, and those no reply has answered yet, for conversation.item.delete
        self._texts: dict[str, str] = {}
        self._turn_of: dict[str, str] = {}
        self._waiting: list[str] = []

    # -- sending --

    def message(self, type_: str, **fields: Any) -> str:
        return json.dumps({"type": type_, "event_id": f"event_{next(self._events)}", **fields})

    def send(self, type_: str, **fields: Any) -> None:
        self.outbox.put([self.message(type_, **fields)])

    def error(self, error: RealtimeError, event_id: str | None) -> None:
        self.send("error", error=error.body(event_id))

    # -- items --

    def _add_item(self, item: dict[str, Any]) -> None:
        previous = self._order[-1] if self._order else None
        self._items[item["id"]] = item
        self._order.append(item["id"])
        while len(self._order) > MAX_ITEMS:
            gone = self._order.popleft()
            del self._items[gone]
            self._texts.pop(gone, None)
            self._turn_of.pop(gone, None)
        self.send("conversation.item.added", previous_item_id=previous, item=item)

    def user_item(self, item_id: str, committed: bool) -> None:
        if item_id in self._items:
            return
        if committed:
            previous = self._order[-1] if self._order else None
            self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        self._add_item(user_message(item_id, {"type": "input_audio", "transcript": None}))

    def given(self, item_id: str, text: str) -> None:
        """The session took this user item's text as (part of) a turn."""
        if item_id in self._items:
            self._texts[item_id] = text
            self._waiting = [*self._waiting[-MAX_ITEMS + 1 :], item_id]

    def item_done(self, item_id: str, role: str, content: list[dict[str, Any]]) -> None:
        item = self._items.get(item_id)
        if item is None:
            return
        item["content"], item["status"] = content, "completed" if role == "user" else item["status"]
        previous = self._order[self._order.index(item_id) - 1] if self._order.index(item_id) else None
        self.send("conversation.item.done", previous_item_id=previous, item=item)

    def part(self, response_id: str) -> dict[str, Any]:
        return {
            "response_id": response_id,
            "item_id": self._responses.get(response_id, ""),
            "output_index": 0,
            "content_index": 0,
        }

    def _response(self, response_id: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": "turn_detected"}
        return {
            "object": "realtime.response",
            "id": response_id,
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": "conv_" + self.config.id,
            "output_modalities": ["audio"],
            "max_output_tokens": "inf",
            "metadata": None,
            "usage": None,
            "audio": {"output": {"format": self.config.output_format, "voice": self.config.voice}},
        }

    def response_created(self, response_id: str, item_id: str) -> None:
        self._responses[response_id] = item_id
        for user in self._waiting:  # the turn this reply answers holds their words
            self._turn_of[user] = response_id
        self._waiting = []
        while len(self._responses) > MAX_ITEMS:
            del self._responses[next(iter(self._responses))]
        self.send("response.created", response=self._response(response_id, "in_progress", []))
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.send("response.output_item.added", response_id=response_id, output_index=0, item=item)
        self._add_item(item)
        self.send(
            "response.content_part.added", **self.part(response_id), part={"type": "audio", "transcript": ""}
        )

    def response_done(self, response_id: str, status: str, transcript: str) -> None:
        item_id = self._responses.get(response_id, "")
        item = self._items.get(item_id)
        part = self.part(response_id)
        self.send("response.output_audio.done", **part)
        self.send("response.output_audio_transcript.done", **part, transcript=transcript)
        self.send("response.content_part.done", **part, part={"type": "audio", "transcript": transcript})
        output = []
        if item is not None:
            item["status"] = "completed" if status == "completed" else "incomplete"
            item["content"] = [{"type": "output_audio", "transcript": transcript}]
            self.send("response.output_item.done", response_id=response_id, output_index=0, item=item)
            self.item_done(item_id, "assistant", item["content"])
            output = [item]
        self.send("response.done", response=self._response(response_id, status, output))

    def truncated(self, item_id: str, audio_end_ms: int) -> None:
        self.send("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=audio_end_ms)
