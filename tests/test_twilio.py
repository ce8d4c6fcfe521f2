"""Telephony over Twilio Media Streams: the protocol and the sink alone, then
``WS /telephony/twilio`` with the real models, driven by streamdouble (a Twilio Media
Streams simulator that echoes marks when their audio would have played, and drops them
at a clear, as Twilio does) and by a raw WebSocket client for hostile input."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from xml.etree import ElementTree

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from streamdouble import api as sd
from streamdouble.scenario import Dtmf, Expect, Say, Scenario, Wait, WaitFor
from streamdouble.session import SessionConfig as CallConfig

from audio_io import twilio
from audio_io.frame import AudioFrame
from audio_io.g711 import ulaw_decode, ulaw_encode
from audio_io.outbox import Outbox
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from benchmarks.speech_set import wer
from duplex import events as ev
from duplex.config import Config
from duplex.events import Event
from duplex.health import Readiness
from duplex.http_app import build_http_app
from duplex.session import Session
from duplex.sessions import Sessions
from duplex.transports import twilio as endpoint_module
from duplex.transports.output import OutputStage
from duplex.transports.twilio import MARK_EVERY, MAX_MARKS_OUT, TwilioEndpoint, TwilioWire
from tests.conftest import speech
from tests.hostile import run_cases, until

QUESTION = "What is the largest ocean on Earth?"


# -- the protocol and the sink alone --


def start_message(sid: str = "MZ1", **params: str) -> str:
    return json.dumps(
        {
            "event": "start",
            "sequenceNumber": "1",
            "streamSid": sid,
            "start": {
                "accountSid": "AC1",
                "streamSid": sid,
                "callSid": "CA1",
                "tracks": ["inbound"],
                "customParameters": params,
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            },
        }
    )


def media_message(ulaw: bytes, timestamp_ms: int = 0, sid: str = "MZ1") -> str:
    payload = base64.b64encode(ulaw).decode()
    media = {"track": "inbound", "chunk": "1", "timestamp": str(timestamp_ms), "payload": payload}
    return json.dumps({"event": "media", "streamSid": sid, "media": media})


def test_the_protocol_reads_what_twilio_sends_and_refuses_the_rest():
    start = twilio.parse(start_message(token="s3cret-token"))
    assert isinstance(start, twilio.Start) and start.stream_sid == "MZ1" and start.call_sid == "CA1"
    assert start.custom_parameters == {"token": "s3cret-token"}
    media = twilio.parse(media_message(b"\xff" * 160, 40))
    assert media == twilio.Media(b"\xff" * 160, 40, "inbound")
    assert twilio.parse('{"event": "mark", "mark": {"name": "r1:100"}}') == twilio.Mark("r1:100")
    assert twilio.parse('{"event": "dtmf", "dtmf": {"digit": "#"}}') == twilio.Dtmf("#")
    assert twilio.parse('{"event": "stop", "stop": {}}') == twilio.Stop()
    for bad, code in [
        ("{not json", "bad_json"),
        ("[1, 2]", "bad_message"),
        ('{"event": "media", "media": {"payload": "%%%not base64"}}', "bad_media"),
        ('{"event": "media", "media": {"payload": "' + "A" * 20000 + '"}}', "bad_media"),
        ('{"event": "media", "media": {"payload": "", "timestamp": "soon"}}', "bad_media"),
        ('{"event": "media", "media": {"payload": "", "timestamp": 1e400}}', "bad_media"),  # inf
        ('{"event": "media", "media": {"payload": "", "timestamp": "\u00b2"}}', "bad_media"),  # "²"
        ('{"event": "media", "media": {"payload": "", "timestamp": -20}}', "bad_media"),
        ('{"event": "media", "media": {"payload": "", "timestamp": true}}', "bad_media"),
        ('{"event": "media"}', "bad_message"),
        ('{"event": "mark", "mark": {}}', "bad_message"),
        ('{"event": "dtmf", "dtmf": {"digit": "x"}}', "bad_message"),
        (start_message(**{f"p{i}": "x" for i in range(twilio.MAX_PARAMETERS + 1)}), "bad_message"),
        (start_message().replace("audio/x-mulaw", "audio/l16"), "bad_format"),
        ('{"event": "hello"}', "unknown_event"),
    ]:
        with pytest.raises(twilio.ProtocolError) as caught:
            twilio.parse(bad)
        assert caught.value.code == code, bad
    tree = ElementTree.fromstring(twilio.twiml("wss://example.test/telephony/twilio", {"token": 'a"<b>'}))
    stream = tree.find("Connect/Stream")
    assert stream is not None and stream.get("url") == "wss://example.test/telephony/twilio"
    assert [(p.get("name"), p.get("value")) for p in stream] == [("token", 'a"<b>')]


def sent(outbox: Outbox[str]) -> list[dict]:
    return [json.loads(text) for _, text in outbox._entries]


def test_the_wire_sends_20ms_mulaw_marks_every_100ms_and_clears_on_barge_in():
    wire = TwilioWire("MZ1", 22050)
    sink = OutputStage(wire)
    outbox = sink.outbox
    tone = (np.sin(np.arange(22050) / 22050 * 2 * np.pi * 300) * 8000).astype(np.int16)
    for i in range(0, 22050, 441):  # one second of 20 ms frames at the voice's rate
        sink.audio(AudioFrame(tone[i : i + 441], 22050), "resp_1")
    sink.end_reply("resp_1", completed=True)
    messages = sent(outbox)
    media = [m for m in messages if m["event"] == "media"]
    marks = [m["mark"]["name"] for m in messages if m["event"] == "mark"]
    assert all(m["streamSid"] == "MZ1" for m in messages)
    assert all(len(base64.b64decode(m["media"]["payload"])) == 160 for m in media)
    assert len(media) in (50, 51)
    decoded = ulaw_decode(b"".join(base64.b64decode(m["media"]["payload"]) for m in media))
    assert abs(np.argmax(np.abs(np.fft.rfft(decoded[800:7200]))) * 8000 / 6400 - 300) < 5
    # a mark per 5 frames, each named for the reply's milliseconds before it, and one at the end
    assert len(marks) == -(-len(media) // MARK_EVERY) and marks[0] == "resp_1:100"
    assert marks[-1] == "resp_1:1000"
    assert wire.echoed(marks[1]) == 200 * 22050 // 1000 and wire.played == 4410
    assert wire.echoed(marks[0]) is None  # passed over by a later echo
    assert wire.echoed("someone_else:5") is None
    # a barge-in: queued audio and marks go, a clear is sent, late echoes say nothing
    outbox.take()
    for i in range(0, 4410, 441):
        sink.audio(AudioFrame(tone[i : i + 441], 22050), "resp_2")
    (pending,) = [m["mark"]["name"] for m in sent(outbox) if m["event"] == "mark"]
    sink.flush()
    assert sent(outbox) == [{"event": "clear", "streamSid": "MZ1"}]
    assert wire.echoed(pending) is None and wire.played == 4410


def test_marks_awaiting_their_echo_are_bounded_and_the_newest_kept():
    wire = TwilioWire("MZ1", 8000)
    sink = OutputStage(wire)
    frame = AudioFrame(np.full(160, 1000, np.int16), 8000)
    for _ in range(3 * MAX_MARKS_OUT * MARK_EVERY):  # a caller that never echoes a mark
        sink.audio(frame, "resp_1")
        sink.outbox.take()
    assert len(wire._marks) == MAX_MARKS_OUT
    assert wire.echoed(f"resp_1:{100 * MAX_MARKS_OUT}") is None  # an old one, forgotten
    assert wire.echoed(f"resp_1:{300 * MAX_MARKS_OUT}") == 8 * 300 * MAX_MARKS_OUT  # the last one sent
    assert wire._marks == {}


# -- the endpoint, with the real models --


class Recorder:
    """Every event and playback report of the calls' sessions (a spy on the real sink)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[Event] = []
        self.played: list[int] = []
        self.sessions: list[Session] = []
        event, playback, dtmf = TwilioWire.event, Session.playback, Session.dtmf

        def on_event(wire: TwilioWire, e: Event) -> list[str]:
            self.events.append(e)
            return event(wire, e)

        def on_playback(session: Session, position: int) -> None:
            self.played.append(position)
            self._see(session)
            playback(session, position)

        def on_dtmf(session: Session, digit: str) -> None:
            self._see(session)
            dtmf(session, digit)

        monkeypatch.setattr(TwilioWire, "event", on_event)
        monkeypatch.setattr(Session, "playback", on_playback)
        monkeypatch.setattr(Session, "dtmf", on_dtmf)

    def _see(self, session: Session) -> None:
        if session not in self.sessions:
            self.sessions.append(session)

    def of(self, type_: str) -> list[Event]:
        return [e for e in self.events if e.type == type_]


