"""The Realtime API without a socket: the session object (what session.update may set,
all or nothing), how a client event is read (`_parse`), the pace of a client's events,
and the bounds on what one connection remembers."""

from __future__ import annotations

from typing import Any, cast

import pytest

from duplex import events as ev
from duplex.events import Event
from duplex.transports import realtime
from duplex.transports.realtime import Pace, RealtimeConnection, RealtimeWire
from duplex.transports.realtime_config import MAX_ECHO_DEPTH, RealtimeError, RealtimeSessionConfig


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
    assert out["instructions"] == "Be kind." and out["id"] == "sess_1" and out["object"] == "realtime.session"
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
        ({"tools": [{"type": "function", "name": "f"}]}, "unsupported", "session.tools"),
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
