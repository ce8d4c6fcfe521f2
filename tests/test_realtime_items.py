"""`RealtimeItems`, the item store of one Realtime connection, on its own: what it
remembers (the latest `MAX_ITEMS`), what it finds (a response's item, a user item's
words and turn), what a delete takes out, and the events it sends for each, in order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from duplex.transports import realtime_items
from duplex.transports.realtime_config import RealtimeError, RealtimeSessionConfig
from duplex.transports.realtime_items import RealtimeItems, user_text


def store() -> RealtimeItems:
    return RealtimeItems(RealtimeSessionConfig("sess_1", "joe", "", 100))


def sent(items: RealtimeItems) -> list[dict[str, Any]]:
    return [json.loads(m) for m in items.outbox.take()]


def test_items_chain_by_previous_item_id_and_a_response_finds_its_item():
    s = store()
    s.user_item("item_a", committed=True)
    s.text_item("item_b", "  Hi. ")
    s.response_created("resp_1", "item_c")
    events = sent(s)
    added = [
        (e["item"]["id"], e["previous_item_id"]) for e in events if e["type"] == "conversation.item.added"
    ]
    assert added == [("item_a", None), ("item_b", "item_a"), ("item_c", "item_b")]
    assert [e["type"] for e in events][:2] == ["input_audio_buffer.committed", "conversation.item.added"]
    assert s.response_of("item_c") == "resp_1" and s.response_of("item_b") is None
    assert s.item("item_b") == {
        "id": "item_b",
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_text", "text": "  Hi. "}],
    }
    s.user_item("item_a", committed=True)  # known already: nothing
    assert sent(s) == []


def test_words_are_taken_with_the_turn_that_holds_them():
    s = store()
    s.text_item("item_a", " My name is Zed. ")  # given stripped
    s.response_created("resp_1", "item_1")  # its turn holds item_a's words
    s.text_item("item_b", "Later.")  # waits for a reply
    s.user_item("item_c", committed=False)
    assert s.transcribing("item_c") and not s.transcribing("item_a")
    assert s.take_text("item_b") == (None, "Later.", True)
    assert s.take_text("item_a") == ("resp_1", "My name is Zed.", False)
    assert s.take_text("item_a") is None  # taken already
    assert s.take_text("item_c") is None  # no words of it were given
    s.deleted("item_a")
    s.deleted("item_gone")  # (forgotten meanwhile): still told
    assert [e["item_id"] for e in sent(s) if e["type"] == "conversation.item.deleted"] == [
        "item_a",
        "item_gone",
    ]
    assert s.item("item_a") is None and s.item("item_b") is not None


def test_the_store_remembers_the_latest_items_and_responses_only():
    s = store()
    n = realtime_items.MAX_ITEMS
    for k in range(n + 2):
        s.text_item(f"item_u{k}", "hi")
        s.response_created(f"resp_{k}", f"item_r{k}")
        s.outbox.take()  # a client that reads
    assert s.item("item_u0") is None and s.take_text("item_u0") is None  # its words went with it
    assert s.item(f"item_r{n + 1}") is not None and s.response_of(f"item_r{n + 1}") == f"resp_{n + 1}"
    assert s.response_of("item_r0") is None and s.response_of("item_r1") is None
    assert s.response_of("item_r2") == "resp_2"  # the oldest response still remembered
    s.forget_response("resp_2")
    assert s.response_of("item_r2") is None


def test_a_reply_done_completes_its_item_and_tells_it_in_order():
    s = store()
    s.response_created("resp_1", "item_1")
    s.outbox.take()
    s.response_done("resp_1", "cancelled", "Hi")
    events = sent(s)
    assert [e["type"] for e in events] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert s.item("item_1") == {
        "id": "item_1",
        "object": "realtime.item",
        "type": "message",
        "status": "incomplete",
        "role": "assistant",
        "content": [{"type": "output_audio", "transcript": "Hi"}],
    }
    assert events[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}


@pytest.mark.parametrize(
    ("item", "code"),
    [
        (None, "missing_required_parameter"),
        ({"type": "message", "role": "assistant", "content": []}, "unsupported"),
        ({"type": "message", "role": "user", "content": []}, "invalid_value"),
        ({"type": "message", "role": "user", "content": [{"type": "input_audio"}]}, "invalid_value"),
        (
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 4001}]},
            "string_above_max_length",
        ),
    ],
)
def test_a_user_message_a_client_creates_is_its_input_text_or_refused(item, code):
    with pytest.raises(RealtimeError) as refused:
        user_text(item)
    assert refused.value.code == code
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there."}]
    assert user_text({"type": "message", "role": "user", "content": parts}) == "Hello there."