@pytest_asyncio.fixture(loop_scope="session")
async def served(engines):
    config = Config(max_sessions=8, session_idle_timeout_s=3)
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    app = build_http_app(config, Readiness(["llm"]))
    endpoint = TwilioEndpoint(config, sessions)
    endpoint.routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"ws://127.0.0.1:{server.port}{twilio_path()}", sessions
    await sessions.close_all()
    await server.close()


def twilio_path() -> str:
    return "/telephony/twilio"


def ulaw_frames(tts_engine, text: str) -> list[bytes]:
    audio = resample(speech(tts_engine, text), RUNTIME_RATE, twilio.RATE)
    codes = ulaw_encode(np.concatenate([audio, np.zeros(-audio.size % 160, np.int16)])).tobytes()
    return [codes[i : i + 160] for i in range(0, len(codes), 160)]


def call_config(**changes: object) -> CallConfig:
    base = {"response_timeout_s": 30.0, "quiet_period_s": 2.5, "max_drain_s": 40.0}
    return CallConfig(**{**base, **changes})


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_a_call_gets_a_spoken_reply_and_marks_feed_the_ledger(
    served, tts_engine, asr_engine, monkeypatch
):
    url, sessions = served
    recorder = Recorder(monkeypatch)
    # a phone line carries audio all the time: the question, then the caller's silence
    frames = ulaw_frames(tts_engine, QUESTION) + [b"\xff" * 160] * 75
    report = await sd.call(url, frames=frames, config=call_config())
    assert not report.violations and report.spoke
    (final,) = recorder.of(ev.TRANSCRIPT_DONE)
    assert wer([(QUESTION, final.data["transcript"])]) <= 0.2
    reply = "".join(e.data["delta"] for e in recorder.of(ev.TEXT_DELTA))
    (done,) = recorder.of(ev.RESPONSE_DONE)
    assert done.data["status"] == "completed" and "Pacific" in reply
    # the caller heard the reply: μ-law at 8 kHz, transcribed back to what the LLM wrote
    heard = resample(ulaw_decode(report.result.audio_received), twilio.RATE, RUNTIME_RATE)
    assert heard.size / RUNTIME_RATE >= 1.0
    assert wer([(reply, asr_engine.transcribe(heard))]) <= 0.3
    # every mark came back, and each echo moved the ledger's played position forward
    result = report.result
    assert result.marks_received and result.marks_echoed == result.marks_received
    assert recorder.played == sorted(recorder.played) and len(recorder.played) == len(result.marks_echoed)
    (session,) = recorder.sessions
    turn = session.ledger.turn(done.data["response_id"])
    assert turn.played == turn.sent  # the last mark stands for the whole reply
    await asyncio.sleep(0.2)
    assert len(sessions) == 0


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_barge_in_clears_the_line_and_truncates_to_the_last_echoed_mark(
    served, tts_engine, monkeypatch
):
    url, sessions = served
    recorder = Recorder(monkeypatch)
    story = ulaw_frames(tts_engine, "Please tell me a long story about a brave little dragon.")
    stop = ulaw_frames(tts_engine, "Stop please. What is two plus two?")
    scenario = Scenario(
        "barge-in",
        [
            Say(twilio_path(), story),
            WaitFor("audio", 30.0),
            Wait(1.5),
            Say(twilio_path(), stop),
            Expect("clear"),
            Wait(6.0),  # the answer to the new question begins
            WaitFor("quiet", 30.0),
        ],
    )
    report = await sd.run_scenario(url, scenario, config=call_config())
    seen = [(e.type, e.data.get("transcript", e.data.get("status"))) for e in recorder.events]
    assert not report.result.failed_expectations and report.result.clears_received >= 1, seen
    (cut,) = recorder.of(ev.TRUNCATED)
    # the reply was cut where the last mark the server got before the cut said it was:
    # the last one echoed before the clear reached the caller (or, if that echo crossed
    # the clear on the wire, the one before it)
    events = report.result.events
    clear_at = next(e.at for e in events if e.kind == "clear_received")
    echoed = [e.detail["name"] for e in events if e.kind == "mark_echoed" and e.at < clear_at]
    (cancelled,) = [
        e.data["response_id"] for e in recorder.of(ev.RESPONSE_DONE) if e.data["status"] != "completed"
    ]
    mine = [int(n.split(":")[1]) for n in echoed if n.split(":")[0] == cancelled]
    assert mine and cut.data["audio_end_ms"] in mine[-2:]
    assert cut.data["audio_end_ms"] >= 1000 and cut.data["transcript"]
    assert len(recorder.of(ev.RESPONSE_CREATED)) == 2  # the cut reply, then the answer
    await asyncio.sleep(0.2)
    assert len(sessions) == 0


