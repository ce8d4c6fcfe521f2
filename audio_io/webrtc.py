"""WebRTC transport (aiortc): one peer connection per session, audio both ways and an
``events`` data channel; here the peer connection, its signalling (the offer checked,
then answered) and its data channel. The audio it carries (the paced outbound track,
the inbound jitter buffer and frames) is `audio_io.webrtc_audio`.

    browser mic ─Opus─► remote track ─► _pump ─► on_audio(48 kHz mono AudioFrame)
    the output stage's Outbox ─► OutboundTrack (``track``) ─Opus─► browser
    send(json) ─► data channel "events" ─► browser;   browser ─► "events" ─► on_message(text)

Lifecycle: the peer closes itself (and says so with `closed`) when ICE fails or the
browser closes, when it is not connected within ``connect_timeout_s``, or when no audio
has come in for ``inbound_timeout_s`` (a vanished browser, which ICE alone notices
late). The route that made it closes the session with it.

Limits, for offers from anyone (the offer is checked as text, `check_offer`, before
aiortc parses any of it):

- at most `MAX_CANDIDATES` ICE candidates (a browser offers a few per interface and
  ICE server): aioice pairs each remote candidate with the others in O(n²) on the
  event loop, so a large offer would hold the loop for minutes (docs/performance.md,
  "WebRTC"). No trickle: the offer's candidates are the only ones taken.
- at most `MAX_OFFER_CHARS` of SDP (browsers' offers are far smaller).
- an audio section that offers Opus (opus/48000/2), and the answer names Opus alone:
  the session takes the track's 48 kHz, and a G.722 or G.711 call would be heard as
  nothing. Browsers always offer Opus.

Events wait in aiortc's data channel queue, which has no bound, for a browser that
takes them (SCTP acknowledges what it reads). Audio cannot pile up (RTP is sent on the
track's clock and never waits), but events can, for a peer that keeps its audio flowing
and acknowledges no data: `stalled_s` and `overflowed` tell the route, and beyond
`MAX_BUFFERED_BYTES` events are dropped, so the queue stays bounded until it acts.

This module knows nothing of sessions or models: it converts wire formats.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

import aioice.ice
import av
import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
from aiortc.exceptions import OperationError
from aiortc.mediastreams import MediaStreamError

from audio_io.frame import AudioFrame
from audio_io.resample import downmix
from audio_io.webrtc_audio import RATE, AudioJitterBuffer, OutboundTrack, interleaved_int16

log = logging.getLogger("duplex.webrtc")

MAX_PENDING_MESSAGES = 256  # events kept for a data channel that is not open yet
MAX_GAP = RATE // 2  # lost audio up to this long is kept as silence (longer: a new start)
MAX_CANDIDATES = 64  # ICE candidates in one offer (browsers: ~2-20); aioice adds them in O(n²)
MAX_OFFER_CHARS = 64 * 1024  # an offer's SDP (browsers: 2-10 KB)
MAX_BUFFERED_BYTES = 1 << 20  # events the browser has not taken; beyond, they are dropped
OPUS = [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType.lower() == "audio/opus"]
_JITTER_BUFFER = "_RTCRtpReceiver__jitter_buffer"  # aiortc's, replaced by AudioJitterBuffer

_interfaces = aioice.ice.get_host_addresses


def set_host_addresses(addresses: list[str] | None) -> None:
    """Which local addresses ICE offers as host candidates, process-wide: exactly these,
    or (None) every interface's plus 127.0.0.1, so a browser on this machine (or in a
    network namespace with only loopback, as in the tests) can connect. aioice itself
    never offers loopback and has no setting for it."""

    def host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        if addresses is not None:
            return [a for a in addresses if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]
        found = _interfaces(use_ipv4, use_ipv6)
        return [*found, "127.0.0.1"] if use_ipv4 and "127.0.0.1" not in found else found

    aioice.ice.get_host_addresses = host_addresses


def ice_ufrag(sdp: str) -> str:
    """An SDP's ICE username fragment: one per peer connection ("" if none)."""
    for line in sdp.splitlines():
        if line.startswith("a=ice-ufrag:"):
            return line.split(":", 1)[1].strip()
    return ""


