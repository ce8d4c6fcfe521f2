"""`duplex.v1.Duplex.Converse` with the real models: the Python client, exact
truncation from PlaybackAck, and bad input answered with the right status."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import grpc
import numpy as np
import pytest
import pytest_asyncio
from google.protobuf.message import DecodeError
from grpc._cython.cygrpc import ExecuteBatchError
from grpc.aio import AbortError

from audio_io._proto import duplex_pb2 as pb
from audio_io._proto import duplex_pb2_grpc as pb_grpc
from audio_io.wav import read_wav, write_wav
from benchmarks.caller import heard_by_marks
from benchmarks.speech_set import wer
from duplex.config import Config
from duplex.grpc_client import Conversation, DuplexClient
from duplex.sessions import Sessions
from duplex.transports.grpc_server import GrpcListener
from duplex.transports.grpc_stream import StreamEnd, send_status
from tests.conftest import REPO, duplex_command, speech
from tests.hostile import run_cases, until

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

E2E = REPO / "tests" / "e2e"
QUESTION = "What is the capital city of France?"
FRAME = 320  # 20 ms at 16 kHz
Kind = pb.TurnEvent


@pytest_asyncio.fixture(loop_scope="session")
async def served(engines):
    config = Config(grpc_port=0, max_sessions=8, session_idle_timeout_s=20)
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    listener = GrpcListener(config, sessions)
    await listener.start()
    yield f"127.0.0.1:{listener.port}", sessions
    await sessions.close_all()
    await listener.stop(grace=1)


class Caller:
    """Streams audio in real time (silence after it) and keeps what comes back."""

    def __init__(self, conversation: Conversation, talk: bool = True) -> None:
        self.conversation = conversation
        self.events: list[pb.ServerEvent] = []
        self._queue: list[np.ndarray] = []
        self._sending = asyncio.create_task(self._send()) if talk else None

    def say(self, audio: np.ndarray) -> None:
        self._queue += [audio[i : i + FRAME] for i in range(0, audio.size, FRAME)]

    async def _send(self) -> None:
        start, k = time.monotonic(), 0
        while True:
            chunk = self._queue.pop(0) if self._queue else np.zeros(FRAME, np.int16)
            k += 1
            await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))
            await self.conversation.send_audio(chunk.astype("<i2").tobytes())

    async def until(self, kind: int, count: int = 1, within: float = 60.0) -> None:
        async with asyncio.timeout(within):
            async for event in self.conversation:
                self.events.append(event)
                if len(self.turns(kind)) >= count:
                    return

    async def hang_up(self) -> tuple[grpc.StatusCode, str]:
        """Stop talking, half-close, read to the end."""
        if self._sending is not None:
            self._sending.cancel()
            await asyncio.gather(self._sending, return_exceptions=True)
        await self.conversation.close()
        async for event in self.conversation:
            self.events.append(event)
        return await self.conversation.status()

    def turns(self, kind: int) -> list[pb.TurnEvent]:
        return [e.turn for e in self.events if e.HasField("turn") and e.turn.kind == kind]

    def of(self, field: str) -> list:
        return [getattr(e, field) for e in self.events if e.HasField(field)]


async def test_a_spoken_question_gets_a_spoken_reply(served, tts_engine):
    target, sessions = served
    async with DuplexClient(target) as client:
        # 2.5 s of silence ends the turn without the LLM's judgement: room for the aligned
        # final and the score on any machine (on 2 AVX2 cores they came after 500 ms; on a
        # loaded CI machine the final came 1,081 ms after the last word, too late to be judged
        # under 1 s); how much sooner a turn ends by meaning is measured by the bench
        turn_taking = pb.TurnTaking(end_of_turn_ms=2500)
        conversation = await client.converse(word_times=True, turn_taking=turn_taking)
        assert conversation.started.api_version == 1 and conversation.started.session_id
        assert conversation.started.output_format.sample_rate == tts_engine.sample_rate
        caller = Caller(conversation)
        question = speech(tts_engine, QUESTION)
        caller.say(question)
        await caller.until(Kind.RESPONSE_DONE)
        status, _ = await caller.hang_up()
    assert status == grpc.StatusCode.OK
    (final,) = [t for t in caller.of("transcript") if t.final]
    assert wer([(QUESTION, final.text)]) <= 0.2
    # word times: every word, in order, inside the question's audio (sent from 0 ms) and
    # the silence the final pass hears after it (Whisper stretches the last word into it)
    assert " ".join(w.text for w in final.words) == final.text
    ends = [0] + [t for w in final.words for t in (w.start_ms, w.end_ms)]
    assert ends == sorted(ends) and ends[-1] <= len(question) / 16 + 500
    assert final.words[-1].end_ms >= len(question) / 16 * 0.6
    assert "Paris" in "".join(t.delta for t in caller.of("text"))
    audio = caller.of("audio")
    assert [a.sequence for a in audio] == list(range(len(audio)))
    assert sum(len(a.data) for a in audio) / 2 / tts_engine.sample_rate >= 1.0
    (metrics,) = caller.of("metrics")
    assert metrics.voice_to_voice_ms > 0 and "llm_first_token_ms" in metrics.steps_ms
    assert 0 <= metrics.cached_tokens < metrics.prompt_tokens
    # the turn ended by meaning: the LLM's score and the silence it waited come along
    assert metrics.HasField("end_of_turn_score") and metrics.end_of_turn_score >= 0.3
    assert 300 <= metrics.steps_ms["silence_waited_ms"] < 2500
    kinds = [t.kind for t in caller.of("turn")]
    assert kinds == [Kind.SPEECH_STARTED, Kind.SPEECH_STOPPED, Kind.RESPONSE_STARTED, Kind.RESPONSE_DONE]
    assert len(sessions) == 0


async def test_barge_in_truncates_to_what_the_client_says_it_played(served, tts_engine):
    target, sessions = served
    rate = tts_engine.sample_rate
    async with DuplexClient(target) as client:
        conversation = await client.converse(playback_acks=True)
        (session,) = sessions._open
        caller = Caller(conversation)
        caller.say(speech(tts_engine, "Please tell me a long story about a brave little dragon."))
        received, acked = 0, 0
        async with asyncio.timeout(60):
            async for event in conversation:
                caller.events.append(event)
                if event.HasField("audio"):
                    received += len(event.audio.data) // 2
                    acked = max(0, received - rate // 4)  # a 250 ms playout buffer behind what came
                    await conversation.ack(acked)
                if received >= int(1.5 * rate):
                    break
        response_id = caller.of("audio")[0].response_id
        caller.say(speech(tts_engine, "Stop please. What is two plus two?"))
        await caller.until(Kind.INTERRUPTED)
        turn = session.ledger.turn(response_id)
        marks = [(m.char_start, m.char_end, m.sample_start, m.sample_end) for m in turn.marks]
        await caller.until(Kind.RESPONSE_DONE, count=2)
        await caller.hang_up()
    (cut,) = caller.turns(Kind.INTERRUPTED)
    assert cut.heard_text == heard_by_marks(turn.text, marks, turn.played) and cut.heard_text
    # the server went by the acks, not by what it sent: the last ack before the cut
    assert turn.played <= acked and received - turn.played >= rate // 4
    assert cut.audio_ms == turn.played * 1000 // rate


async def raw_call(
    target: str, *messages: pb.ClientEvent, limit: int = 16 << 20
) -> tuple[grpc.StatusCode, str]:
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        call = pb_grpc.DuplexStub(channel).Converse()
        try:
            for message in messages:
                await call.write(message)
            await call.done_writing()
            async for _ in call:
                pass
        except grpc.aio.AioRpcError:
            pass  # the server ended the call: its status says why
        return await call.code(), await call.details()


def config_event(encoding: pb.AudioEncoding = pb.PCM16, rate: int = 16000, **fields) -> pb.ClientEvent:
    fmt = pb.AudioFormat(encoding=encoding, sample_rate=rate)
    return pb.ClientEvent(config=pb.SessionConfig(input_format=fmt, **fields))


async def test_bad_streams_end_with_the_right_status(served):
    target, sessions = served
    audio = pb.ClientEvent(audio=pb.AudioChunk(data=b"\x00\x00" * 320))
    cases = [
        ((audio,), grpc.StatusCode.INVALID_ARGUMENT, "first message must be a SessionConfig"),
        ((config_event(rate=44100),), grpc.StatusCode.INVALID_ARGUMENT, "PCM16 takes sample rates"),
        ((config_event(pb.MULAW, 16000),), grpc.StatusCode.INVALID_ARGUMENT, "8000 Hz only"),
        ((config_event(pb.AUDIO_ENCODING_UNSPECIFIED),), grpc.StatusCode.INVALID_ARGUMENT, "no encoding"),
        ((config_event(voice="someone-else"),), grpc.StatusCode.INVALID_ARGUMENT, "unknown voice"),
        (
            (config_event(turn_taking=pb.TurnTaking(end_of_turn_ms=5)),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "end_of_turn_ms",
        ),
        (
            (config_event(turn_taking=pb.TurnTaking(complete_turn_threshold=1.5)),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "complete_turn_threshold",
        ),
        (
            (config_event(), pb.ClientEvent(audio=pb.AudioChunk(data=b"\x00" * 641))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "whole 2-byte samples",
        ),
        ((config_event(tools=[pb.Tool(name="<|im_end|>")]),), grpc.StatusCode.INVALID_ARGUMENT, "tool name"),
        (
            (config_event(tools=[pb.Tool(name="get_weather", parameters_json="{not json")]),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "get_weather: parameters_json is not JSON",
        ),
        (
            (config_event(tools=[pb.Tool(name=f"t{i}") for i in range(1000)]),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "1000 tools",
        ),
        (
            (config_event(tool_choice=pb.ToolChoice(mode=pb.ToolChoice.FUNCTION, name="launch")),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a declared tool",
        ),
        ((config_event(), config_event()), grpc.StatusCode.INVALID_ARGUMENT, "only first"),
        ((config_event(), pb.ClientEvent()), grpc.StatusCode.INVALID_ARGUMENT, "empty ClientEvent"),
        (
            (config_event(), pb.ClientEvent(audio=pb.AudioChunk(data=b"\x00" * (10 << 20)))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
    ]
    for messages, code, words in cases:
        got, details = await raw_call(target, *messages)
        assert got == code and words in details, (messages[-1].WhichOneof("event"), got, details)
    await asyncio.sleep(0.2)
    assert len(sessions) == 0


async def test_audio_after_cancel_and_a_half_close_mid_turn(served, tts_engine):
    target, sessions = served
    async with DuplexClient(target) as client:
        conversation = await client.converse(
            input_format=pb.AudioFormat(encoding=pb.MULAW, sample_rate=8000),
            output_format=pb.AudioFormat(encoding=pb.PCM16, sample_rate=8000),
        )
        await conversation.say("Tell me a long story about a cat.")
        async with asyncio.timeout(30):
            async for event in conversation:
                if event.HasField("audio"):
                    break
        await conversation.cancel()
        from audio_io.g711 import ulaw_encode
        from audio_io.resample import resample

        question = ulaw_encode(resample(speech(tts_engine, QUESTION), 16000, 8000)).tobytes()
        caller = Caller(conversation, talk=False)  # this one sends mu-law itself
        for i in range(0, len(question), 160):
            await conversation.send_audio(question[i : i + 160])
            await asyncio.sleep(0.02)
        for _ in range(40):  # trailing silence, then the client half-closes mid-turn
            await conversation.send_audio(b"\xff" * 160)
            await asyncio.sleep(0.02)
        await conversation.close()
        async for event in conversation:
            caller.events.append(event)
        status, _ = await conversation.status()
    assert status == grpc.StatusCode.OK
    done = caller.turns(Kind.RESPONSE_DONE)
    assert [d.status for d in done][-1] == "completed"  # the reply to the question played out
    assert "Paris" in "".join(t.delta for t in caller.of("text"))
    assert all(len(a.data) == 320 for a in caller.of("audio"))  # 20 ms of PCM16 at 8 kHz
    assert len(sessions) == 0


async def until_no_session(sessions: Sessions, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while len(sessions):
        assert time.monotonic() < deadline, f"{len(sessions)} sessions left"
        await asyncio.sleep(0.05)


async def test_vanished_and_dropped_clients_leave_nothing_behind(served, tts_engine):
    target, sessions = served
    client = DuplexClient(target)
    conversation = await client.converse()
    await conversation.say("Tell me a long story about a cat.")
    replying = False
    async with asyncio.timeout(30):
        async for event in conversation:
            if event.HasField("audio"):
                replying = True
                break
    assert replying, "the stream ended before the reply's audio"
    # its session is open, mid-reply, as the client vanishes
    assert [s.id for s in sessions._open] == [conversation.started.session_id]
    await client.close()  # gone, mid-reply, without a word
    await until_no_session(sessions)

    async def open_and_drop() -> pb.SessionStarted | tuple[grpc.StatusCode, str]:
        """The session's first event, SessionStarted, then gone without a word; or the
        status of a call refused a session."""
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.DuplexStub(channel).Converse()
            await call.write(config_event())
            try:
                first = await asyncio.wait_for(call.read(), 30)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
            if first is grpc.aio.EOF:
                return await call.code(), await call.details()
            await asyncio.sleep(0.05)
            call.cancel()
            return first.started

    outcomes = await asyncio.gather(*(open_and_drop() for _ in range(200)))
    started = [o for o in outcomes if isinstance(o, pb.SessionStarted)]
    refused = {o for o in outcomes if not isinstance(o, pb.SessionStarted)}
    # each was either refused for want of room, or got its own session...
    too_many = (grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_sessions")
    assert all(code == too_many[0] and details.startswith(too_many[1]) for code, details in refused), refused
    assert len({s.session_id for s in started}) == len(started) and all(s.session_id for s in started)
    # ...and the server was full at least once (a refusal means max_sessions places were
    # taken, by streams that each go on to open a session), or all 200 got one
    assert len(started) >= sessions.max_sessions, f"{len(started)} sessions opened"
    await until_no_session(sessions)
    assert sessions._held == 0
    async with DuplexClient(target) as client:  # and the server still serves
        conversation = await client.converse()
        await conversation.say("Say hi.")
        caller = Caller(conversation)
        await caller.until(Kind.RESPONSE_DONE)
        await caller.hang_up()


async def test_a_node_grpc_js_client_has_the_same_conversation(served, tts_engine, tmp_path):
    target, _ = served
    pcm = tmp_path / "question.pcm"
    pcm.write_bytes(speech(tts_engine, QUESTION).astype("<i2").tobytes())
    node = await asyncio.create_subprocess_exec(
        "node",
        str(E2E / "converse.mjs"),
        target,
        str(pcm),
        str(REPO / "proto" / "duplex.proto"),
        cwd=E2E,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(node.communicate(), 120)
    assert node.returncode == 0, err.decode()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["status"]["code"] == 0 and summary["started"]["api_version"] == 1
    assert wer([(QUESTION, summary["transcripts"][0])]) <= 0.2
    assert "Paris" in summary["text"] and not summary["errors"]
    assert summary["audioBytes"] / 2 / tts_engine.sample_rate >= 1.0
    assert summary["sequences"] == list(range(len(summary["sequences"])))
    assert summary["metrics"][0]["voice_to_voice_ms"] > 0
    assert summary["turns"] == ["SPEECH_STARTED", "SPEECH_STOPPED", "RESPONSE_STARTED", "RESPONSE_DONE"]


async def test_tools_with_a_client_generated_from_the_proto(served, tts_engine, tmp_path):
    """The assistant calls the client's function over gRPC: a client whose stubs the test
    generates from proto/duplex.proto (tests/e2e/tool_client.py) declares get_weather with
    the named choice, speaks the question, answers the ToolCall; the reply that follows
    begins by itself once the call has its result, and uses it."""
    from grpc_tools import protoc

    target, _ = served
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    proto = REPO / "proto"
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{proto}",
                f"--python_out={stubs}",
                f"--grpc_python_out={stubs}",
                str(proto / "duplex.proto"),
            ]
        )
        == 0
    )
    pcm = tmp_path / "question.pcm"
    pcm.write_bytes(speech(tts_engine, "What is the weather in Paris?").astype("<i2").tobytes())
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        str(E2E / "tool_client.py"),
        target,
        str(pcm),
        str(stubs),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(client.communicate(), 150)
    assert client.returncode == 0, err.decode()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    (call,) = summary["calls"]
    assert call["name"] == "get_weather" and "paris" in call["arguments"]["city"].lower()
    assert [status for _, status in summary["done"]] == ["completed", "completed"]
    (first, _), (second, _) = summary["done"]
    assert call["response_id"] == first
    assert "<" not in summary["texts"].get(first, "")  # nothing of the call's markup as text
    assert "21" in summary["texts"][second] and not summary["errors"]


async def test_duplex_client_end_to_end(served, tts_engine, tmp_path):
    target, _ = served
    question, reply = tmp_path / "question.wav", tmp_path / "reply.wav"
    write_wav(question, speech(tts_engine, QUESTION), 16000)
    client = await asyncio.create_subprocess_exec(
        *duplex_command("client", str(question), "--target", target, "--out", str(reply), "--fast"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(client.communicate(), 120)
    assert client.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    you = next(line for line in lines if line.startswith("you: "))
    assert wer([(QUESTION, you.removeprefix("you: "))]) <= 0.2
    assert any(line.startswith("assistant: ") and "Paris" in line for line in lines)
    assert any("voice-to-voice" in line for line in lines)
    samples, rate = read_wav(reply)
    assert rate == tts_engine.sample_rate and samples.size / rate >= 1.0
    # bad input gets a clear message and a non-zero exit
    bad = await asyncio.create_subprocess_exec(
        *duplex_command("client", str(question), "--target", "127.0.0.1:1"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(bad.communicate(), 60)
    assert bad.returncode == 1 and "UNAVAILABLE" in err.decode()


async def test_converse_needs_the_token_when_one_is_set(engines):
    token = "s3cret-token"
    config = Config(grpc_port=0, auth_token=token)
    sessions = Sessions(2, 20)
    sessions.attach(engines)
    listener = GrpcListener(config, sessions)
    await listener.start()
    target = f"127.0.0.1:{listener.port}"
    try:
        assert await raw_call(target, config_event()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong token",
        )
        async with DuplexClient(target, token=token) as client:
            conversation = await client.converse()
            assert conversation.started.session_id
            await conversation.close()
            async for _ in conversation:
                pass
            assert (await conversation.status())[0] == grpc.StatusCode.OK
    finally:
        await sessions.close_all()
        await listener.stop(grace=1)


# -- hostile clients, each beside a neighbour conversation that must not notice --

STORY = "Tell me a long story about a brave little dragon."
CONVERSE = "/duplex.v1.Duplex/Converse"
NO_BDP = [("grpc.http2.bdp_probe", 0)]  # the flow-control window stays at 64 KiB
WIDE = pb.AudioFormat(encoding=pb.PCM16, sample_rate=48000)  # 96 kB of reply audio a second


@pytest_asyncio.fixture(loop_scope="session")
async def hostile(engines):
    """A listener with room for three sessions and short handshake and slow-reader timeouts."""
    config = Config(
        grpc_port=0, max_sessions=3, session_idle_timeout_s=20, handshake_timeout_s=1, slow_reader_timeout_s=1
    )
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    listener = GrpcListener(config, sessions)
    await listener.start()
    yield f"127.0.0.1:{listener.port}", sessions
    await sessions.close_all()
    await listener.stop(grace=1)


class Neighbour:
    """A well-behaved conversation beside the hostile clients: silence streamed in real
    time, a long story asked for by text whenever the last reply is done, and the time
    each chunk of reply audio arrived."""

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.audio_at: list[float] = []
        self.errors: list[pb.Error] = []
        self.done = False
        self._talking = asyncio.create_task(self._talk())
        self._listening = asyncio.create_task(self._listen())

    async def _talk(self) -> None:
        start, k = time.monotonic(), 0
        while True:
            k += 1
            await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))
            await self.conversation.send_audio(b"\x00\x00" * FRAME)

    async def _listen(self) -> None:
        await self.conversation.say(STORY)
        async for event in self.conversation:
            if event.HasField("audio"):
                self.audio_at.append(time.monotonic())
            elif event.HasField("error"):
                self.errors.append(event.error)
            elif event.HasField("turn") and event.turn.kind == Kind.RESPONSE_DONE and not self.done:
                await self.conversation.say(STORY)

    async def speaking(self, within: float = 60.0) -> None:
        """Until reply audio is arriving."""
        await until(lambda: bool(self.audio_at) and time.monotonic() - self.audio_at[-1] < 0.1, within)

    def audio_since(self, moment: float) -> int:
        return sum(1 for t in self.audio_at if t >= moment)

    async def stop(self) -> None:
        """Cancels its tasks (when a test fails midway)."""
        self._talking.cancel()
        self._listening.cancel()
        await asyncio.gather(self._talking, self._listening, return_exceptions=True)

    async def close(self) -> tuple[grpc.StatusCode, str]:
        self.done = True
        self._talking.cancel()
        await asyncio.gather(self._talking, return_exceptions=True)
        await self.conversation.cancel()
        await self.conversation.close()  # half-closed and quiet: the server ends the stream
        await asyncio.wait_for(self._listening, 30)
        return await self.conversation.status()


async def bytes_call(target: str, *messages: bytes) -> tuple[grpc.StatusCode, str]:
    """Converse with raw bytes for messages (no serializer): what a broken client sends."""
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_send_message_length", 16 << 20)]
    ) as channel:
        call = channel.stream_stream(CONVERSE)()
        try:
            for message in messages:
                await call.write(message)
            await call.done_writing()
            async for _ in call:
                pass
        except grpc.aio.AioRpcError:
            pass  # the server ended the call: its status says why
        return await call.code(), await call.details()


async def malformed_messages(target: str, sessions: Sessions) -> None:
    """Bytes that are not a ClientEvent, strings that are not UTF-8 (first or later), and
    messages over max_message_bytes: each ends its call with a status, and nothing else."""
    config = config_event().SerializeToString()
    text = pb.ClientEvent(text=pb.TextInput(text="hi there")).SerializeToString()
    not_utf8 = text.replace(b"hi there", b"hi \xff\xfe\xfdr!")
    prompt = config_event(system_prompt="hi there").SerializeToString()
    prompt_not_utf8 = prompt.replace(b"hi there", b"hi \xff\xfe\xfdr!")
    for message in (not_utf8, prompt_not_utf8):
        with pytest.raises(DecodeError):  # protobuf itself refuses the string
            pb.ClientEvent.FromString(message)
    huge_audio = pb.ClientEvent(audio=pb.AudioChunk(data=b"\x00" * (2 << 20))).SerializeToString()
    cases = [
        ((b"\xff" * 16,), grpc.StatusCode.INVALID_ARGUMENT, "malformed ClientEvent"),
        ((config, b"\xff" * 16), grpc.StatusCode.INVALID_ARGUMENT, "malformed ClientEvent"),
        ((config, not_utf8), grpc.StatusCode.INVALID_ARGUMENT, "malformed ClientEvent"),
        ((prompt_not_utf8,), grpc.StatusCode.INVALID_ARGUMENT, "malformed ClientEvent"),
        ((b"\x00" * (2 << 20),), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),  # > max_message_bytes
        ((config, huge_audio), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ]
    for messages, code, words in cases:  # one at a time: each holds a place while it lasts
        got, details = await bytes_call(target, *messages)
        assert got == code and words in details, (len(messages), got, details)


async def never_configured(target: str, sessions: Sessions) -> None:
    """Streams that never send a SessionConfig fill the server, then time out."""
    room = sessions.max_sessions - len(sessions)
    assert room == 2
    async with grpc.aio.insecure_channel(target) as channel:
        idle = [pb_grpc.DuplexStub(channel).Converse() for _ in range(room)]
        await until(lambda: sessions._held == room, 5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async with DuplexClient(target) as client:
                await client.converse()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("too_many_sessions")
        for call in idle:
            assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await call.details() == "no SessionConfig within 1 s"
    assert sessions._held == 0
    async with DuplexClient(target) as client:  # their places are free again
        conversation = await client.converse()
        await conversation.close()
        assert [e async for e in conversation] == []
        assert (await conversation.status())[0] == grpc.StatusCode.OK


async def slow_readers(target: str, sessions: Sessions) -> None:
    """Two clients ask for a story and read nothing: once the reply has filled their
    flow-control windows, both sessions are closed; the one that reads again gets the
    audio that was on its way, then RESOURCE_EXHAUSTED."""
    async with DuplexClient(target, options=NO_BDP) as one, DuplexClient(target, options=NO_BDP) as two:
        reads_again, never_reads = (
            await one.converse(output_format=WIDE),
            await two.converse(output_format=WIDE),
        )
        by_id = {s.id: s for s in sessions._open}
        stalled = [by_id[c.started.session_id] for c in (reads_again, never_reads)]
        for conversation in (reads_again, never_reads):
            await conversation.say(STORY)
        await asyncio.wait_for(asyncio.gather(*(s.closed.wait() for s in stalled)), 60)
        events: list[pb.ServerEvent] = []
        with pytest.raises(grpc.aio.AioRpcError):
            async for event in reads_again:
                events.append(event)
        assert await reads_again.status() == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "slow_reader: the client read nothing for 1 s",
        )
        assert sum(len(e.audio.data) for e in events if e.HasField("audio")) >= 32 << 10
        never_reads.abort()


async def test_hostile_clients_get_a_status_and_a_neighbour_conversation_goes_on(hostile, caplog):
    target, sessions = hostile
    async with DuplexClient(target) as client:
        neighbour = Neighbour(await client.converse())
        try:
            cases = [malformed_messages, never_configured, slow_readers]
            failed, figures = await run_cases(
                cases,
                (target, sessions),
                neighbour.speaking,
                neighbour.audio_since,
                [
                    (
                        "it left a session or a held place behind",
                        lambda: len(sessions) == 1 and not sessions._held,
                    )
                ],
                (grpc.aio.AioRpcError,),
            )
            status = await neighbour.close()
        finally:
            await neighbour.stop()
    print("\n".join(f"{name}: {figure}" for name, figure in figures.items()))
    assert len(figures) == len(cases) + 1  # every case ran
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())
    assert status[0] == grpc.StatusCode.OK and not neighbour.errors
    await until_no_session(sessions)
    assert not [t for t in asyncio.all_tasks() if "grpc" in t.get_name()]
    failures = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not failures, [r.getMessage() for r in failures]


class _Context:
    """A servicer context whose status send does what ``abort`` is given: raises grpc's
    own `AbortError` (sent), fails as a send to a client gone away does, or hangs."""

    def __init__(self, abort: str) -> None:
        self.how = abort

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        if self.how == "sent":
            raise AbortError("Locally aborted.")
        if self.how == "failed":
            raise ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')
        await asyncio.sleep(3600)


@pytest.mark.asyncio
async def test_a_status_that_cannot_be_sent_ends_the_call_as_a_cancellation():
    """The status after a slow reader races the client's going away: a send that fails
    before grpc has marked the call closed raised grpc's ExecuteBatchError, which grpc
    logs as an ERROR with a traceback (CI, the hostile suite). It ends the call as the
    cancellation grpc raises once it knows; so does a status not taken in time (the
    client reads nothing). A sent status is grpc's own AbortError."""
    end = StreamEnd(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow_reader: the client read nothing for 5 s")
    with pytest.raises(AbortError):
        await send_status(_Context("sent"), end, 1.0)
    for how in ("failed", "hangs"):
        with pytest.raises(asyncio.CancelledError):
            await send_status(_Context(how), end, 0.05)
