"""The Realtime API's session object: what session.update may set, all or nothing."""

from __future__ import annotations

import pytest

from duplex.transports.realtime_config import RealtimeError, RealtimeSessionConfig


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