class LineCaller:
    """A phone line by hand (raw WebSocket): the caller's voice every 20 ms on a real
    clock; the phone plays the reply one frame a tick, echoes each mark once the audio
    before it has played, and the line carries what was played back into the
    microphone, attenuated and delayed, as a handset or a speakerphone line does."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, echo_db: float, echo_ms: int) -> None:
        self.ws = ws
        self.gain = 10 ** (echo_db / 20)
        self.delay = echo_ms // 20
        self.mic: list[bytes] = []
        self.played: list[np.ndarray] = []  # one frame a tick: the reply, or silence
        self.marks: list[str] = []  # echoed
        self._playing: list[np.ndarray | str] = []  # reply frames and mark names, in order

    async def run(self, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        """Talk and listen for ``seconds``, or until ``until()`` holds (and 1 s more)."""
        reader = asyncio.create_task(self._read())
        loop = asyncio.get_running_loop()
        start, silence = loop.time(), np.zeros(160, np.int16)
        try:
            end = int(seconds * 50)
            for k in range(1, int(seconds * 50)):
                if k >= end:
                    break
                if end > k + 50 and until():
                    end = k + 50
                await asyncio.sleep(max(0.0, start + k * 0.02 - loop.time()))
                while self._playing and isinstance(self._playing[0], str):
                    await self._echo_mark(str(self._playing.pop(0)))
                frame = self._playing.pop(0) if self._playing else silence
                self.played.append(np.asarray(frame))
                voice = ulaw_decode(self.mic.pop(0)) if self.mic else silence
                echo = self.played[-1 - self.delay] if len(self.played) > self.delay else silence
                line = np.clip(voice.astype(np.int32) + (echo * self.gain).astype(np.int32), -32768, 32767)
                await self.ws.send_str(media_message(ulaw_encode(line.astype(np.int16)).tobytes(), k * 20))
        finally:
            reader.cancel()

    async def _echo_mark(self, name: str) -> None:
        self.marks.append(name)
        await self.ws.send_str(json.dumps({"event": "mark", "streamSid": "MZ1", "mark": {"name": name}}))

    async def _read(self) -> None:
        async for msg in self.ws:
            message = json.loads(msg.data)
            if message["event"] == "media":
                self._playing.append(ulaw_decode(base64.b64decode(message["media"]["payload"])))
            elif message["event"] == "mark":
                self._playing.append(message["mark"]["name"])
            elif message["event"] == "clear":
                self._playing.clear()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_a_loud_line_echo_does_not_interrupt_the_reply_and_the_caller_still_can(
    served, tts_engine, monkeypatch
):
    url, sessions = served
    recorder = Recorder(monkeypatch)
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        await ws.send_str(start_message())
        caller = LineCaller(ws, echo_db=-10, echo_ms=100)  # the loudest echo phone lines have
        caller.mic = ulaw_frames(tts_engine, "Tell me about cats in two sentences.")
        await caller.run(seconds=40, until=lambda: sum(1 for f in caller.played if f.any()) >= 150)
        # 3 s of the reply played over its own echo: nothing paused or cut it
        assert not recorder.of(ev.TRUNCATED) and not recorder.of(ev.RESUMED)
        caller.mic = ulaw_frames(tts_engine, "Stop please. What is two plus two?")
        await caller.run(seconds=30, until=lambda: len(recorder.of(ev.RESPONSE_CREATED)) >= 2)
        await ws.send_str('{"event": "stop", "stop": {}}')
    (cut,) = recorder.of(ev.TRUNCATED)
    assert cut.data["audio_end_ms"] >= 3000 and cut.data["transcript"]
    (session,) = recorder.sessions
    assert session.turns.barge_ins == 1
    assert caller.marks


@pytest.mark.asyncio(loop_scope="session")
async def test_the_webhook_gives_twiml_and_the_stream_wants_the_token(engines, tts_engine, monkeypatch):
    config = Config(auth_token="s3cret-token", session_idle_timeout_s=5)
    sessions = Sessions(4, 5)
    sessions.attach(engines)
    app = build_http_app(config, Readiness(["llm"]))
    TwilioEndpoint(config, sessions).routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    base = f"127.0.0.1:{server.port}"
    recorder = Recorder(monkeypatch)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://{base}/telephony/twilio/voice", data={"CallSid": "CA1"}) as r:
                assert r.status == 401
            async with http.post(f"http://{base}/telephony/twilio/voice?token=s3cret-token") as r:
                assert r.status == 200 and r.content_type == "text/xml"
                stream = ElementTree.fromstring(await r.text()).find("Connect/Stream")
            assert stream is not None and stream.get("url") == f"ws://{base}/telephony/twilio"
            assert [(p.get("name"), p.get("value")) for p in stream] == [("token", "s3cret-token")]
            for query, params in [("", {}), ("?token=wrong", {}), ("", {"token": "wrong"})]:
                async with http.ws_connect(f"ws://{base}/telephony/twilio{query}") as ws:
                    await ws.send_str(start_message(**params))
                    assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE
                    assert ws.close_code == 1008
        # the token as Twilio sends it (a <Parameter> of the TwiML), and keys pressed
        scenario = Scenario("keys", [Wait(0.3), Dtmf("42#"), Wait(0.5)])
        config_ = call_config(custom_parameters={"token": "s3cret-token"}, quiet_period_s=0.5)
        await sd.run_scenario(f"ws://{base}/telephony/twilio", scenario, config=config_)
        assert [e.data["event"] for e in recorder.of(ev.DTMF)] == ["4", "2", "#"]
    finally:
        await sessions.close_all()
        await server.close()


async def closed_with(url: str, *messages: str | bytes) -> tuple[int | None, str]:
    """Send these and read until the server closes: its close code and reason."""
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        for message in messages:
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_str(message)
        async with asyncio.timeout(10):
            msg = await ws.receive()
            while msg.type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                msg = await ws.receive()
        return ws.close_code, str(msg.extra or "")


# -- hostile callers, each beside a neighbour call that must not notice --

STORY = "Tell me a long story."
SILENCE = b"\xff" * 160  # μ-law zero
STOP = '{"event": "stop", "stop": {}}'


@dataclass
class Hostile:
    """A listener with room for three calls and short handshake and slow-reader timeouts."""

    url: str
    port: int
    sessions: Sessions
    endpoint: TwilioEndpoint
    story: list[bytes]  # a caller asking for a long story, as μ-law frames


@pytest_asyncio.fixture(loop_scope="session")
async def hostile(engines, tts_engine):
    config = Config(max_sessions=3, session_idle_timeout_s=3, handshake_timeout_s=1, slow_reader_timeout_s=1)
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    app = build_http_app(config, Readiness(["llm"]))
    endpoint = TwilioEndpoint(config, sessions)
    endpoint.routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    assert server.port is not None
    url = f"ws://127.0.0.1:{server.port}{twilio_path()}"
    yield Hostile(url, server.port, sessions, endpoint, ulaw_frames(tts_engine, STORY))
    await sessions.close_all()
    await server.close()


def wire_of(h: Hostile, sid: str) -> TwilioWire:
    session = h.endpoint.calls[sid]
    assert isinstance(session, Session) and isinstance(session.sink, OutputStage)
    assert isinstance(session.sink.wire, TwilioWire)
    return session.sink.wire


class Neighbour:
    """A well-behaved call beside the hostile ones: its line carries, in real time, a
    caller asking for a long story (again whenever a reply is over) and silence; marks
    are echoed as they come, and when each media message arrived is kept."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, story: list[bytes]) -> None:
        self.ws = ws
        self.story = story
        self.media_at: list[float] = []
        self._mic: list[bytes] = []
        self._marks: list[str] = []
        self._asked_at = 0.0
        self._tasks = [asyncio.create_task(self._talk()), asyncio.create_task(self._listen())]

    def _ask_again(self, now: float) -> bool:
        answered = bool(self.media_at) and self.media_at[-1] > self._asked_at
        return (answered and now - self.media_at[-1] > 1.0) or now - self._asked_at > 30

    async def _talk(self) -> None:
        start = time.monotonic()
        for k in itertools.count(1):
            await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))
            if not self._mic and self._ask_again(time.monotonic()):
                self._mic, self._asked_at = list(self.story), time.monotonic()
            while self._marks:
                name = self._marks.pop(0)
                await self.ws.send_str(
                    json.dumps({"event": "mark", "streamSid": "MZgood", "mark": {"name": name}})
                )
            await self.ws.send_str(
                media_message(self._mic.pop(0) if self._mic else SILENCE, k * 20, "MZgood")
            )

    async def _listen(self) -> None:
        async for msg in self.ws:
            message = json.loads(msg.data)
            if message["event"] == "media":
                self.media_at.append(time.monotonic())
            elif message["event"] == "mark":
                self._marks.append(message["mark"]["name"])

    async def speaking(self, within: float = 60.0) -> None:
        """Until reply audio is arriving."""
        await until(lambda: bool(self.media_at) and time.monotonic() - self.media_at[-1] < 0.1, within)

    def media_since(self, moment: float) -> int:
        return sum(1 for t in self.media_at if t >= moment)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class BareCaller:
    """A Media Streams caller on a bare socket with a 4 KiB receive buffer, framing
    WebSocket by hand, that reads only when told to: a caller that stops reading."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int) -> BareCaller:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)  # it buffers ~2 KiB
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET {twilio_path()} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
        return cls(reader, writer)

    async def send(self, payload: bytes, opcode: int = 0x1) -> None:
        assert len(payload) < 1 << 16
        mask = os.urandom(4)
        size = (
            bytes([0x80 | len(payload)])
            if len(payload) < 126
            else bytes([0x80 | 126]) + len(payload).to_bytes(2, "big")
        )
        key = (mask * (len(payload) // 4 + 1))[: len(payload)]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(len(payload), "big")
        self.writer.write(bytes([0x80 | opcode]) + size + mask + masked)
        await self.writer.drain()

    async def talk(self, sid: str, frames: list[bytes]) -> None:
        """``start``, then these frames and silence, one every 20 ms, until cancelled."""
        await self.send(start_message(sid).encode())
        start = time.monotonic()
        for k in itertools.count():
            await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))
            await self.send(media_message(frames[k] if k < len(frames) else SILENCE, k * 20, sid).encode())

    async def close_frame(self) -> tuple[int, str]:
        """Read from now on, to the server's close frame; answer it; its code and reason."""
        while True:
            first, second = await self.reader.readexactly(2)
            size = second & 0x7F
            if size >= 126:
                size = int.from_bytes(await self.reader.readexactly(2 if size == 126 else 8), "big")
            payload = await self.reader.readexactly(size)
            if first & 0x0F == 0x8:
                with contextlib.suppress(ConnectionError):  # (the server may be gone already)
                    await self.send(payload[:2], opcode=0x8)
                return int.from_bytes(payload[:2], "big"), payload[2:].decode()

    def close(self) -> None:
        self.writer.close()


