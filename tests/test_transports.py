"""The contract every transport's output keeps (duplex/transports/output.py, link.py):
the five adapters (WebRTC, gRPC, Twilio, SIP, Realtime) behind one `OutputStage`, each
driven as the session drives it, and read back from its wire messages.

- the voice's audio goes out as whole 20 ms frames at the wire's rate, the last one
  padded at the end of a reply that played out, nothing more of one that was cut;
- `flush` (barge-in) drops every frame still queued;
- a reader that reads nothing holds at most the outbox's bound, never more;
- closing is idempotent, and nothing is queued after it;
- a `Link` closes the session and the connection once, whichever side ends first.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from audio_io._proto import duplex_pb2 as pb
from audio_io.frame import AudioFrame
from audio_io.grpc_codec import WireFormat
from audio_io.rtp import PCMU
from audio_io.webrtc import WebRtcPeer
from duplex import events as ev
from duplex.events import Event
from duplex.transports.grpc_messages import GrpcWire, server_event
from duplex.transports.link import Link
from duplex.transports.output import OutputStage
from duplex.transports.realtime import RealtimeConnection, RealtimeWire
from duplex.transports.realtime_config import RealtimeSessionConfig
from duplex.transports.sip_media import RtpWire
from duplex.transports.twilio import MAX_QUEUED_MEDIA, TwilioWire
from duplex.transports.webrtc import PeerWire

VOICE_RATE = 22050
FRAME_IN = VOICE_RATE // 50  # 20 ms of the voice


@dataclass
class Adapter:
    name: str
    stage: OutputStage[Any]
    frame_samples: int  # a 20 ms frame at the wire's rate
    audio: Callable[[Any], int | None]  # a wire message -> its samples, None if not audio


def _twilio() -> Adapter:
    def samples(message: str) -> int | None:
        m = json.loads(message)
        return len(base64.b64decode(m["media"]["payload"])) if m["event"] == "media" else None

    return Adapter("twilio", OutputStage(TwilioWire("MZ1", VOICE_RATE)), 160, samples)


def _grpc() -> Adapter:
    def samples(message: pb.ServerEvent) -> int | None:
        return len(message.audio.data) // 2 if message.HasField("audio") else None

    return Adapter("grpc", OutputStage(GrpcWire(WireFormat(pb.PCM16, 24000))), 480, samples)


def _sip() -> Adapter:
    return Adapter("sip", OutputStage(RtpWire(PCMU)), 160, len)


def _realtime() -> Adapter:
    connection = RealtimeConnection(None, RealtimeSessionConfig("sess", "voice", "", 100))  # type: ignore[arg-type]

    def samples(message: str) -> int | None:
        m = json.loads(message)
        return len(base64.b64decode(m["delta"])) // 2 if m["type"] == "response.output_audio.delta" else None

    return Adapter("realtime", OutputStage(RealtimeWire(connection), connection.outbox), 480, samples)


def _webrtc() -> Adapter:
    peer = WebRtcPeer()
    return Adapter("webrtc", OutputStage(PeerWire(peer), peer.track.outbox), 960, lambda s: s.size)


ADAPTERS = [_webrtc, _grpc, _twilio, _sip, _realtime]


def voice(seconds: float) -> list[AudioFrame]:
    n = int(seconds * VOICE_RATE)
    tone = (np.sin(np.arange(n) / VOICE_RATE * 2 * np.pi * 300) * 8000).astype(np.int16)
    return [AudioFrame(tone[i : i + FRAME_IN], VOICE_RATE) for i in range(0, n, FRAME_IN)]


def sent_audio(adapter: Adapter) -> list[int]:
    """The samples of each audio message queued for the wire, in order."""
    sizes = [adapter.audio(message) for message in adapter.stage.outbox.take()]
    return [size for size in sizes if size is not None]


@pytest.fixture(params=ADAPTERS, ids=lambda make: make.__name__.strip("_"))
def adapter(request: pytest.FixtureRequest) -> Adapter:
    return request.param()


async def test_a_reply_goes_out_in_whole_20ms_frames_with_its_last_one_padded(adapter: Adapter):
    for frame in voice(1.01):  # 1.01 s: the last 20 ms frame is partial
        adapter.stage.audio(frame, "resp_1")
    before_end = len(sent_audio(adapter))
    adapter.stage.end_reply("resp_1", completed=True)
    tail = sent_audio(adapter)
    assert 49 <= before_end <= 50
    assert len(tail) >= 1 and before_end + len(tail) == 51  # 1.01 s = 50.5 frames: padded to 51
    assert set(tail) == {adapter.frame_samples}


async def test_a_cut_reply_sends_nothing_more(adapter: Adapter):
    for frame in voice(0.51):
        adapter.stage.audio(frame, "resp_1")
    sent_audio(adapter)
    adapter.stage.end_reply("resp_1", completed=False)
    assert sent_audio(adapter) == []


@pytest.mark.parametrize("make", ADAPTERS, ids=lambda make: make.__name__.strip("_"))
async def test_flush_drops_every_frame_still_queued(make: Callable[[], Adapter]):
    adapter, fresh = make(), make()
    for frame in voice(0.5):
        adapter.stage.audio(frame, "resp_1")
    assert adapter.stage.outbox.frames >= 20
    adapter.stage.flush()
    assert sent_audio(adapter) == [] and adapter.stage.outbox.frames == 0
    adapter.stage.end_reply("resp_1", completed=True)  # nothing held back survives the flush
    assert sent_audio(adapter) == []
    for stage in (adapter.stage, fresh.stage):  # the next reply goes out as on a new connection
        for frame in voice(0.2):
            stage.audio(frame, "resp_2")
        stage.end_reply("resp_2", completed=True)
    expected = sent_audio(fresh)
    assert len(expected) >= 10 and set(expected) == {adapter.frame_samples}
    assert sent_audio(adapter) == expected


async def test_a_reader_that_reads_nothing_holds_only_the_bound(adapter: Adapter):
    for frame in voice(12.0):  # 600 frames, more than twice the bound
        adapter.stage.audio(frame, "resp_1")
    bound = adapter.stage.outbox.max_frames
    assert bound == MAX_QUEUED_MEDIA == 250
    assert adapter.stage.outbox.frames == bound
    assert len(sent_audio(adapter)) == bound


async def test_close_is_idempotent_and_ends_the_output(adapter: Adapter):
    for frame in voice(0.2):
        adapter.stage.audio(frame, "resp_1")
    adapter.stage.close()
    adapter.stage.close()
    for frame in voice(0.2):
        adapter.stage.audio(frame, "resp_1")
    adapter.stage.end_reply("resp_1", completed=True)
    assert sent_audio(adapter) == []


class _Session:
    """The side of a `SessionPort` a link watches (a test double for the unit)."""

    id = "sess_test"

    def __init__(self) -> None:
        self.closed = asyncio.Event()


@pytest.mark.parametrize("first", ["connection", "session"])
async def test_a_link_closes_both_sides_once_whichever_ends_first(first: str):
    session = _Session()
    calls: list[str] = []

    async def close_session() -> None:
        calls.append("session")
        session.closed.set()

    async def close_connection() -> None:
        calls.append("connection")

    link = Link(session, close_session, close_connection, lambda: calls.append("output"))  # type: ignore[arg-type]
    writer = link.own(asyncio.sleep(3600), "writer")
    if first == "session":
        session.closed.set()  # idle timeout, shutdown
        await asyncio.wait_for(link.closed.wait(), 5)
    await asyncio.gather(link.close(), link.close())
    await link.close()
    assert calls == ["output", "session", "connection"]
    assert writer.cancelled()
    assert link.ended_by_session is (first == "session")


class _Reported(_Session):
    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []

    def send_error(self, error: Any) -> None:
        self.errors.append(error.code)


@pytest.mark.parametrize("reader", ["stops", "keeps_up"])
async def test_a_link_whose_client_stops_reading_closes_within_the_timeout(reader: str):
    from audio_io.outbox import Outbox

    session = _Reported()
    outbox: Outbox[str] = Outbox(max_frames=5)
    taken: list[str] = []

    async def close_session() -> None:
        session.closed.set()

    async def noop() -> None:
        pass

    link = Link(session, close_session, noop)  # type: ignore[arg-type]
    link.watch_reader(outbox, timeout_s=0.4)

    async def writer() -> None:  # a send that blocks for good when the client stops reading
        while True:
            taken.append(await outbox.get())
            if reader == "stops":
                await asyncio.Event().wait()

    link.own(writer(), "writer")
    for i in range(40):  # 20 ms frames for 0.8 s: twice the timeout
        outbox.put_frame([f"frame {i}"])
        await asyncio.sleep(0.02)
    if reader == "stops":
        assert link.closed.is_set() and link.stalled and session.errors == ["slow_reader"]
        assert len(taken) == 1 and outbox.stalled_s() > 0.4
    else:
        assert not link.closed.is_set() and not session.errors and len(taken) == 40
        assert outbox.stalled_s() == 0.0
        await link.close()


def test_a_tool_timeout_reaches_a_grpc_client_as_an_error_naming_the_call():
    timeout = Event(ev.TOOL_TIMEOUT, {"call_id": "call_1", "name": "get_weather", "timeout_s": 15.0})
    message = server_event(timeout)
    assert message is not None and message.WhichOneof("event") == "error"
    assert message.error.code == "tool_timeout"
    assert "call_1" in message.error.message and "get_weather" in message.error.message
