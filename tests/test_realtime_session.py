"""The Realtime API without a socket: the session object (what session.update may set,
all or nothing), how a client event is read (`_parse`), the pace of a client's events,
the bounds on what one connection remembers, every server event's shape against the
openai SDK's models (tests/realtime_shapes.py), and what a deleted item takes out of
the session (against a recording port: the real session is in tests/test_realtime.py)."""

from __future__ import annotations

import json
from typing import Any, cast

import numpy as np
import pytest

from duplex import events as ev
from duplex.events import Event
from duplex.transports import realtime_client as realtime
from duplex.transports.output import Cursor
from duplex.transports.realtime_client import RealtimeConnection
from duplex.transports.realtime_config import MAX_ECHO_DEPTH, RealtimeError, RealtimeSessionConfig
from duplex.transports.realtime_events import RealtimeWire
from duplex.transports.realtime_pace import Pace
from duplex.transports.webrtc import PeerWire
from tests.realtime_shapes import MODELS, ShapeError, check
from tests.weather_tool import WEATHER


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def config() -> RealtimeSessionConfig:
    return RealtimeSessionConfig("sess_1", "joe", "Be brief.", 100)


def test_an_update_changes_what_it_names_and_reports_the_whole_session():
    c = config()
    c.update(
        {
            "type": "realtime",
            "instructions": "Be kind.",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcmu"},
                    "turn_detection": {
                        "type": "server_vad",
                        "silence_duration_ms": 700,
                        "threshold": 0.6,
                    },
                    "transcription": {"model": "whisper-1"},
                },
                "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin", "speed": 1.2},
            },
            "tracing": "auto",
            "tools": [],
        }
    )
    out = c.as_dict()
    assert out["instructions"] == "Be kind." and out["type"] == "realtime"
    check({"type": "session.updated", "event_id": "event_1", "session": out})  # the SDK's session shape
    assert out["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    td = out["audio"]["input"]["turn_detection"]
    assert td["silence_duration_ms"] == 700 and td["create_response"] is True and td["threshold"] == 0.6
    assert out["audio"]["output"]["voice"] == "marin" and out["audio"]["output"]["speed"] == 1.2
    assert out["audio"]["input"]["transcription"] == {"model": "whisper-1"} and out["tracing"] == "auto"
    c.update({"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    assert c.turn_detection is None


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ("nope", "invalid_type", "session"),
        ({"type": "transcription"}, "invalid_value", "session.type"),
        ({"instructions": "x" * 101}, "invalid_value", "session.instructions"),
        ({"output_modalities": ["text"]}, "invalid_value", "session.output_modalities"),
        (
            {"audio": {"input": {"format": {"type": "audio/opus"}}}},
            "invalid_value",
            "session.audio.input.format.type",
        ),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "invalid_value", None),
        # a list or an object where a string belongs (unhashable: once a traceback)
        ({"audio": {"input": {"format": {"type": []}}}}, "invalid_value", "session.audio.input.format.type"),
        (
            {"audio": {"output": {"format": {"type": {}}}}},
            "invalid_value",
            "session.audio.output.format.type",
        ),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "invalid_value", None),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}},
            "invalid_value",
            None,
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": "yes"}}}},
            "invalid_value",
            None,
        ),
        ({"audio": {"output": {"voice": 7}}}, "invalid_value", "session.audio.output.voice"),
        ({"teleport": True}, "unknown_parameter", "session.teleport"),
        # too deep to show (its repr raised RecursionError), too deep or long to keep and echo
        (
            {"audio": {"input": {"format": {"type": nested(100_000)}}}},
            "invalid_value",
            "session.audio.input.format.type",
        ),
        ({"tracing": nested(MAX_ECHO_DEPTH + 1)}, "invalid_value", "session.tracing"),
        ({"prompt": {"id": "x" * 20_000}}, "invalid_value", "session.prompt"),
        ({"audio": {"input": {"noise_reduction": nested(100_000)}}}, "invalid_value", None),
        ({"audio": {"output": {"voice": "v" * 65}}}, "invalid_value", "session.audio.output.voice"),
    ],
)
def test_a_bad_update_is_refused_and_changes_nothing(session, code, param):
    c = config()
    before = c.as_dict()
    with pytest.raises(RealtimeError) as caught:
        c.update({"instructions": "changed", **session} if isinstance(session, dict) else session)
    assert caught.value.code == code
    if param is not None:
        assert caught.value.param == param
    assert c.as_dict() == before