async def bad_first_messages(h: Hostile) -> None:
    """Anything but ``connected`` or a good ``start`` first: closed with a code that says why."""
    many = {f"p{i}": "x" for i in range(twilio.MAX_PARAMETERS + 1)}
    cases: list[tuple[tuple[str | bytes, ...], int, str]] = [
        (("{not json",), 1007, "bad_json: messages are JSON objects"),
        (("[1, 2]",), 1007, "bad_message: the message must be an object"),
        (('"start"',), 1007, "bad_message: the message must be an object"),
        (('{"event": "mystery"}',), 1007, "unknown_event"),
        (("{}",), 1007, "unknown_event"),
        ((media_message(SILENCE),), 1002, "expected 'start', got media"),
        ((b"\x00\x01",), 1003, "Media Streams messages are JSON text"),
        (("x" * 100_000,), 1009, ""),  # over the WebSocket's message limit
        ((start_message().replace("audio/x-mulaw", "audio/l16"),), 1007, "bad_format"),
        ((start_message("MZmany", **many),), 1007, "bad_message: start.customParameters"),
        ((start_message("MZgood"),), 1008, "this streamSid already has a call"),
    ]
    for messages, code, words in cases:  # one at a time: each holds a place while it lasts
        got = await closed_with(h.url, *messages)
        assert got[0] == code and got[1].startswith(words), (messages[0][:40], got)


