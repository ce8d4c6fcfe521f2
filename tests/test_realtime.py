"""``WS /v1/realtime`` with the official ``openai`` SDK's realtime client pointed at a
local server (base URL on 127.0.0.1, a dummy key) and the real models."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from audio_io.g711 import ulaw_decode, ulaw_encode
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from duplex.config import Config
from duplex.health import Readiness
from duplex.http_app import build_http_app
from duplex.sessions import Sessions
from duplex.transports.realtime import RealtimeEndpoint
from models.speech_set import wer
from tests.conftest import speech

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

QUESTION = "What is the largest ocean on Earth?"


@pytest_asyncio.fixture(loop_scope="session")
async def served(engines):
    config = Config(max_sessions=4)
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    app = build_http_app(config, Readiness(["llm"]))
    RealtimeEndpoint(config, sessions).routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="dummy", max_retries=0), sessions
    await sessions.close_all()
    await server.close()


async def events_until(conn: Any, kind: str, count: int = 1, within: float = 60, **fields: Any) -> list[Any]:
    """Events read until ``count`` of type ``kind`` (with these field values) came."""
    seen: list[Any] = []
    async with asyncio.timeout(within):
        async for event in conn:
            seen.append(event)
            matching = [
                e for e in seen if e.type == kind and all(getattr(e, k) == v for k, v in fields.items())
            ]
            if len(matching) >= count:
                return seen
    return seen


async def closed(sessions: Sessions) -> None:
    """The client closed the socket: its session ends (soon: the close handshake)."""
    async with asyncio.timeout(5):
        while len(sessions):  # noqa: ASYNC110 (the server under test has no event for this)
            await asyncio.sleep(0.05)


def pcm24(samples_16k: np.ndarray) -> bytes:
    return resample(samples_16k, RUNTIME_RATE, 24000).astype("<i2").tobytes()


async def events_for(conn: Any, seconds: float) -> list[Any]:
    """Every event that comes within ``seconds``."""
    seen: list[Any] = []
    try:
        async with asyncio.timeout(seconds):
            async for event in conn:
                seen.append(event)
    except TimeoutError:
        pass
    return seen


async def ask_in_text(conn: Any, text: str) -> None:
    """A user text item, then ``response.create``."""
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await conn.conversation.item.create(item=item)
    await conn.response.create()


async def talk(conn: Any, audio: bytes, seconds_of_silence: float = 1.5, ulaw: bool = False) -> None:
    """Append audio (PCM16 24 kHz, or μ-law 8 kHz) in 100 ms chunks in real time, then silence."""
    audio += (b"\xff" if ulaw else b"\x00\x00") * int(seconds_of_silence * (8000 if ulaw else 24000))
    chunk = 800 if ulaw else 4800  # 100 ms
    for i in range(0, len(audio), chunk):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + chunk]).decode())
        await asyncio.sleep(0.1)


async def test_a_spoken_question_gets_a_spoken_reply_with_transcripts(served, tts_engine, asr_engine):
    client, sessions = served
    async with client.realtime.connect(model="duplex") as conn:
        first = await conn.recv()
        assert first.type == "session.created" and first.session.audio.input.format.type == "audio/pcm"
        await conn.session.update(
            session={"type": "realtime", "instructions": "Answer in one short sentence."}
        )
        talking = asyncio.create_task(talk(conn, pcm24(speech(tts_engine, QUESTION))))
        seen = await events_until(conn, "response.done")
        await talking
    kinds = [e.type for e in seen]
    for kind in [
        "session.updated",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed",
        "response.created",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio_transcript.done",
    ]:
        assert kind in kinds, kind
    (final,) = [e for e in seen if e.type == "conversation.item.input_audio_transcription.completed"]
    assert wer([(QUESTION, final.transcript)]) <= 0.2
    (done,) = [e for e in seen if e.type == "response.done"]
    assert done.response.status == "completed"
    transcript = done.response.output[0].content[0].transcript
    assert "Pacific" in transcript
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
    samples = np.frombuffer(audio, "<i2").astype(np.int16)
    assert samples.size / 24000 >= 1.0
    assert wer([(transcript, asr_engine.transcribe(resample(samples, 24000, RUNTIME_RATE)))]) <= 0.3
    await closed(sessions)


async def test_text_in_audio_out_and_a_truncate_reaches_the_next_reply(served):
    client, sessions = served
    async with client.realtime.connect(model="duplex") as conn:
        await conn.recv()
        await ask_in_text(conn, "Tell me a long story about a dragon.")
        seen = await events_until(conn, "response.output_audio.delta", count=50)  # 1 s of it
        item_id = next(e.item_id for e in seen if e.type == "response.output_audio.delta")
        await conn.response.cancel()
        seen += await events_until(conn, "response.done")
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=600)
        seen += await events_until(conn, "conversation.item.truncated", audio_end_ms=600)
        (session,) = sessions._open
        heard = session.conversation.turns[-1].reply_text  # what the next reply is built on
        # clamped, not refused, past the end of what was sent (clients race here)
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=10**7)
        after = await events_until(conn, "conversation.item.truncated")
    done = [e for e in seen if e.type == "response.done"][-1]
    assert done.response.status == "cancelled"
    generated = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    assert heard and generated.startswith(heard) and len(heard) < len(generated)
    (clamped,) = [e for e in after if e.type == "conversation.item.truncated"]
    assert 1000 <= clamped.audio_end_ms < 10**7


async def test_bad_events_get_error_events_and_the_socket_stays_open(served):
    client, sessions = served
    async with (
        client.realtime.connect(model="duplex") as conn,
        client.realtime.connect(model="duplex") as other,
    ):
        await conn.recv()
        await other.recv()
        await ask_in_text(other, "Tell me a short story about a cat.")
        append = "input_audio_buffer.append"
        bad = [
            ("{not json", "invalid_json"),
            ({"type": "session.teleport"}, "invalid_value"),
            ({"type": append}, "missing_required_parameter"),
            ({"type": append, "audio": "@@@"}, "invalid_base64"),
            ({"type": append, "audio": base64.b64encode(b"abc").decode()}, "invalid_value"),  # half a sample
            ({"type": append, "audio": "A" * (22 * 1024 * 1024)}, "audio_too_large"),  # 16.5 MB of audio
            (
                {
                    "type": "conversation.item.truncate",
                    "item_id": "nope",
                    "content_index": 0,
                    "audio_end_ms": 5,
                },
                "item_not_found",
            ),
            (
                {"type": "session.update", "session": {"type": "realtime", "voice_of": "x"}},
                "unknown_parameter",
            ),
            ({"type": "response.create"}, "no_input"),
            (  # a list where a string belongs: once a traceback, the socket closed, later events lost
                {"type": "session.update", "session": {"audio": {"input": {"format": {"type": []}}}}},
                "invalid_value",
            ),
        ]
        codes = []
        for message, _ in bad:
            await conn.send_raw(message if isinstance(message, str) else json.dumps(message))
            event = await conn.recv()
            assert event.type == "error", event
            codes.append(event.error.code)
        assert codes == [code for _, code in bad]
        await conn.session.update(session={"type": "realtime", "instructions": "Still here."})
        assert (await conn.recv()).type == "session.updated"
        beside = await events_until(other, "response.done")  # the other session was not disturbed
    assert not [e for e in beside if e.type == "error"]
    assert [e for e in beside if e.type == "response.done"][0].response.status == "completed"
    assert sum(e.type == "response.output_audio.delta" for e in beside) >= 50
    await closed(sessions)


async def test_manual_turns_commit_then_response_create(served, tts_engine):
    client, sessions = served
    async with client.realtime.connect(model="duplex") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        assert (await conn.recv()).session.audio.input.turn_detection is None
        await conn.input_audio_buffer.commit()  # nothing appended yet
        assert (await conn.recv()).error.code == "input_audio_buffer_commit_empty"
        audio = pcm24(speech(tts_engine, QUESTION))
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio).decode())
        await asyncio.sleep(1.0)  # no VAD: nothing happens until the commit
        await conn.input_audio_buffer.commit()
        seen = await events_until(conn, "conversation.item.input_audio_transcription.completed")
        assert not [e for e in seen if e.type.startswith("response.")]
        await conn.response.create()
        seen += await events_until(conn, "response.done")
    kinds = [e.type for e in seen]
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    (final,) = [e for e in seen if e.type == "conversation.item.input_audio_transcription.completed"]
    assert wer([(QUESTION, final.transcript)]) <= 0.2
    assert [e for e in seen if e.type == "response.done"][0].response.status == "completed"
    assert any(e.type == "response.output_audio.delta" for e in seen)


async def test_mulaw_audio_and_turns_held_for_response_create(served, tts_engine, asr_engine):
    client, sessions = served
    vad = {"type": "server_vad", "create_response": False, "threshold": 0.6, "prefix_padding_ms": 200}
    async with client.realtime.connect(model="duplex") as conn:
        await conn.recv()
        ulaw = {"type": "audio/pcmu"}
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"format": ulaw, "turn_detection": vad}, "output": {"format": ulaw}},
            }
        )
        updated = await conn.recv()
        assert updated.session.audio.output.format.type == "audio/pcmu"
        assert updated.session.audio.input.turn_detection.create_response is False
        (session,) = sessions._open
        assert session.config.vad_threshold == 0.6 and session.config.speech_prefix_ms == 200
        question = ulaw_encode(resample(speech(tts_engine, QUESTION), RUNTIME_RATE, 8000)).tobytes()
        await talk(conn, question, ulaw=True)
        seen = await events_until(conn, "conversation.item.input_audio_transcription.completed")
        seen += await events_for(conn, 1.5)
        assert not [e for e in seen if e.type.startswith("response.")]  # held for response.create
        await conn.response.create()
        seen += await events_until(conn, "response.done")
    (final,) = [e for e in seen if e.type == "conversation.item.input_audio_transcription.completed"]
    assert wer([(QUESTION, final.transcript)]) <= 0.2
    (done,) = [e for e in seen if e.type == "response.done"]
    transcript = done.response.output[0].content[0].transcript
    assert done.response.status == "completed" and "Pacific" in transcript
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
    samples = resample(ulaw_decode(audio), 8000, RUNTIME_RATE)
    assert samples.size / RUNTIME_RATE >= 1.0
    assert wer([(transcript, asr_engine.transcribe(samples))]) <= 0.3
    await closed(sessions)


async def test_without_interrupt_response_the_reply_plays_on_and_the_caller_is_answered_after(
    served, tts_engine
):
    client, sessions = served
    vad = {"type": "server_vad", "interrupt_response": False}
    async with client.realtime.connect(model="duplex") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": vad}}})
        await conn.recv()
        await ask_in_text(conn, "Tell me a short story about a cat.")
        seen = await events_until(conn, "response.output_audio.delta", count=25)  # 0.5 s of it
        talking = asyncio.create_task(talk(conn, pcm24(speech(tts_engine, QUESTION)), 6.0))
        seen += await events_until(conn, "response.done", count=2, within=90)
        talking.cancel()
    kinds = [e.type for e in seen]
    assert "input_audio_buffer.speech_started" in kinds
    first, second = [e for e in seen if e.type == "response.done"]
    assert first.response.status == second.response.status == "completed"
    assert "conversation.item.truncated" not in kinds
    heard = kinds.index("conversation.item.input_audio_transcription.completed")
    assert (
        heard < kinds.index("response.done") < [i for i, k in enumerate(kinds) if k == "response.created"][1]
    )
    assert "Pacific" in second.response.output[0].content[0].transcript
    await closed(sessions)