def test_the_voice_is_fixed_once_audio_went_out():
    c = config()
    c.audio_started = True
    with pytest.raises(RealtimeError):
        c.update({"audio": {"output": {"voice": "other"}}})
    c.update({"audio": {"output": {"voice": "joe"}}})  # the same voice: fine


def test_an_accepted_and_ignored_value_within_bounds_is_echoed():
    c = config()
    c.update(
        {"tracing": {"workflow_name": "w", "metadata": {"a": [1, [2]]}}, "include": nested(MAX_ECHO_DEPTH)}
    )
    assert c.as_dict()["tracing"]["metadata"] == {"a": [1, [2]]}


# -- reading a client event: refused before decoding when it cannot be valid --


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (
            '{"type": "input_audio_buffer.append", "audio": "' + "A" * realtime.MAX_EVENT_CHARS + '"}',
            "audio_too_large",
        ),
        (
            '{"type": "session.update", "session": "' + "x" * realtime.MAX_EVENT_CHARS + '"}',
            "event_too_large",
        ),
        ('{"type": "input_audio_buffer.app', "invalid_json"),
        ("[" * 100_000 + "]" * 100_000, "invalid_json"),  # RecursionError in json.loads
        ('{"type": "session.update", "session": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid_json"),
        ("[]", "invalid_event"),
        ('"input_audio_buffer.append"', "invalid_event"),
        ("42", "invalid_event"),
        ("null", "invalid_event"),
    ],
)
def test_a_bad_event_is_refused_with_its_code(raw, code):
    with pytest.raises(RealtimeError) as caught:
        realtime._parse(raw)
    assert caught.value.code == code


# -- the pace of a client's events --


def test_a_burst_is_read_at_once_then_events_wait_for_the_rate():
    pace = Pace(rate=100, burst=10, now=0.0)
    assert [pace.wait_s(1, 0.0) for _ in range(10)] == [0.0] * 10
    assert pace.wait_s(1, 0.0) == pytest.approx(0.01)  # one event's worth of the rate
    assert pace.over_s(0.5) == 0.5
    assert pace.wait_s(1, 0.5) == 0.0  # it slowed down: the bucket refilled, and it is not over
    assert pace.over_s(0.5) == 0.0
    assert pace.wait_s(20, 0.5) == pytest.approx(0.11)  # a large event costs more