async def bad_messages_in_a_call(h: Hostile) -> None:
    """In a call, bad messages (and floods of echoes and keys) are dropped and the call
    goes on; an oversized frame ends it (1009), as do nothing but bad messages (1007)."""
    async with aiohttp.ClientSession() as http, http.ws_connect(h.url) as ws:
        await ws.send_str(start_message("MZ2"))
        for bad in [
            '{"event": "media", "media": {"payload": "***"}}',  # not base64
            "{truncated",
            "[1, 2]",
            '{"event": "mystery"}',
            '{"event": "dtmf", "dtmf": {"digit": "99"}}',
            media_message(b"\xff" * 9000),  # more than a second in one message
        ]:
            await ws.send_str(bad)
        await ws.send_bytes(b"\x00\x01")
        for k in range(3000):  # echoes of marks never sent, and keys pressed, by the thousand
            await ws.send_str(
                json.dumps({"event": "mark", "streamSid": "MZ2", "mark": {"name": f"r{k}:{k}"}})
            )
            if k % 10 == 0:
                await ws.send_str(json.dumps({"event": "dtmf", "streamSid": "MZ2", "dtmf": {"digit": "1"}}))
                await asyncio.sleep(0)  # this client shares the loop: it must not hog it
        for k in range(10):
            await ws.send_str(media_message(SILENCE, k * 20, "MZ2"))
        await asyncio.sleep(0.3)
        assert not ws.closed and "MZ2" in h.endpoint.calls  # ...dropped, and the call goes on
        assert wire_of(h, "MZ2")._marks == {}
        await ws.send_str("x" * 100_000)  # but an oversized frame ends it
        while (await ws.receive()).type != aiohttp.WSMsgType.CLOSE:
            pass
        assert ws.close_code == 1009
    await until(lambda: "MZ2" not in h.endpoint.calls, 5)
    # a call that sends nothing but bad messages is closed
    assert (await closed_with(h.url, start_message("MZ3"), *["{bad"] * 25))[0] == 1007