class OfferError(Exception):
    """An SDP offer this transport cannot answer; ``code`` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def audio_codecs(sdp: str) -> list[str] | None:
    """The codecs an SDP's audio sections offer, as named (``opus/48000/2``, or ``payload
    type 9`` where no ``a=rtpmap`` names one); None if it has no audio section."""
    codecs: list[str] | None = None
    in_audio, types, names = False, list[str](), dict[str, str]()  # the section being read
    for line in [*sdp.splitlines(), "m="]:  # the last "m=" ends the last section
        if line.startswith("m="):
            if in_audio:
                codecs = [*(codecs or []), *(names.get(pt, f"payload type {pt}") for pt in types)]
            in_audio, types, names = line.startswith("m=audio "), line.split()[3:], {}
        elif in_audio and line.startswith("a=rtpmap:"):
            payload_type, _, name = line[len("a=rtpmap:") :].partition(" ")
            names[payload_type] = name.strip()
    return codecs


def check_offer(sdp: str) -> None:
    """Raise `OfferError` for an offer this transport will not hand to aiortc: too many
    ICE candidates, too long, no audio, or no Opus. Plain text scans, linear in the
    offer, so they cost nothing next to what they spare: aiortc and aioice parse and
    pair everything in one go on the event loop."""
    candidates = sdp.count("a=candidate:")
    if candidates > MAX_CANDIDATES:
        raise OfferError(
            "too_many_candidates",
            f"the offer has {candidates} ICE candidates; at most {MAX_CANDIDATES} are taken",
        )
    if len(sdp) > MAX_OFFER_CHARS:
        raise OfferError("offer_too_large", f"the offer is {len(sdp)} characters; at most {MAX_OFFER_CHARS}")
    codecs = audio_codecs(sdp)
    if codecs is None:
        raise OfferError("no_audio", "the offer has no audio section (m=audio)")
    if not any(name.lower().startswith("opus/48000") for name in codecs):
        raise OfferError(
            "unsupported_codec",
            f"the offer's audio codecs ({', '.join(codecs) or 'none'}) do not include Opus "
            "(opus/48000/2), the one this server takes",
        )


def _ice_servers(urls: list[str], username: str | None, credential: str | None) -> list[RTCIceServer]:
    return [RTCIceServer(urls=url, username=username, credential=credential) for url in urls]


class WebRtcPeer:
    """One browser's peer connection. `answer` takes its offer; ``track.outbox`` carries
    the reply's audio to it, `send` the events."""

    def __init__(
        self,
        ice_urls: list[str] | None = None,
        ice_username: str | None = None,
        ice_credential: str | None = None,
        connect_timeout_s: float = 15.0,
        inbound_timeout_s: float = 5.0,
    ) -> None:
        config = RTCConfiguration(iceServers=_ice_servers(ice_urls or [], ice_username, ice_credential))
        self.pc = RTCPeerConnection(config)
        self.track = OutboundTrack()
        self.closed = asyncio.Event()
        self.connect_timeout_s = connect_timeout_s
        self.inbound_timeout_s = inbound_timeout_s
        self.remote_ufrag = ""
        self.frames_received = 0
        self._channel: RTCDataChannel | None = None  # once the browser opens it
        self._pending: collections.deque[str] = collections.deque(maxlen=MAX_PENDING_MESSAGES)
        self.overflowed = False  # an event was dropped: the browser took none of `MAX_BUFFERED_BYTES`
        self._bytes_sent = 0  # handed to the channel; less its bufferedAmount: taken by SCTP
        self._taken = 0
        self._taken_at = time.monotonic()  # when SCTP last took some, or the channel was last empty
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_inbound = time.monotonic()
        self._on_audio: Callable[[AudioFrame], None] = lambda frame: None
        self._on_message: Callable[[str], Awaitable[None]] | None = None

    # -- signalling --

    async def answer(
        self,
        sdp: str,
        on_audio: Callable[[AudioFrame], None],
        on_message: Callable[[str], Awaitable[None]],
    ) -> str:
        """Take the browser's offer and return the answer SDP, with every ICE candidate
        in it (no trickle). Raises `OfferError` for an offer that cannot be answered, and
        for one over the limits (`check_offer`) before aiortc has parsed any of it."""
        check_offer(sdp)
        self._on_audio, self._on_message = on_audio, on_message
        pc = self.pc
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_state)
        # Ours before the offer's, so that it takes the first audio section with Opus alone
        # (aiortc would otherwise answer with the offer's first common codec: G.722, say).
        pc.addTransceiver(self.track).setCodecPreferences(OPUS)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except OperationError as e:  # aiortc: a section with no codec in common
            raise OfferError("unsupported_codec", f"no codec in common with the offer: {e}") from None
        except Exception as e:  # aiortc raises ValueError, KeyError, ... on malformed SDP
            raise OfferError("bad_sdp", f"the offer is not valid SDP: {e or type(e).__name__}") from None
        await pc.setLocalDescription(await pc.createAnswer())
        self.remote_ufrag = ice_ufrag(sdp)
        self._spawn(self._watch(), "webrtc-watchdog")
        return str(pc.localDescription.sdp)

    # -- inbound --

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio":
            return
        for transceiver in self.pc.getTransceivers():
            receiver = transceiver.receiver
            if receiver.track is track and hasattr(receiver, _JITTER_BUFFER):
                setattr(receiver, _JITTER_BUFFER, AudioJitterBuffer())
        self._spawn(self._pump(track), "webrtc-inbound")

    async def _pump(self, track: MediaStreamTrack) -> None:
        expected: int | None = None  # the RTP timestamp the next frame should have
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, av.AudioFrame)
            self._last_inbound = time.monotonic()
            self.frames_received += 1
            if expected is not None and frame.pts is not None and 0 < frame.pts - expected <= MAX_GAP:
                self._on_audio(AudioFrame(np.zeros(frame.pts - expected, np.int16), frame.sample_rate))
            if frame.pts is not None:
                expected = frame.pts + frame.samples
            samples = downmix(interleaved_int16(frame), len(frame.layout.channels))
            self._on_audio(AudioFrame(samples, frame.sample_rate))

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != "events":
            return
        self._channel = channel
        channel.on("message", self._on_channel_message)
        channel.on("close", lambda: self._spawn(self.close(), "webrtc-close"))
        while self._pending:
            self._send_now(self._pending.popleft())

    def _on_channel_message(self, message: str | bytes) -> None:
        if self._on_message is None:
            return
        text = message if isinstance(message, str) else message.decode("utf-8", errors="replace")
        self._spawn(self._on_message(text), "webrtc-message")

    # -- outbound --

    def send(self, text: str) -> None:
        """A message on the ``events`` channel (kept until the browser opens it)."""
        if self._channel is None:
            self._pending.append(text)
        else:
            self._send_now(text)

    def _send_now(self, text: str) -> None:
        channel = self._channel
        if channel is None or channel.readyState != "open":
            return
        self._note_taken(time.monotonic())
        if channel.bufferedAmount > MAX_BUFFERED_BYTES:
            self.overflowed = True  # dropped: memory stays bounded until the route ends the peer
            return
        before = channel.bufferedAmount
        channel.send(text)
        self._bytes_sent += channel.bufferedAmount - before  # as aiortc counts it (UTF-8 bytes)

    def _note_taken(self, now: float) -> None:
        """Progress on the channel: SCTP took some of what waited (aiortc lowers
        bufferedAmount as it takes messages into the association, which the browser
        must acknowledge first), or nothing waits at all."""
        assert self._channel is not None
        buffered = self._channel.bufferedAmount
        taken = self._bytes_sent - buffered
        if buffered == 0 or taken > self._taken:
            self._taken, self._taken_at = taken, now

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds events have waited on the ``events`` channel with none taken by the
        browser (0 while none wait): a peer that acknowledges no data."""
        if self._channel is None:
            return 0.0  # kept in `_pending`, bounded, until the browser opens it
        now = time.monotonic() if now is None else now
        self._note_taken(now)
        return 0.0 if self._channel.bufferedAmount == 0 else now - self._taken_at

    # -- lifecycle --

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._spawn(self.close(), "webrtc-close")

    async def _watch(self) -> None:
        """Close a peer that never connects, or whose audio stopped coming."""
        started = time.monotonic()
        while not self.closed.is_set():
            await asyncio.sleep(0.5)
            now = time.monotonic()
            if self.pc.connectionState != "connected":
                if now - started > self.connect_timeout_s:
                    log.info("webrtc peer not connected after %.0f s: closed", self.connect_timeout_s)
                    break
            elif now - self._last_inbound > self.inbound_timeout_s and self.frames_received:
                log.info("webrtc peer sent no audio for %.0f s: closed", self.inbound_timeout_s)
                break
        await self.close()

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("webrtc task %s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        """Close the peer connection and stop every task of it; idempotent."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.track.stop()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await self.pc.close()
        await asyncio.gather(*tasks, return_exceptions=True)