def test_a_client_at_a_real_clients_rate_never_waits():
    pace = Pace(realtime.EVENT_RATE, realtime.EVENT_BURST, now=0.0)
    appends = 50 * 60  # a minute of 20 ms appends, 1,280 characters each
    waits = [pace.wait_s(1 + 1280 // realtime.EVENT_BYTES, k / 50) for k in range(appends)]
    assert not any(waits)


@pytest.mark.parametrize("oversleep", [0.0, 0.005, 0.1])  # a loaded loop wakes its reader late
def test_a_flood_is_read_at_the_rate_and_is_over_it_until_patience_runs_out(oversleep):
    pace = Pace(realtime.EVENT_RATE, realtime.EVENT_BURST, now=0.0)
    now, read = 0.0, 0
    while pace.over_s(now) <= realtime.PATIENCE_S:  # the reader: wait, then read the next
        wait = pace.wait_s(1, now)
        now += wait + oversleep if wait else 0.0
        read += 1
    assert now == pytest.approx(realtime.PATIENCE_S, abs=0.2)  # it has waited since the burst ran out
    assert read == pytest.approx(realtime.EVENT_BURST + realtime.EVENT_RATE * now, rel=0.01)


# -- what one connection remembers --


def test_a_connection_remembers_a_bounded_number_of_items_and_responses():
    settings = RealtimeSessionConfig("sess_1", "joe", "", 100)
    connection = RealtimeConnection(cast(Any, None), settings)
    wire = RealtimeWire(connection)
    for n in range(3 * realtime.MAX_ITEMS):
        user = f"item_user_{n}"
        wire.event(Event(ev.TRANSCRIPT_DELTA, {"item_id": user, "delta": "hello"}))
        wire.event(Event(ev.TRANSCRIPT_DONE, {"item_id": user, "transcript": "hello"}))
        wire.event(Event(ev.RESPONSE_CREATED, {"response_id": f"resp_{n}", "item_id": f"item_{n}"}))
        wire.event(Event(ev.TEXT_DELTA, {"response_id": f"resp_{n}", "delta": "hi"}))
        wire.event(Event(ev.RESPONSE_DONE, {"response_id": f"resp_{n}", "status": "completed"}))
        connection.outbox.take()  # a client that reads
    assert len(connection._items) == len(connection._order) == realtime.MAX_ITEMS
    assert len(connection._responses) == realtime.MAX_ITEMS
    assert not wire._transcripts and wire._partial == ("", "")
    last = 3 * realtime.MAX_ITEMS - 1
    assert connection._responses[f"resp_{last}"] == f"item_{last}"  # the latest can still be truncated
    assert f"item_{last}" in connection._items and "item_0" not in connection._items


# -- every server event in the shape of the openai SDK's model for its type --


def connection() -> tuple[RealtimeConnection, RealtimeWire]:
    c = RealtimeConnection(cast(Any, None), RealtimeSessionConfig("sess_1", "joe", "", 100))
    return c, RealtimeWire(c)


def sent(c: RealtimeConnection) -> list[dict[str, Any]]:
    return [json.loads(m) for m in c.outbox.take()]


A_TURN = [
    Event(ev.SPEECH_STARTED, {"item_id": "item_0", "audio_start_ms": 10}),
    Event(ev.TRANSCRIPT_DELTA, {"item_id": "item_0", "delta": "Hel"}),
    Event(ev.TRANSCRIPT_DELTA, {"item_id": "item_0", "delta": "Hello"}),
    Event(ev.SPEECH_STOPPED, {"item_id": "item_0", "audio_end_ms": 900}),
    Event(
        ev.TRANSCRIPT_DONE,
        {"item_id": "item_0", "transcript": "Hello.", "usage": {"type": "duration", "seconds": 1.36}},
    ),
    Event(ev.RESPONSE_CREATED, {"response_id": "resp_1", "item_id": "item_1"}),
    Event(ev.TEXT_DELTA, {"response_id": "resp_1", "delta": "Hi there."}),
    Event(ev.DTMF, {"event": "#", "received_at": 1_764_600_000}),
    Event(ev.TRUNCATED, {"item_id": "item_1", "content_index": 0, "audio_end_ms": 300, "transcript": "Hi"}),
    Event(ev.RESPONSE_DONE, {"response_id": "resp_1", "status": "cancelled"}),
    Event(ev.RESPONSE_CREATED, {"response_id": "resp_2", "item_id": "item_2"}),
    Event(ev.RESPONSE_DONE, {"response_id": "resp_2", "status": "completed"}),
    Event(ev.STATE, {"state": "listening", "previous": "responding"}),  # duplex's own: not sent
    Event(ev.ERROR, {"error": {"type": "invalid_request_error", "code": "bad_audio", "message": "x"}}),
]


def test_every_event_the_wire_makes_has_the_sdk_shape():
    c, wire = connection()
    c.send("session.created", session=c.config.as_dict())
    for event in A_TURN:
        wire.event(event)
    c.outbox.put(wire.frame(np.zeros(480, np.int16), Cursor("resp_2")))
    c.error(RealtimeError("No.", "invalid_value", "type"), "evt_client_1")
    c.error(RealtimeError("Oops.", "server_error", kind="server_error"), None)
    events = [check(e) for e in sent(c)]
    kinds = [e["type"] for e in events]
    assert not [k for k in kinds if k.startswith("duplex.")]
    assert set(kinds) >= {
        "session.created",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
        "input_audio_buffer.dtmf_event_received",
        "conversation.item.truncated",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
        "error",
    }
    (completed,) = [e for e in events if e["type"].endswith("transcription.completed")]
    assert completed["usage"] == {"type": "duration", "seconds": 1.36}  # the seconds heard, as told
    deltas = [e["delta"] for e in events if e["type"].endswith("transcription.delta")]
    assert deltas == ["Hel", "lo"]  # increments, as the API sends them
    (keys,) = [e for e in events if e["type"] == "input_audio_buffer.dtmf_event_received"]
    assert keys == {
        "type": "input_audio_buffer.dtmf_event_received",
        "event": "#",
        "received_at": 1_764_600_000,
    }


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda e: e.pop("audio_end_ms"), "audio_end_ms"),  # missing
        (lambda e: e.update(audio_end_ms="300"), "audio_end_ms"),  # a string for an int
        (lambda e: e.update(audio_end_ms=300.0), "audio_end_ms"),  # a float for an int
        (lambda e: e.update(transcript="Hi"), "transcript"),  # made up (duplex's runtime event has it)
        (lambda e: e.update(type="conversation.item.trunkated"), "duplex."),  # not an API event
    ],
)
def test_the_shape_check_refuses_a_missing_mistyped_or_made_up_field(change, why):
    good = {"type": "conversation.item.truncated", "event_id": "e1", "item_id": "i", "content_index": 0}
    event = {**good, "audio_end_ms": 300}
    check(event)
    change(event)
    with pytest.raises(ShapeError, match=why.replace(".", r"\.")):
        check(event)