async def sockets_that_never_start(h: Hostile) -> None:
    """Sockets that never send ``start`` fill the server, then time out and free it."""
    room = h.sessions.max_sessions - len(h.sessions)
    assert room == 2
    async with aiohttp.ClientSession() as http:
        idle = [await http.ws_connect(h.url) for _ in range(room)]
        await until(lambda: h.sessions._held == room, 5)
        assert await closed_with(h.url, start_message("MZ5")) == (
            1013,
            "too_many_sessions: the server is at its limit of 3 sessions",
        )
        for ws in idle:
            assert (await ws.receive()).extra == "no 'start' within 1 s" and ws.close_code == 1008
        assert h.sessions._held == 0
        async with http.ws_connect(h.url) as ws:  # their places are free again
            await ws.send_str(start_message("MZ6"))
            await until(lambda: "MZ6" in h.endpoint.calls, 5)
            await ws.send_str(STOP)
            assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000


async def marks_never_echoed(h: Hostile) -> None:
    """A caller that hears a reply but never echoes a mark: at most MAX_MARKS_OUT are kept."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(endpoint_module, "MAX_MARKS_OUT", 10)  # 1 s of marks, not a minute
        async with aiohttp.ClientSession() as http, http.ws_connect(h.url) as ws:
            marks_heard = 0

            async def listen() -> None:
                nonlocal marks_heard
                async for msg in ws:
                    marks_heard += json.loads(msg.data)["event"] == "mark"

            listening = asyncio.create_task(listen())
            await ws.send_str(start_message("MZ7"))
            start = time.monotonic()
            for k in itertools.count():  # the question, then silence, until 20 marks have come
                if marks_heard > 20:
                    break
                assert k < 30 * 50, "no reply within 30 s"
                await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))
                await ws.send_str(media_message(h.story[k] if k < len(h.story) else SILENCE, k * 20, "MZ7"))
            assert len(wire_of(h, "MZ7")._marks) == 10
            await ws.send_str(STOP)
            await listening


async def slow_readers(h: Hostile) -> None:
    """Two callers ask for a story and stop reading: once the reply has filled the
    buffers, both calls end; the one that reads again finds, after the media that was
    on its way, a 1008 close; the other's connection is dropped."""
    reads_again, never_reads = await BareCaller.connect(h.port), await BareCaller.connect(h.port)
    talking = [
        asyncio.create_task(reads_again.talk("MZs1", h.story)),
        asyncio.create_task(never_reads.talk("MZs2", h.story)),
    ]
    try:
        await until(lambda: {"MZs1", "MZs2"} <= h.endpoint.calls.keys(), 5)
        stalled = [h.endpoint.calls["MZs1"], h.endpoint.calls["MZs2"]]
        for session, talk in zip(stalled, talking, strict=True):
            await asyncio.wait_for(session.closed.wait(), 60)
            talk.cancel()  # (a caller that hears nothing gets no reply either)
            if talk is talking[0]:
                assert await reads_again.close_frame() == (1008, "slow_reader: nothing was read for 1 s")
    finally:
        for task in talking:
            task.cancel()
        await asyncio.gather(*talking, return_exceptions=True)
    await until(lambda: not {"MZs1", "MZs2"} & h.endpoint.calls.keys(), 10)
    reads_again.close()
    never_reads.close()


