"""A WebRTC client for the tests, on aiortc: the other end of a browser's peer connection.

It offers one audio track (a "microphone" playing given audio in real time, then
silence) and an ``events`` data channel, posts the offer to ``/webrtc/offer``, records
every event and every frame of audio it receives.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import aiohttp
import av
import numpy as np
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from audio_io.resample import downmix, resample
from audio_io.webrtc_audio import FRAME, RATE, audio_frame, interleaved_int16


class Microphone(MediaStreamTrack):
    """Plays queued 16 kHz audio as 20 ms 48 kHz frames in real time, silence between."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: collections.deque[tuple[np.ndarray, bool]] = collections.deque()
        self._start: float | None = None
        self._pts = 0
        self.spoken_at: list[float] = []  # when each say() began to play

    def say(self, samples_16k: np.ndarray) -> None:
        audio = resample(samples_16k, 16000, RATE)
        audio = np.concatenate([audio, np.zeros(-audio.size % FRAME, np.int16)])
        first = True
        for i in range(0, audio.size, FRAME):
            self._queue.append((audio[i : i + FRAME], first))
            first = False

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        due = self._start + self._pts / RATE
        if (delay := due - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        if self._queue:
            samples, first = self._queue.popleft()
            if first:
                self.spoken_at.append(time.monotonic())
        else:
            samples = np.zeros(FRAME, np.int16)
        frame = audio_frame(samples, self._pts)
        self._pts += FRAME
        return frame


class Browser:
    """One client peer connection to the server."""

    def __init__(self) -> None:
        self.pc = RTCPeerConnection()
        self.mic = Microphone()
        self.events: list[dict[str, Any]] = []
        self.received: list[tuple[float, np.ndarray]] = []  # (arrival, 48 kHz mono int16)
        self.channel = self.pc.createDataChannel("events")
        self.channel_open = asyncio.Event()
        self.session_id = ""
        self._tasks: list[asyncio.Task[None]] = []
        self.pc.addTrack(self.mic)
        self.channel.on("open", self.channel_open.set)
        self.channel.on("message", lambda m: self.events.append(json.loads(m)))
        self.pc.on("track", self._on_track)

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._tasks.append(asyncio.ensure_future(self._listen(track)))

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, av.AudioFrame)
            samples = downmix(interleaved_int16(frame), len(frame.layout.channels))
            self.received.append((time.monotonic(), samples))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return str(self.pc.localDescription.sdp)

    async def connect(self, base_url: str, **body: Any) -> tuple[int, dict[str, Any]]:
        """Post the offer and, if answered, apply the answer; returns the HTTP status and body."""
        sdp = await self.offer()
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{base_url}/webrtc/offer", json={"type": "offer", "sdp": sdp, **body}) as response,
        ):
            status, payload = response.status, await response.json()
        if status == 200:
            self.session_id = payload["session_id"]
            await self.pc.setRemoteDescription(RTCSessionDescription(payload["sdp"], "answer"))
        return status, payload

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(json.dumps(message))

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type_]

    async def wait_for(self, type_: str, within: float = 30.0, count: int = 1) -> list[dict[str, Any]]:
        deadline = time.monotonic() + within
        while len(self.of_type(type_)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {type_} in {within} s; events: {[e['type'] for e in self.events]}")
            await asyncio.sleep(0.02)
        return self.of_type(type_)

    def audio(self, since: float = 0.0) -> np.ndarray:
        parts = [a for t, a in self.received if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    async def close(self) -> None:
        await self.pc.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