def test_the_shape_check_looks_inside_nested_objects():
    item = {"id": "i", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
    check({"type": "conversation.item.retrieved", "event_id": "e", "item": item})
    nested = {**item, "content": [{"type": "input_text", "text": "x", "words": []}]}
    with pytest.raises(ShapeError, match=r"content\[0\]\.words"):
        check({"type": "conversation.item.retrieved", "event_id": "e", "item": nested})
    with pytest.raises(ShapeError):  # an event_id is required on this one
        check({"type": "conversation.item.retrieved", "item": item})
    check({"type": "duplex.turn.metrics", "anything": 1})  # duplex's own: named so, exempt
    assert "input_audio_buffer.dtmf_event_received" in MODELS and "conversation.item.deleted" in MODELS


# -- tools: declared through the session, calls and results as items --


class ToolConversation:
    """What `ToolCalls` needs of a conversation: the tools it shows, results it takes."""

    def __init__(self) -> None:
        self.tools: tuple = ()
        self.results: list[tuple[str, str]] = []
        self.pending: list = []

    def set_tools(self, tools: tuple) -> None:
        self.tools = tools

    def constraint_for(self, choice: object) -> None:
        return None  # (no LLM: nothing to compile ahead)

    def add_result(self, call_id: str, output: str) -> None:
        from models.tools import ToolError

        if call_id != "call_1":
            raise ToolError(f"no call {call_id!r} in this conversation", "invalid_call_id")
        self.results.append((call_id, output))
        self.pending.append(call_id)


class ToolPort:
    def __init__(self) -> None:
        from duplex.tool_calls import ToolCalls

        self.conversation = ToolConversation()
        self.tools = ToolCalls(cast(Any, self.conversation))


def update(session: dict[str, Any]) -> str:
    return json.dumps({"type": "session.update", "session": session})


async def test_tools_are_declared_all_or_nothing_and_reported_in_the_session():
    c, _ = connection()
    port = ToolPort()
    c.session = cast(Any, port)
    c.apply_turn_detection = lambda: None  # type: ignore[method-assign]
    await c.handle(update({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}))
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    bad: list[dict[str, Any]] = [
        {"tools": [WEATHER, {**WEATHER, "name": "<|im_end|>"}], "instructions": "changed"},
        {"tools": [{**WEATHER, "parameters": {"properties": {"city": {"type": 7}}}}]},
        {"tools": [{**WEATHER, "parameters": deep}]},
        {"tools": [{**WEATHER, "name": f"t{i}"} for i in range(1000)]},
        {"tool_choice": {"type": "function", "name": "launch"}},
        {"tool_choice": "sometimes"},
    ]
    for session in bad:
        await c.handle(update(session))
    events = [check(e) for e in sent(c)]
    updated = [e["session"] for e in events if e["type"] == "session.updated"]
    assert len(updated) == 1
    assert updated[0]["tools"] == [WEATHER]
    assert updated[0]["tool_choice"] == {"type": "function", "name": "get_weather"}
    errors = [(e["error"]["code"], e["error"]["param"]) for e in events if e["type"] == "error"]
    assert (
        errors
        == [("invalid_tool", "session.tools")] * 4 + [("invalid_tool_choice", "session.tool_choice")] * 2
    )
    assert [t.name for t in port.conversation.tools] == ["get_weather"]  # nothing of the bad ones
    assert c.config.instructions == ""  # the update with a bad tool changed nothing else either
    await c.handle(update({"tools": []}))  # the named tool is gone: the choice is auto again
    (last,) = [check(e)["session"] for e in sent(c) if e["type"] == "session.updated"]
    assert last["tools"] == [] and last["tool_choice"] == "auto"


async def test_a_call_is_a_function_call_item_and_its_output_an_item_the_client_creates():
    c, wire = connection()
    port = ToolPort()
    c.session = cast(Any, port)
    call = {"response_id": "resp_1", "item_id": "item_1", "call_id": "call_1", "call_index": 0}
    for event in [
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_1", "item_id": "item_1"}),
        Event(ev.TEXT_DELTA, {"response_id": "resp_1", "delta": "Let me look."}),
        Event(ev.CALL_ADDED, {**call, "name": "get_weather"}),
        Event(ev.CALL_DELTA, {**call, "delta": '{"city": "Paris"}'}),
        Event(ev.CALL_DONE, {**call, "name": "get_weather", "arguments": '{"city": "Paris"}'}),
        Event(ev.RESPONSE_DONE, {"response_id": "resp_1", "status": "completed"}),
    ]:
        wire.event(event)
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'}
    for item in [
        output,
        {**output, "call_id": "call_9"},  # never made
        {**output, "call_id": "call_1", "output": "x" * 20_000},  # too long
        {**output, "output": 7},
        {"type": "function_call", "name": "get_weather", "arguments": "{}"},  # the client's own call
    ]:
        await c.handle(json.dumps({"type": "conversation.item.create", "item": item}))
    events = [check(e) for e in sent(c)]
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert (done["name"], done["arguments"], done["output_index"]) == ("get_weather", '{"city": "Paris"}', 1)
    (response,) = [e["response"] for e in events if e["type"] == "response.done"]
    assert [o["type"] for o in response["output"]] == ["message", "function_call"]
    assert response["output"][1]["call_id"] == "call_1" and response["output"][1]["status"] == "completed"
    created = [e["item"] for e in events if e["type"] == "conversation.item.done"]
    assert created[-1]["type"] == "function_call_output" and created[-1]["output"] == '{"temp_c": 21}'
    assert port.conversation.results == [("call_1", '{"temp_c": 21}')]
    assert port.tools.waiting
    errors = [(e["error"]["code"], e["error"]["param"]) for e in events if e["type"] == "error"]
    assert errors == [
        ("invalid_call_id", "item.call_id"),
        ("tool_output_too_large", "item.output"),
        ("invalid_tool_output", "item.output"),
        ("unsupported", "item.type"),
    ]
    (call_item,) = [i for i in created if i["type"] == "function_call"]
    assert call_item["arguments"] == '{"city": "Paris"}'
    await c.handle(json.dumps({"type": "conversation.item.retrieve", "item_id": call_item["id"]}))
    (retrieved,) = [check(e) for e in sent(c)]
    assert retrieved["item"] == call_item


# -- what a deleted item takes out of the session --


class Forgetting:
    """A session port that records what it is told to forget (and takes text turns)."""

    def __init__(self) -> None:
        self.forgotten: list[tuple[str | None, str | None, bool]] = []
        self.turns: list[str] = []

    def add_turn(self, text: str) -> None:
        self.turns.append(text)

    async def forget(
        self, response_id: str | None, user_text: str | None = None, reply: bool = False
    ) -> None:
        self.forgotten.append((response_id, user_text, reply))


def text_item(text: str, item_id: str) -> str:
    item = {
        "id": item_id,
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    return json.dumps({"type": "conversation.item.create", "item": item})


async def test_a_deleted_item_names_its_words_and_turn_and_unknown_ones_get_the_apis_error():
    c, wire = connection()
    port = Forgetting()
    c.session = cast(Any, port)
    await c.handle(text_item("  My name is Zed. ", "item_a"))
    wire.event(Event(ev.SPEECH_STOPPED, {"item_id": "item_b", "audio_end_ms": 900}))
    await c.handle(json.dumps({"type": "conversation.item.delete", "item_id": "item_b"}))  # not heard yet
    wire.event(Event(ev.TRANSCRIPT_DONE, {"item_id": "item_b", "transcript": "Hello."}))
    wire.event(Event(ev.RESPONSE_CREATED, {"response_id": "resp_1", "item_id": "item_1"}))  # answers a, b
    wire.event(Event(ev.RESPONSE_DONE, {"response_id": "resp_1", "status": "completed"}))
    await c.handle(text_item("Later.", "item_c"))  # waits for response.create
    for item_id in ["item_c", "item_a", "item_1", "item_b", "item_a", "item_zz"]:
        await c.handle(json.dumps({"type": "conversation.item.delete", "item_id": item_id}))
    await c.handle(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_1"}))
    await c.handle(json.dumps({"type": "conversation.item.delete"}))
    assert port.forgotten == [
        (None, "Later.", False),  # still waiting: it leaves the session's unanswered input
        ("resp_1", "My name is Zed.", False),  # as the session took it (stripped)
        ("resp_1", None, True),
        ("resp_1", "Hello.", False),
    ]
    events = [check(e) for e in sent(c)]
    deleted = [e["item_id"] for e in events if e["type"] == "conversation.item.deleted"]
    assert deleted == ["item_c", "item_a", "item_1", "item_b"]
    errors = [(e["error"]["code"], e["error"]["param"]) for e in events if e["type"] == "error"]
    assert errors == [
        ("item_delete_in_progress", "item_id"),  # its transcript had not come yet
        ("item_delete_invalid_item_id", "item_id"),  # deleted already
        ("item_delete_invalid_item_id", "item_id"),  # never was
        ("item_retrieve_invalid_item_id", "item_id"),
        ("missing_required_parameter", "item_id"),
    ]
    assert not c._items and not c._texts and not c._turn_of and not c._waiting
    assert c._unanswered == 1  # item_c's taken back; item_a's counted until a response.create (a bound)


async def test_a_retrieved_item_is_the_item_as_the_client_was_told_it():
    c, wire = connection()
    for event in A_TURN:
        wire.event(event)
    told = [e for e in sent(c) if e["type"] == "conversation.item.done"]
    for item in (t["item"] for t in told):
        await c.handle(json.dumps({"type": "conversation.item.retrieve", "item_id": item["id"]}))
    retrieved = [check(e) for e in sent(c)]
    assert [e["type"] for e in retrieved] == ["conversation.item.retrieved"] * len(told)
    assert [e["item"] for e in retrieved] == [t["item"] for t in told]
    assert retrieved[0]["item"]["content"] == [{"type": "input_audio", "transcript": "Hello."}]


class Channel:
    """The ``events`` data channel of a peer connection: what was sent on it."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, message: str) -> None:
        self.sent.append(message)


def test_the_webrtc_data_channel_sends_the_same_shapes_and_duplex_names_its_own():
    channel = Channel()
    wire = PeerWire(cast(Any, channel))
    words = [{"word": "Hello.", "start_ms": 120, "end_ms": 560}]
    timed = Event(ev.TRANSCRIPT_DONE, {"item_id": "item_3", "transcript": "Hello.", "words": words})
    for event in [*A_TURN, Event(ev.METRICS, {"response_id": "resp_1", "voice_to_voice_ms": 500}), timed]:
        assert wire.event(event) == []
    events = [check(m) for m in channel.sent]
    kinds = [e["type"] for e in events]
    assert "response.output_item.added" in kinds and "input_audio_buffer.dtmf_event_received" in kinds
    assert [k for k in kinds if k.startswith("duplex.")] == [
        "duplex.item.heard",
        "duplex.state",
        "duplex.turn.metrics",
        "duplex.item.words",
    ]
    (heard,) = [e for e in events if e["type"] == "duplex.item.heard"]
    assert heard == {"type": "duplex.item.heard", "item_id": "item_1", "transcript": "Hi"}
    assert events[-1] == {"type": "duplex.item.words", "item_id": "item_3", "words": words}
