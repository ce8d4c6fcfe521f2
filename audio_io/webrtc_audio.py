"""WebRTC audio as aiortc carries it, both ways, at Opus's 48 kHz: the outbound track
that paces the reply, and the inbound side's jitter buffer and frame conversion.

    Outbox of 20 ms frames at 48 kHz (filled by the transport's output stage) ─► OutboundTrack ─Opus─► browser
    browser ─Opus─► RTP ─► AudioJitterBuffer ─► aiortc's decoder ─► av.AudioFrame ─► interleaved_int16

Pacing: while a reply plays, the session's Pacer is the only clock. aiortc's sender asks
the track for one frame at a time and reads nothing ahead, so `OutboundTrack.recv`
hands over each pushed frame as it arrives; with nothing pushed it sends silence on its
own 20 ms grid, so RTP timestamps stay continuous and the browser's jitter buffer never
sees a gap. A barge-in (`Outbox.drop_audio`) therefore drops at most the frame or two
still here.

The peer connection that uses these is `audio_io.webrtc.WebRtcPeer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import time

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtpPacket

from audio_io.frame import Int16Array
from audio_io.outbox import Outbox

RATE = 48000  # Opus in WebRTC
FRAME = RATE // 50  # 20 ms
PERIOD = 0.020
SLACK_IDLE = 0.005  # between replies, silence goes out this late for its slot
SLACK_PLAYING = 0.030  # mid-reply, a late frame (a busy machine) beats a 20 ms hole in the voice


class OutboundTrack(MediaStreamTrack):
    """48 kHz mono 20 ms frames for aiortc to encode: pushed audio as it comes, silence
    on a 20 ms grid when there is none."""

    kind = "audio"

    def __init__(self, outbox: Outbox[Int16Array] | None = None) -> None:
        super().__init__()
        self.outbox: Outbox[Int16Array] = outbox if outbox is not None else Outbox()
        self._next: float | None = None  # when the next frame is due if nothing is pushed
        self._playing = False  # the last frame was pushed audio
        self._pts = 0
        self._silence = np.zeros(FRAME, np.int16)
        self.frames_sent = 0  # pushed frames handed to the encoder

    def push(self, samples: Int16Array) -> None:
        if samples.size != FRAME:
            raise ValueError(f"OutboundTrack takes {FRAME}-sample frames, got {samples.size}")
        self.outbox.put_frame([samples])

    def flush(self) -> int:
        """Drop every frame not yet handed to the encoder; returns how many."""
        return self.outbox.drop_audio()

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._next is None or self._next < now - 0.1:  # first frame, or after a stall: no burst
            self._next = now
        slack = SLACK_PLAYING if self._playing else SLACK_IDLE
        pushed = self.outbox.next_audio()
        while pushed is None:
            remaining = self._next + slack - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.outbox.ready.wait(), remaining)
            pushed = self.outbox.next_audio()
        self._playing = pushed is not None
        if pushed is not None:
            samples = pushed
            self.frames_sent += 1
            self._next = time.monotonic() + PERIOD
        else:
            samples = self._silence
            self._next += PERIOD
        frame = audio_frame(samples, self._pts)
        self._pts += FRAME
        return frame


def audio_frame(samples: Int16Array, pts: int) -> av.AudioFrame:
    """48 kHz mono int16 samples as the frame aiortc encodes; ``pts`` counts samples."""
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = RATE
    frame.time_base = fractions.Fraction(1, RATE)
    frame.pts = pts
    return frame


def interleaved_int16(frame: av.AudioFrame) -> Int16Array:
    """A decoded frame's samples as interleaved int16 (Opus decodes to packed s16)."""
    raw = frame.to_ndarray()
    if frame.format.is_planar:  # (channels, samples) -> interleaved
        raw = raw.T
    raw = raw.reshape(-1)
    if raw.dtype == np.int16:
        return raw.astype(np.int16, copy=False)
    if np.issubdtype(raw.dtype, np.floating):
        return np.clip(np.rint(raw * 32767), -32768, 32767).astype(np.int16)
    return (raw.astype(np.int64) >> (8 * raw.dtype.itemsize - 16)).astype(np.int16)  # wider integers


class AudioJitterBuffer:
    """Takes the place of aiortc's audio jitter buffer: each packet is released at once,
    in order, and a missing one is given up as soon as a later one comes.

    aiortc's own (capacity 16, prefetch 4) is built for video frames of many packets: it
    holds a frame until the next one has begun, four deep, and holds everything behind a
    missing packet until 16 have piled up, then drops the lot (what that cost the
    caller's audio: docs/performance.md, "WebRTC"). An Opus packet is a whole frame, so
    none of that waiting is needed. The pump fills a lost packet's 20 ms with silence (from the
    RTP timestamps), so time is kept; a packet that comes after its gap was given up
    (reordered) is dropped."""

    MAX_MISORDER = 100  # further behind than this: the sender restarted its numbering

    def __init__(self) -> None:
        self._next: int | None = None  # the sequence number expected next

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        """The receiver's call: (whether to ask for a picture, the frame to decode)."""
        seq = packet.sequence_number
        if self._next is not None:
            behind = (self._next - seq) % 65536
            if 0 < behind <= self.MAX_MISORDER:
                return False, None  # late or repeated
        self._next = (seq + 1) % 65536
        return False, JitterFrame(data=packet._data, timestamp=packet.timestamp)  # type: ignore[attr-defined]
