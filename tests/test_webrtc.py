"""The WebRTC transport: its track and resampling alone, then `POST /webrtc/offer` with
the real models and a real WebRTC peer (aiortc) on 127.0.0.1, bad offers included."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from aiortc import RTCPeerConnection
from aiortc.rtp import RtpPacket

from audio_io.frame import AudioFrame
from audio_io.resample import resample
from audio_io.webrtc import FRAME, AudioJitterBuffer, OutboundTrack, WebRtcPeer, set_host_addresses
from duplex import events as ev
from duplex.config import Config, ConfigError
from duplex.health import Readiness
from duplex.http_app import build_http_app
from duplex.sessions import Sessions
from duplex.transports.output import OutputStage
from duplex.transports.webrtc import PeerWire, WebRtcEndpoint
from models.speech_set import wer
from tests.conftest import speech
from tests.webrtc_peer import Browser

QUESTION = "What is the capital city of France?"


# -- the transport's parts alone --


async def test_the_track_sends_pushed_frames_at_once_and_silence_when_idle():
    track = OutboundTrack()
    first = await track.recv()
    second = await track.recv()
    assert first.samples == second.samples == FRAME and first.sample_rate == 48000
    assert (second.pts or 0) - (first.pts or 0) == FRAME  # one 20 ms grid, silence included
    assert not first.to_ndarray().any()
    voice = np.arange(FRAME, dtype=np.int16)
    track.push(voice)
    frame = await track.recv()
    assert np.array_equal(frame.to_ndarray().reshape(-1), voice) and track.frames_sent == 1
    track.push(voice)
    track.push(voice)
    assert track.flush() == 2  # barge-in: nothing queued leaves
    assert not (await track.recv()).to_ndarray().any()
    with pytest.raises(ValueError):
        track.push(np.zeros(100, np.int16))
    track.stop()


async def test_the_peer_turns_the_voice_into_20ms_frames_at_48khz():
    peer = WebRtcPeer()
    stage = OutputStage(PeerWire(peer), peer.track.outbox)
    voice = (np.sin(np.arange(22050) / 22050 * 2 * np.pi * 440) * 8000).astype(np.int16)
    for i in range(0, 22050, 441):  # one second of 20 ms frames at the voice's rate
        stage.audio(AudioFrame(voice[i : i + 441], 22050), "resp_1")
    stage.end_reply("resp_1", completed=True)  # the tail goes out, padded to a whole frame
    frames = [item for _, item in peer.track.outbox._entries]
    assert all(f.size == FRAME for f in frames)
    assert 50 <= len(frames) <= 51
    out = np.concatenate(frames)
    spectrum = np.abs(np.fft.rfft(out[4800:43200]))
    assert abs(np.argmax(spectrum) * 48000 / 38400 - 440) < 5
    stage.audio(AudioFrame(voice[:441], 22050), "resp_2")
    stage.flush()
    assert peer.track.flush() == 0 and stage._frames.pending_samples == 0
    await peer.close()


def test_the_jitter_buffer_releases_at_once_and_skips_what_is_lost():
    buffer = AudioJitterBuffer()
    out = []
    for seq in [65533, 65534, 0, 1, 3, 2, 3, 5, 4, 6, 200, 201]:  # wraps; 65535 lost; 2, 4 late
        packet = RtpPacket(
            payload_type=111, sequence_number=seq, timestamp=seq * 960, payload=bytes([seq % 256])
        )
        packet._data = packet.payload  # type: ignore[attr-defined]  # the receiver sets it on depacketizing
        _, frame = buffer.add(packet)
        if frame is not None:
            out.append(seq)
    assert out == [65533, 65534, 0, 1, 3, 5, 6, 200, 201]


def test_ice_host_addresses_default_to_the_interfaces_and_loopback():
    import aioice.ice

    try:
        set_host_addresses(None)
        found = aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False)
        assert "127.0.0.1" in found  # aioice alone never offers it
        set_host_addresses(["127.0.0.1", "::1"])
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False) == ["127.0.0.1"]
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=True) == ["127.0.0.1", "::1"]
    finally:
        set_host_addresses(["127.0.0.1"])  # what every test here uses


async def test_the_ice_servers_are_configurable_and_checked():
    config = Config(
        webrtc_ice_servers="stun:stun.example.org:3478, turn:turn.example.org",
        webrtc_ice_username="u",
        webrtc_ice_credential="secret-1",
    )
    app = build_http_app(config, Readiness(["llm"]))
    WebRtcEndpoint(config, Sessions(1, 60)).routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{server.port}/webrtc/ice") as r,
        ):
            servers = (await r.json())["iceServers"]
    finally:
        await server.close()
    assert [s["urls"] for s in servers] == ["stun:stun.example.org:3478", "turn:turn.example.org"]
    assert servers[1]["username"] == "u" and servers[1]["credential"] == "secret-1"
    assert config.redacted()["webrtc_ice_credential"] == "***"
    with pytest.raises(ConfigError, match="webrtc_ice_servers"):
        Config(webrtc_ice_servers="http://example.org")
    with pytest.raises(ConfigError, match="webrtc_host_addresses"):
        Config(webrtc_host_addresses="localhost")


# -- the endpoint, with the real models and a real peer --


@pytest_asyncio.fixture(loop_scope="session")
async def endpoint(engines):
    set_host_addresses(["127.0.0.1"])  # loopback only, both peers (aioice is process-wide)
    config = Config(webrtc_host_addresses="127.0.0.1", max_sessions=8, webrtc_connect_timeout_s=5)
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    app = build_http_app(config, Readiness(["llm"]))
    webrtc = WebRtcEndpoint(config, sessions)
    webrtc.routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    yield base, webrtc, sessions
    await webrtc.close_all()
    await sessions.close_all()
    await server.close()


async def connected(base: str, **body) -> Browser:
    browser = Browser()
    status, payload = await browser.connect(base, **body)
    assert status == 200, payload
    await asyncio.wait_for(browser.channel_open.wait(), 10)
    return browser


async def until(condition, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_a_spoken_question_gets_a_spoken_reply(endpoint, engines, tts_engine):
    base, _, sessions = endpoint
    browser = await connected(base)
    try:
        browser.mic.say(speech(tts_engine, QUESTION))
        (done,) = await browser.wait_for(ev.RESPONSE_DONE, within=60)
        await asyncio.sleep(0.3)  # the last frames are in flight
    finally:
        await browser.close()
    (final,) = browser.of_type(ev.TRANSCRIPT_DONE)
    assert wer([(QUESTION, final["transcript"])]) <= 0.2
    said = "".join(e["delta"] for e in browser.of_type(ev.TEXT_DELTA))
    assert done["status"] == "completed" and said
    assert browser.of_type(ev.METRICS)[0]["voice_to_voice_ms"] > 0
    reply = browser.audio(since=browser.mic.spoken_at[0])
    loud = np.abs(reply.astype(np.int32)) > 300
    assert loud.sum() / 48000 >= 0.5 and reply.size / 48000 >= 1.0
    heard = await asyncio.to_thread(engines.asr.transcribe, resample(reply, 48000, 16000))
    assert wer([(said, heard)]) <= 0.3, (said, heard)
    await until(lambda: len(sessions) == 0)  # the browser left: the session closed with it


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_text_input_cancel_and_bad_control_messages(endpoint):
    base, _, _ = endpoint
    browser = await connected(base)
    try:
        browser.send({"type": "input_text", "text": "Tell me a long story about a cat."})
        await browser.wait_for(ev.RESPONSE_CREATED, within=30)
        await until(lambda: len(browser.of_type(ev.TEXT_DELTA)) > 0, within=30)
        browser.send({"type": "cancel"})
        (done,) = await browser.wait_for(ev.RESPONSE_DONE, within=30)
        assert done["status"] == "cancelled"
        browser.channel.send("{not json")
        browser.send({"type": "dance"})
        browser.send({"type": "config", "end_of_turn_ms": 50})
        browser.send({"type": "config", "llm": "other"})
        browser.channel.send("x" * 70_000)
        errors = await browser.wait_for(ev.ERROR, count=5)
        codes = [e["error"]["code"] for e in errors]
        assert codes == ["bad_message", "bad_message", "bad_config", "bad_config", "message_too_large"]
        browser.send({"type": "config", "end_of_turn_ms": 700})
        browser.send({"type": "input_text", "text": "Say hi."})
        await browser.wait_for(ev.RESPONSE_DONE, count=2, within=30)  # still served
    finally:
        await browser.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_ten_percent_inbound_packet_loss_still_makes_a_turn(endpoint, tts_engine):
    base, webrtc, _ = endpoint
    browser = await connected(base)
    try:
        (receiver,) = webrtc.peers[browser.session_id].pc.getReceivers()
        handle = receiver._handle_rtp_packet
        rng = random.Random(7)
        dropped = []

        async def lossy(packet, arrival_time_ms):
            if rng.random() < 0.1:
                dropped.append(packet.sequence_number)
                return None
            return await handle(packet, arrival_time_ms)

        receiver._handle_rtp_packet = lossy
        browser.mic.say(speech(tts_engine, QUESTION))
        await browser.wait_for(ev.RESPONSE_DONE, within=60)
    finally:
        await browser.close()
    (final,) = browser.of_type(ev.TRANSCRIPT_DONE)
    assert wer([(QUESTION, final["transcript"])]) <= 0.4, final
    assert len(dropped) >= 10  # it really lost packets


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_bad_offers_get_clear_errors_and_the_server_goes_on(endpoint):
    base, _, sessions = endpoint
    async with aiohttp.ClientSession() as http:

        async def post(**kwargs):
            async with http.post(f"{base}/webrtc/offer", **kwargs) as r:
                return r.status, (await r.json())["error"]["code"]

        json_type = {"Content-Type": "application/json"}
        assert await post(data=b"\x00\xff not json", headers=json_type) == (400, "bad_offer")
        # only its documented type: a form or text/plain post is what another site's page can send
        text = {"Content-Type": "text/plain"}
        assert await post(data='{"type": "offer", "sdp": "v=0"}', headers=text) == (415, "bad_content_type")
        assert await post(json={"type": "answer", "sdp": "v=0"}) == (400, "bad_offer")
        assert await post(json=["offer"]) == (400, "bad_offer")
        garbage = (
            "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\nc=IN IP4 nowhere\r\n"
        )
        assert (await post(json={"type": "offer", "sdp": garbage}))[0] == 400
        assert await post(json={"type": "offer", "sdp": "\x00" * 5000}) == (400, "no_audio")
        data_only = RTCPeerConnection()  # a data channel, no audio
        data_only.createDataChannel("events")
        await data_only.setLocalDescription(await data_only.createOffer())
        sdp = data_only.localDescription.sdp
        await data_only.close()
        assert await post(json={"type": "offer", "sdp": sdp}) == (400, "no_audio")
        probe = Browser()
        sdp = await probe.offer()
        assert await post(json={"type": "offer", "sdp": sdp, "config": {"llm": "x"}}) == (400, "bad_config")
        assert await post(json={"type": "offer", "sdp": sdp, "config": {"end_of_turn_ms": "soon"}}) == (
            400,
            "bad_config",
        )
        await probe.close()
    # a second offer for a peer connection that already has its session
    browser = await connected(base)
    try:
        async with aiohttp.ClientSession() as http:
            again = {"type": "offer", "sdp": browser.pc.localDescription.sdp}
            async with http.post(f"{base}/webrtc/offer", json=again) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "offer_in_use"
            renegotiate = {**again, "session_id": browser.session_id}
            async with http.post(f"{base}/webrtc/offer", json=renegotiate) as r:
                assert r.status == 409
        assert len(sessions) == 1
    finally:
        await browser.close()
    await until(lambda: len(sessions) == 0)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_a_burst_of_50_offers_is_served_up_to_the_limit(endpoint):
    base, _, sessions = endpoint
    browsers = [Browser() for _ in range(50)]
    try:
        responses = await asyncio.gather(*(b.connect(base) for b in browsers))
        statuses = [status for status, _ in responses]
        assert statuses.count(200) == sessions.max_sessions
        assert statuses.count(429) == 50 - sessions.max_sessions
        assert {p["error"]["code"] for s, p in responses if s == 429} == {"too_many_sessions"}
    finally:
        await asyncio.gather(*(b.close() for b in browsers))
    await until(lambda: len(sessions) == 0, within=20)
    browser = await connected(base)  # and the next caller gets in
    await browser.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_a_peer_that_never_connects_is_closed_with_its_session(endpoint):
    base, webrtc, sessions = endpoint
    browser = Browser()
    status, _ = await browser.connect(base)
    assert status == 200
    await browser.pc.close()  # it had the answer, then vanished before ICE finished
    await until(lambda: len(sessions) == 0 and not webrtc.peers, within=15)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_twenty_connections_leave_no_task_or_thread_behind(endpoint, tts_engine):
    base, webrtc, sessions = endpoint

    async def cycle(talk: bool) -> None:
        browser = await connected(base)
        if talk:
            browser.mic.say(speech(tts_engine, "Say hi."))
            await browser.wait_for(ev.RESPONSE_CREATED, within=30)
        await browser.close()  # mid-reply, when it talked
        await until(lambda: len(sessions) == 0 and not webrtc.peers)

    await cycle(talk=True)  # warm: executors and engine threads that stay by design
    await asyncio.sleep(0.5)
    tasks = {t.get_name() for t in asyncio.all_tasks()}
    threads = threading.active_count()
    for i in range(20):
        await cycle(talk=i % 5 == 0)
    await asyncio.sleep(1.0)
    left = {t.get_name() for t in asyncio.all_tasks()} - tasks
    assert not left, left
    assert threading.active_count() <= threads + 1, threading.enumerate()
