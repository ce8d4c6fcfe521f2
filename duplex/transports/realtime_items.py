"""`RealtimeItems`: one Realtime connection's conversation as its client has been told it,
and the events that tell it.

A client names items in later events (``conversation.item.truncate``, ``retrieve``,
``delete``, ``previous_item_id``), so the connection keeps them, as it sent them:

    items      item id ─► the item object, last sent    (the latest `MAX_ITEMS`, in order)
    responses  response id ─► its assistant item          (the latest `MAX_ITEMS`)
    texts      user item ─► its words, as the session took them into a turn
    turn_of    user item ─► the reply whose turn holds those words
    waiting    user items with words no reply has answered yet

The last three are what ``conversation.item.delete`` takes back out of the session
(`take_text`). Both directions share the store: the session's events add to it
(`RealtimeWire`, realtime_events.py), the client's events look up and delete
(`RealtimeConnection`, realtime_client.py). It holds data and an `Outbox` only, no
socket and no session, so it is tested on its own (tests/test_realtime_items.py). The
item objects are made here, and the one kind a client may create is read here too
(`user_text`).
"""

from __future__ import annotations

import collections
import itertools
import json
from typing import Any

from audio_io.outbox import Outbox
from duplex.transports.realtime_config import RealtimeError, RealtimeSessionConfig

MAX_QUEUED = 2000  # events waiting for a client that does not read
MAX_ITEMS = 1000  # conversation items (and responses) remembered, for truncate and previous_item_id
MAX_TEXT_CHARS = 4000  # one user text message a client creates


def user_message(item_id: str, part: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [part],
    }


def user_text(item: Any) -> str:
    """The words of a user message a client creates (``conversation.item.create``): its
    ``input_text`` parts, joined, at most `MAX_TEXT_CHARS`; any other item is refused."""
    if not isinstance(item, dict):
        raise RealtimeError("Missing required parameter: 'item'.", "missing_required_parameter", "item")
    if item.get("type") != "message" or item.get("role") != "user":
        raise RealtimeError("Only user messages can be created.", "unsupported", "item.type")
    content = item.get("content")
    parts = content if isinstance(content, list) else []
    texts = [
        p["text"]
        for p in parts
        if isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)
    ]
    if not texts or len(texts) != len(parts):
        raise RealtimeError("A user message needs 'input_text' content.", "invalid_value", "item.content")
    text = " ".join(texts)
    if len(text) > MAX_TEXT_CHARS:
        raise RealtimeError(
            f"The message is over {MAX_TEXT_CHARS} characters.", "string_above_max_length", "item.content"
        )
    return text


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
        self._calls: dict[str, list[str]] = {}  # response id -> its function_call items, in order

    # -- sending --

    def message(self, type_: str, **fields: Any) -> str:
        return json.dumps({"type": type_, "event_id": f"event_{next(self._events)}", **fields})

    def send(self, type_: str, **fields: Any) -> None:
        self.outbox.put([self.message(type_, **fields)])

    def error(self, error: RealtimeError, event_id: str | None) -> None:
        self.send("error", error=error.body(event_id))

    # -- items --

    def item(self, item_id: str) -> dict[str, Any] | None:
        """The item as the client was last told it (None: never, or no longer remembered)."""
        return self._items.get(item_id)

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

    def text_item(self, item_id: str, text: str) -> None:
        """A user text message the client created, its words given to the session."""
        self._add_item(user_message(item_id, {"type": "input_text", "text": text}))
        self.given(item_id, text.strip())
        self.send("conversation.item.done", previous_item_id=None, item=self._items[item_id])

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
        self._done(item_id)

    def _done(self, item_id: str) -> None:
        previous = self._order[self._order.index(item_id) - 1] if self._order.index(item_id) else None
        self.send("conversation.item.done", previous_item_id=previous, item=self._items[item_id])

    def transcribing(self, item_id: str) -> bool:
        """A user audio item whose transcript has not come yet."""
        content = self._items[item_id]["content"]
        return (
            bool(content) and content[0].get("type") == "input_audio" and content[0].get("transcript") is None
        )

    def take_text(self, item_id: str) -> tuple[str | None, str, bool] | None:
        """A user item's words, out of the store, for the session to forget: the reply
        whose turn holds them (None: none yet), the text as the session took it, and
        whether it still waited for a reply. None: the session took no words of it."""
        if item_id not in self._texts:
            return None
        waiting = item_id in self._waiting
        if waiting:
            self._waiting.remove(item_id)
        return self._turn_of.pop(item_id, None), self._texts.pop(item_id), waiting

    def deleted(self, item_id: str) -> None:
        """The item is gone from the conversation (it may be gone from here already: a
        reply that stopped as it was deleted may have been forgotten meanwhile)."""
        if item_id in self._items:
            del self._items[item_id]
            self._order.remove(item_id)
        self.send("conversation.item.deleted", item_id=item_id)

    # -- responses --

    def response_of(self, item_id: str) -> str | None:
        """The response whose assistant item this is (None: not one remembered)."""
        return next((r for r, i in self._responses.items() if i == item_id), None)

    def forget_response(self, response_id: str) -> None:
        del self._responses[response_id]

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
        for call_item in self._calls.pop(response_id, []):
            call = self._items.get(call_item)
            if call is not None:
                if call["status"] == "in_progress":  # cut off before its arguments were whole
                    call["status"] = "incomplete"
                output.append(call)
        self.send("response.done", response=self._response(response_id, status, output))

    # -- function calls --

    def call_added(self, response_id: str, call_id: str, name: str) -> None:
        """A reply began a call: its item follows the reply's audio message."""
        item_id = f"item_{call_id}"
        calls = self._calls.setdefault(response_id, [])
        calls.append(item_id)
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        self.send("response.output_item.added", response_id=response_id, output_index=len(calls), item=item)
        self._add_item(item)

    def _call_part(self, response_id: str, call_id: str) -> dict[str, Any]:
        item_id = f"item_{call_id}"
        index = self._calls.get(response_id, []).index(item_id) + 1
        return {"response_id": response_id, "item_id": item_id, "output_index": index, "call_id": call_id}

    def call_delta(self, response_id: str, call_id: str, delta: str) -> None:
        self.send(
            "response.function_call_arguments.delta", **self._call_part(response_id, call_id), delta=delta
        )

    def call_done(self, response_id: str, call_id: str, name: str, arguments: str) -> None:
        part = self._call_part(response_id, call_id)
        self.send("response.function_call_arguments.done", **part, name=name, arguments=arguments)
        item = self._items.get(part["item_id"])
        if item is not None:
            item["arguments"], item["status"] = arguments, "completed"
            index = part["output_index"]
            self.send("response.output_item.done", response_id=response_id, output_index=index, item=item)
            self._done(part["item_id"])

    def call_output(self, item_id: str, call_id: str, output: str) -> None:
        """The client's result for a call, taken by the session."""
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "function_call_output",
            "status": "completed",
            "call_id": call_id,
            "output": output,
        }
        self._add_item(item)
        self._done(item_id)

    def truncated(self, item_id: str, audio_end_ms: int) -> None:
        self.send("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=audio_end_ms)
