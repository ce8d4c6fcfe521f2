"""Telephony over Twilio Media Streams: the protocol and the sink alone, then
``WS /telephony/twilio`` with the real models, driven by streamdouble (a Twilio Media
Streams simulator that echoes marks when their audio would have played, and drops them
at a clear, as Twilio does) and by a raw WebSocket client for hostile input."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
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
from duplex import events as ev
from duplex.config import Config
from duplex.events import Event
from duplex.health import Readiness
from duplex.http_app import build_http_app
from duplex.session import Session
from duplex.sessions import Sessions
from duplex.transports.output import OutputStage
from duplex.transports.twilio import MARK_EVERY, TwilioEndpoint, TwilioWire
from models.speech_set import wer
from tests.conftest import speech

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
    assert session.barge_ins == 1
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
        assert [e.data["digit"] for e in recorder.of(ev.DTMF)] == ["4", "2", "#"]
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


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_hostile_input_gets_a_close_code_or_is_dropped_and_harms_no_other_call(served, monkeypatch):
    url, sessions = served
    recorder = Recorder(monkeypatch)
    frame = b"\xff" * 160
    # a call in progress, which none of the below may disturb
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as good:
        await good.send_str(start_message("MZgood"))

        async def line() -> None:  # its caller is quiet, but the line carries audio
            for k in range(100_000):
                await good.send_str(media_message(frame, k * 20, "MZgood"))
                await asyncio.sleep(0.02)

        talking = asyncio.create_task(line())
        await asyncio.sleep(0.2)
        (session,) = sessions._open
        assert await closed_with(url, "{not json") == (1007, "bad_json: messages are JSON objects")
        assert (await closed_with(url, media_message(frame)))[0] == 1002  # media before start
        assert (await closed_with(url, b"\x00\x01"))[0] == 1003  # binary frames
        assert (await closed_with(url, start_message().replace("audio/x-mulaw", "audio/l16")))[0] == 1007
        assert (await closed_with(url, "x" * 100_000))[0] == 1009  # over the message size limit
        assert (await closed_with(url, start_message("MZgood")))[0] == 1008  # a stream sid in use
        # bad messages in a started call are dropped, and the call goes on...
        async with http.ws_connect(url) as ws:
            await ws.send_str(start_message("MZ2"))
            for bad in [
                '{"event": "media", "media": {"payload": "***"}}',  # not base64
                "{truncated",
                '{"event": "mystery"}',
                '{"event": "mark", "mark": {"name": "not-ours"}}',
                '{"event": "dtmf", "dtmf": {"digit": "99"}}',
                media_message(b"\xff" * 9000),  # more than a second in one message
            ]:
                await ws.send_str(bad)
            for k in range(10):
                await ws.send_str(media_message(frame, k * 20, "MZ2"))
            await asyncio.sleep(0.3)
            assert not ws.closed and len(sessions) == 2
            await ws.send_str('{"event": "stop", "stop": {}}')
            assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000
        # ...but a stream of nothing else is closed
        code, _ = await closed_with(url, start_message("MZ3"), *["{bad"] * 25)
        assert code == 1007
        # a call that goes quiet without "stop" (the line dropped) ends at the idle timeout
        assert await closed_with(url, start_message("MZ4")) == (1001, "session ended")
        assert not session.closed.is_set() and not good.closed
        talking.cancel()
        await good.send_str('{"event": "stop", "stop": {}}')
    await asyncio.sleep(0.3)
    assert len(sessions) == 0
    assert not [t for t in asyncio.all_tasks() if "twilio" in t.get_name()]
    assert not recorder.of(ev.ERROR) or all(
        e.data["error"]["code"] == "session_timeout" for e in recorder.of(ev.ERROR)
    )