async def a_caller_that_vanishes(h: Hostile) -> None:
    """A call that goes quiet without ``stop`` (the line dropped) ends at the idle timeout."""
    assert await closed_with(h.url, start_message("MZ4")) == (1001, "session ended")


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_hostile_callers_get_close_codes_and_a_neighbour_call_goes_on(hostile, caplog):
    h = hostile
    async with aiohttp.ClientSession() as http, http.ws_connect(h.url) as good:
        await good.send_str(start_message("MZgood"))
        neighbour = Neighbour(good, h.story)
        try:
            cases = [
                bad_first_messages,
                bad_messages_in_a_call,
                sockets_that_never_start,
                marks_never_echoed,
                slow_readers,
                a_caller_that_vanishes,
            ]
            afterwards = [
                (
                    "it left a session or a held place behind",
                    lambda: len(h.sessions) == 1 and not h.sessions._held,
                ),
                ("it left a call behind", lambda: list(h.endpoint.calls) == ["MZgood"]),
            ]
            failed, figures = await run_cases(
                cases,
                (h,),
                neighbour.speaking,
                neighbour.media_since,
                afterwards,
                (OSError, aiohttp.ClientError),
            )
        finally:
            await neighbour.stop()
        print("\n".join(f"{name}: {figure}" for name, figure in figures.items()))
        await good.send_str(STOP)
        while (await good.receive()).type != aiohttp.WSMsgType.CLOSE:  # (the reply's last media)
            pass
        assert good.close_code == 1000
    assert len(figures) == len(cases) + 1  # every case ran
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())
    await until(lambda: len(h.sessions) == 0 and not h.endpoint.calls, 5)
    assert not [t for t in asyncio.all_tasks() if "twilio" in t.get_name()]
    failures = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not failures, [r.getMessage() for r in failures]
