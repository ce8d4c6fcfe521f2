"""``duplex bench soak``: does the service give back everything each connection took?

A real ``duplex serve`` (the configured models, SIP on) runs in a child process on free
loopback ports; this process is its clients.

- ``--cycles N``: N cycles; each connects one client on every transport in turn, sends
  200 ms of silence through its media path, and disconnects: Realtime WebSocket, Twilio
  Media Streams, gRPC ``Converse`` (half-closed on even cycles, cancelled on odd ones),
  WebRTC (aiortc: offer, ICE and DTLS, data channel open), SIP (INVITE, ACK, RTP, BYE).
  The server's ``/metrics`` (RSS, open fds, asyncio tasks, threads, open sessions) is
  read after a warm-up, once its sessions have closed (``before``), and again after
  the N cycles, once they have closed (``after``): growth is after - before.
- ``--minutes M``: one gRPC session held M minutes (0: none), silence streamed in real
  time with a spoken question every 30 s; each reply's voice-to-voice and its steps as
  the server measured them (``duplex.turn.metrics``), and their medians by quarter of
  the session: flat when the last quarter's is the first's.

RSS is read as the kernel counts it: memory the process freed but glibc has not given
back yet counts too, so it climbs and then falls at once; growth over a run is the
figure, the series shows the saw.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import av
import grpc
import numpy as np
import psutil
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from prometheus_client.parser import text_string_to_metric_families

from audio_io import sip
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from audio_io.rtp import RtpPacket
from audio_io.webrtc import set_host_addresses
from audio_io.webrtc_audio import FRAME, RATE, audio_frame
from benchmarks.common import bench_main, free_port, new_plot, percentiles, save_plot
from benchmarks.conversation import QUESTIONS
from duplex.config import Config
from duplex.grpc_client import DuplexClient
from models.cpu_variant import cpu_description

log = logging.getLogger("duplex.bench.soak")

CYCLES = 100
TRANSPORTS = ("realtime", "twilio", "grpc", "webrtc", "sip")
SILENCE_FRAMES = 10  # 20 ms each, per connection: enough to run every media path
TURN_EVERY_S = 30.0
SETTLE_S = 30.0  # longest wait for closed sessions to give back their tasks and sockets
# what the child `duplex serve` takes from the bench's configuration
MODEL_KEYS = (
    "asr", "vad", "voice", "llm", "llm_dtype", "llm_quantization", "llm_execution",
    "llm_max_tokens", "llm_max_context", "cache_dir", "asr_workers",
)  # fmt: skip
# the server's figures, from /metrics: name, scale
WATCHED = {
    "rss_mb": ("process_resident_memory_bytes", 2**-20),
    "fds": ("process_open_fds", 1.0),
    "tasks": ("duplex_asyncio_tasks", 1.0),
    "threads": ("duplex_threads", 1.0),
    "sessions": ("duplex_sessions_active", 1.0),
}

Snapshot = dict[str, float]


class SoakError(Exception):
    """A client did not get what its protocol promises."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise SoakError(what)


class Server:
    """``duplex serve`` in a child process on free loopback ports, its log in a file."""

    def __init__(self, config: Config, log_path: Path) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.sip_port = free_port(socket.SOCK_DGRAM)
        self.log_path = log_path
        flags = [f"--{k.replace('_', '-')}={getattr(config, k)}" for k in MODEL_KEYS if getattr(config, k)]
        ports = [f"--port={self.port}", f"--grpc-port={self.grpc_port}", f"--sip-port={self.sip_port}"]
        command = [sys.executable, "-m", "duplex", "serve", "--host", "127.0.0.1", *ports, *flags]
        command += ["--webrtc-host-addresses", "127.0.0.1", "--log-level", "info"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")} | {"HF_HUB_OFFLINE": "1"}
        with log_path.open("w") as out:  # a file, not a pipe: nobody has to keep reading it
            self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"

    async def ready(self, http: aiohttp.ClientSession, within: float = 600) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SoakError(f"duplex serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                async with http.get(f"{self.base}/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise SoakError(f"duplex serve not ready in {within:.0f} s:\n{self.log_tail()}")

    async def snapshot(self, http: aiohttp.ClientSession) -> Snapshot:
        async with http.get(f"{self.base}/metrics") as r:
            text = await r.text()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        out = {key: round(samples[name, ()] * scale, 1) for key, (name, scale) in WATCHED.items()}
        # RSS falls at the collector's full passes: garbage in reference cycles waits for them
        out["gc_full_passes"] = samples["python_gc_collections_total", (("generation", "2"),)]
        out["engine_rss_mb"] = round(self.children_rss() / 2**20, 1)
        return out

    def children_rss(self) -> int:
        """RSS of the server's child processes (the LLM's engine core): outside /metrics."""
        total = 0
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    async def settled(self, http: aiohttp.ClientSession, baseline: Snapshot | None = None) -> Snapshot:
        """The figures once no session is open and tasks and fds hold still for 1.5 s
        (with a ``baseline``: and are back to it), or as they are after `SETTLE_S`,
        which then shows what did not end."""
        deadline = time.monotonic() + SETTLE_S
        last: Snapshot | None = None
        still = 0
        while True:
            now = await self.snapshot(http)
            steady = last is not None and all(now[k] == last[k] for k in ("tasks", "fds"))
            back = baseline is None or all(now[k] <= baseline[k] for k in ("tasks", "fds"))
            still = still + 1 if steady and now["sessions"] == 0 and back else 0
            if still >= 3 or time.monotonic() > deadline:
                return now
            last = now
            await asyncio.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_problems(self) -> dict[str, Any]:
        """Tracebacks and ERROR lines in the log so far, and the first traceback."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
        first = "\n".join(lines[max(0, starts[0] - 2) : starts[0] + 20]) if starts else None
        errors = sum(1 for line in lines if " ERROR " in line)
        return {"tracebacks": len(starts), "error_lines": errors, "first_traceback": first}

    def stop(self) -> int | None:
        children = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            for p in [self.proc, *children]:
                try:
                    p.kill()
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            self.proc.wait()
            return None


class _Silence(MediaStreamTrack):
    """A microphone in a quiet room: 20 ms of silence at 48 kHz, in real time."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._pts = 0
        self._start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        self._start = self._start or time.monotonic()
        if (delay := self._start + self._pts / RATE - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        frame = audio_frame(np.zeros(FRAME, np.int16), self._pts)
        self._pts += FRAME
        return frame


def _sip_request(method: str, server: int, own: int, call_id: str, tag: str, to: str, cseq: int,
                 body: bytes = b"") -> bytes:  # fmt: skip
    lines = [
        f"{method} sip:duplex@127.0.0.1:{server} SIP/2.0",
        f"Via: SIP/2.0/UDP 127.0.0.1:{own};branch={sip.new_branch()};rport",
        "Max-Forwards: 70",
        f"From: <sip:soak@127.0.0.1>;tag={tag}",
        f"To: {to}",
        f"Call-ID: {call_id}",
        f"CSeq: {cseq} {method}",
        f"Contact: <sip:soak@127.0.0.1:{own}>",
        *(["Content-Type: application/sdp"] if body else []),
        f"Content-Length: {len(body)}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _sip_final(sock: socket.socket, method: str) -> sip.SipMessage:
    """The final response to our ``method`` (provisional ones and retransmissions skipped)."""
    loop = asyncio.get_running_loop()
    while True:
        message = sip.parse((await loop.sock_recvfrom(sock, 65536))[0])
        if not message.is_request and message.cseq[1] == method and message.status >= 200:
            return message


class Clients:
    """One client of each transport; each connects, sends silence and disconnects."""

    def __init__(self, server: Server, http: aiohttp.ClientSession) -> None:
        self.server = server
        self.http = http
        self.ws = f"ws://127.0.0.1:{server.port}"
        self.ms: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
        self.failures: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []

    async def cycle(self, i: int) -> None:
        for name in TRANSPORTS:
            client: Callable[[int], Awaitable[None]] = getattr(self, name)
            started = time.perf_counter()
            try:
                async with asyncio.timeout(30):
                    await client(i)
            except Exception as e:  # counted and reported: the soak goes on
                self.failures[name] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"{name}, cycle {i}: {e!r}")
            else:
                self.ms[name].append((time.perf_counter() - started) * 1000)

    async def realtime(self, i: int) -> None:
        async with self.http.ws_connect(f"{self.ws}/v1/realtime") as ws:
            created = await ws.receive_json(timeout=10)
            _expect(created.get("type") == "session.created", f"first event {created}")
            audio = base64.b64encode(bytes(SILENCE_FRAMES * 960)).decode()  # PCM16 at 24 kHz
            await ws.send_json({"type": "input_audio_buffer.append", "audio": audio})
            await asyncio.sleep(SILENCE_FRAMES * 0.02)

    async def twilio(self, i: int) -> None:
        sid, call = f"MZsoak{i}", f"CAsoak{i}"
        async with self.http.ws_connect(f"{self.ws}/telephony/twilio") as ws:
            await ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
            fmt = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
            start = {"streamSid": sid, "callSid": call, "accountSid": "ACsoak", "mediaFormat": fmt}
            await ws.send_json({"event": "start", "sequenceNumber": "1", "streamSid": sid, "start": start})
            payload = base64.b64encode(b"\xff" * 160).decode()  # 20 ms of mu-law silence
            for k in range(SILENCE_FRAMES):
                media = {
                    "track": "inbound",
                    "chunk": str(k + 1),
                    "timestamp": str(20 * k),
                    "payload": payload,
                }
                await ws.send_json({"event": "media", "streamSid": sid, "media": media})
            await ws.send_json({"event": "stop", "streamSid": sid, "stop": {"callSid": call}})
            async for _ in ws:  # the call ends: the server closes the socket
                pass
            _expect(ws.close_code == aiohttp.WSCloseCode.OK, f"closed with {ws.close_code}")

    async def grpc(self, i: int) -> None:
        async with DuplexClient(f"127.0.0.1:{self.server.grpc_port}") as client:
            conversation = await client.converse()
            for _ in range(SILENCE_FRAMES):
                await conversation.send_audio(bytes(640))  # PCM16 at 16 kHz
            if i % 2:  # hung up
                conversation.abort()
                return
            await conversation.close()  # half-closed: the stream ends once it has gone quiet
            async for _ in conversation:
                pass
            code, details = await conversation.status()
            _expect(code == grpc.StatusCode.OK, f"ended with {code}: {details}")

    async def webrtc(self, i: int) -> None:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        try:
            opened = asyncio.Event()
            channel = pc.createDataChannel("events")
            channel.on("open", opened.set)
            pc.addTrack(_Silence())
            await pc.setLocalDescription(await pc.createOffer())
            offer = {"type": "offer", "sdp": pc.localDescription.sdp}
            async with self.http.post(f"{self.server.base}/webrtc/offer", json=offer) as r:
                answer = await r.json()
                _expect(r.status == 200, f"offer answered {r.status}: {answer}")
            await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))
            await opened.wait()
            await asyncio.sleep(SILENCE_FRAMES * 0.02)
        finally:
            await pc.close()

    async def sip(self, i: int) -> None:
        loop = asyncio.get_running_loop()
        with (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as signalling,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as media,
        ):
            for s in (signalling, media):
                s.bind(("127.0.0.1", 0))
                s.setblocking(False)
            server, own = self.server.sip_port, signalling.getsockname()[1]
            target = ("127.0.0.1", server)
            call_id, tag = f"soak-{i}-{sip.new_tag()}", sip.new_tag()
            sdp = (
                f"v=0\r\no=- {i} 1 IN IP4 127.0.0.1\r\ns=soak\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                f"m=audio {media.getsockname()[1]} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
                "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\n"
            ).encode()
            request = _sip_request("INVITE", server, own, call_id, tag, "<sip:duplex@127.0.0.1>", 1, sdp)
            await loop.sock_sendto(signalling, request, target)
            ok = await _sip_final(signalling, "INVITE")
            _expect(ok.status == 200, f"INVITE answered {ok.status} {ok.reason}")
            to = ok.get("to")
            await loop.sock_sendto(signalling, _sip_request("ACK", server, own, call_id, tag, to, 1), target)
            rtp = ("127.0.0.1", sip.parse_offer(ok.body).port)
            for k in range(SILENCE_FRAMES):
                await loop.sock_sendto(media, RtpPacket(0, k, k * 160, 4321, b"\xff" * 160).build(), rtp)
                await asyncio.sleep(0.02)
            await loop.sock_sendto(signalling, _sip_request("BYE", server, own, call_id, tag, to, 2), target)
            done = await _sip_final(signalling, "BYE")
            _expect(done.status == 200, f"BYE answered {done.status} {done.reason}")


def _growth(before: Snapshot, after: Snapshot) -> Snapshot:
    return {k: round(after[k] - before[k], 1) for k in before if k not in ("sessions", "gc_full_passes")}


async def run_cycles(server: Server, http: aiohttp.ClientSession, cycles: int, warmup: int) -> dict[str, Any]:
    clients = Clients(server, http)
    for i in range(warmup):  # first use: lazy imports, pools and caches fill once
        await clients.cycle(-1 - i)
    before = await server.settled(http)
    log.info("soak: baseline after %d warm-up cycles: %s", warmup, before)
    clients = Clients(server, http)
    every = max(1, cycles // 50)
    series: list[list[float]] = []
    started = time.perf_counter()
    for i in range(cycles):
        await clients.cycle(i)
        if (i + 1) % every == 0:
            now = await server.snapshot(http)
            series.append(
                [i + 1, now["rss_mb"], now["fds"], now["tasks"], now["sessions"], now["gc_full_passes"]]
            )
            log.info("soak: cycle %d/%d: %s", i + 1, cycles, now)
    wall = time.perf_counter() - started
    after = await server.settled(http, before)
    growth = _growth(before, after)
    log.info(
        "soak: %d cycles in %.0f s: RSS %+.1f MB, open fds %+d, asyncio tasks %+d, threads %+d, "
        "sessions left %d, failed connections %d",
        cycles, wall, growth["rss_mb"], growth["fds"], growth["tasks"], growth["threads"],
        after["sessions"], sum(clients.failures.values()),
    )  # fmt: skip
    return {
        "n": cycles,
        "warmup": warmup,
        "wall_s": round(wall, 1),
        "cycles_per_s": round(cycles / wall, 3),
        "before": before,
        "after": after,
        "growth": growth,
        "sessions_left": after["sessions"],
        "connect_disconnect_ms": {name: percentiles(ms) for name, ms in clients.ms.items()},
        "failures": {name: clients.failures[name] for name in TRANSPORTS},
        "errors": clients.errors,
        "series": series,  # [cycle, rss_mb, fds, tasks, sessions, gc_full_passes] while cycling
    }


def _questions(config: Config) -> list[bytes]:
    """The caller's questions, synthesized by the configured voice, as PCM16 at 16 kHz."""
    from models.prepare import model_path
    from models.tts import TtsEngine

    tts = TtsEngine(model_path(config, "voice"), deterministic=True)
    try:
        spoken = [resample(tts.synthesize(q).audio, tts.sample_rate, RUNTIME_RATE) for q in QUESTIONS]
    finally:
        tts.close()
    return [s.astype("<i2").tobytes() for s in spoken]


async def long_session(
    server: Server, http: aiohttp.ClientSession, minutes: float, config: Config
) -> dict[str, Any]:
    questions = await asyncio.to_thread(_questions, config)
    v2v: list[tuple[float, float]] = []  # (minute, ms) of each reply
    steps: list[dict[str, float]] = []  # and its steps (endpoint_ms, asr_final_ms, ...) and prompt
    rss: list[tuple[float, float]] = []  # (minute, server RSS MB) at each question
    chunk = RUNTIME_RATE // 50 * 2  # 20 ms of PCM16
    async with DuplexClient(f"127.0.0.1:{server.grpc_port}") as client:
        conversation = await client.converse()
        start = time.monotonic()

        async def read() -> None:
            async for event in conversation:
                if event.WhichOneof("event") == "metrics":
                    v2v.append(((time.monotonic() - start) / 60, event.metrics.voice_to_voice_ms))
                    m = event.metrics
                    tokens = {"prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens}
                    steps.append(dict(m.steps_ms) | tokens)

        reader = asyncio.create_task(read(), name="soak-reader")
        pending, asked, sent = b"", 0, 0
        next_question = start + 2.0
        while (now := time.monotonic()) < start + minutes * 60:
            if not pending and now >= next_question:
                pending = questions[asked % len(questions)]
                asked += 1
                next_question += TURN_EVERY_S
                rss.append(((now - start) / 60, (await server.snapshot(http))["rss_mb"]))
            data, pending = (pending[:chunk], pending[chunk:]) if pending else (bytes(chunk), b"")
            await conversation.send_audio(data.ljust(chunk, b"\0"))
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * 0.02 - time.monotonic()))  # real time, no drift
        await conversation.close()
        try:
            await asyncio.wait_for(reader, 60)
        except TimeoutError:
            conversation.abort()
    turns = [{"voice_to_voice_ms": m, **s} for (_, m), s in zip(v2v, steps, strict=True)]
    by_quarter = _by_quarter(turns)
    return {
        "minutes": minutes,
        "questions": asked,
        "replies": len(turns),
        "v2v_ms_by_turn": [[round(t, 2), round(m, 1)] for t, m in v2v],
        "prompt_tokens_by_turn": [t["prompt_tokens"] for t in turns],  # the context each reply attends over
        "ms_per_1000_context_tokens": _context_cost(turns),
        "v2v_ms": percentiles([m for _, m in v2v]),
        "v2v_median_first_quarter_ms": by_quarter["voice_to_voice_ms"][0],
        "v2v_median_last_quarter_ms": by_quarter["voice_to_voice_ms"][-1],
        "median_ms_by_quarter": by_quarter,  # the turn and each of its steps: where any growth is
        "rss_mb_by_question": [[round(t, 2), m] for t, m in rss],
    }


def _context_cost(turns: list[dict[str, float]]) -> dict[str, float | None]:
    """Least-squares slope of each latency against the reply's prompt length, in ms per
    1,000 tokens: what a longer conversation costs, apart from how long the session ran
    (they separate when the context is full and the oldest turns are dropped)."""
    if len(turns) < 3 or len({t["prompt_tokens"] for t in turns}) < 2:
        return {}
    names = ("voice_to_voice_ms", "llm_first_token_ms", "first_phrase_ms", "tts_first_audio_ms")
    out: dict[str, float | None] = {}
    for name in names:
        pairs = np.array([(t["prompt_tokens"], t[name]) for t in turns if name in t], dtype=float)
        slope = np.polyfit(pairs[:, 0], pairs[:, 1], 1)[0] if len(pairs) > 2 else None
        out[name] = None if slope is None else round(float(slope) * 1000, 1)
    return out


def _by_quarter(turns: list[dict[str, float]]) -> dict[str, list[float | None]]:
    """Median of each figure over the first, second, third and last quarter of the turns
    (fewer parts with fewer than four turns)."""
    quarters = np.array_split(np.arange(len(turns)), min(4, len(turns))) if turns else []
    names = sorted({k for t in turns for k in t}) or ["voice_to_voice_ms"]

    def median(values: list[float]) -> float | None:
        return round(float(np.median(values)), 1) if values else None

    return {
        name: [median([turns[i][name] for i in q if name in turns[i]]) for q in quarters] or [None]
        for name in names
    }


async def soak(config: Config, cycles: int, minutes: float, warmup: int | None = None) -> dict[str, Any]:
    """Start a server, cycle, hold the long session, stop it; the figures."""
    set_host_addresses(["127.0.0.1"])  # our ICE offers loopback, as the server's does
    for noisy in ("aioice", "aiortc"):  # a line per ICE check, thousands of connections
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="duplex-soak-") as tmp:
        started = time.perf_counter()
        server = Server(config, Path(tmp) / "serve.log")
        # a new connection each request: a kept-alive one would hold one of the server's fds
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with aiohttp.ClientSession(connector=connector) as http:
                await server.ready(http)
                ready_s = round(time.perf_counter() - started, 1)
                result: dict[str, Any] = {
                    "server": {"ready_s": ready_s, "start": await server.snapshot(http)}
                }
                if cycles:
                    warm = warmup if warmup is not None else max(2, min(20, cycles // 20))
                    result["cycles"] = await run_cycles(server, http, cycles, warm)
                if minutes:
                    result["long_session"] = await long_session(server, http, minutes, config)
                    result["server"]["after_long_session"] = await server.settled(http)
                serving = server.log_problems()
        finally:
            exit_code = server.stop()
        shutdown = server.log_problems()  # vLLM's engine shutdown logs an error of its own
        result["server"] |= {
            "exit_code": exit_code,
            "while_serving": serving,
            "at_shutdown": {k: shutdown[k] - serving[k] for k in ("tracebacks", "error_lines")},
            "wall_s": round(time.perf_counter() - started, 1),
        }
        if serving["tracebacks"]:
            log.warning("soak: the server logged tracebacks, the first:\n%s", serving["first_traceback"])
    return result


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    cycles = getattr(args, "cycles", None)
    minutes = getattr(args, "minutes", None) or 0.0
    result = asyncio.run(soak(config, CYCLES if cycles is None else cycles, minutes))
    result["method"] = (
        "a duplex serve child on loopback; each cycle connects and disconnects one client per transport "
        "(realtime, twilio, grpc, webrtc, sip) with 200 ms of silence; server figures from /metrics once "
        "its sessions have closed, after a warm-up and after the cycles; long session: gRPC, a question "
        "every 30 s, the server's voice-to-voice"
    )
    result["cpu"] = cpu_description()
    return result


def plot(result: dict[str, Any]) -> None:
    """Server RSS, open fds and tasks by cycle, from the baseline (a sampled cycle's may
    include the last connections still closing); voice-to-voice by minute of the long
    session."""
    if "cycles" in result and result["cycles"]["series"]:
        series, before = np.array(result["cycles"]["series"]), result["cycles"]["before"]
        fig, ax = new_plot()
        for column, key, label in (
            (1, "rss_mb", "RSS, MB"),
            (2, "fds", "open fds"),
            (3, "tasks", "asyncio tasks"),
        ):
            ax.plot(series[:, 0], series[:, column] - before[key], ".-", label=label)
        save_plot(fig, ax, "soak_cycles", "Connect/disconnect on 5 transports", "growth", xlabel="cycle")
    if "long_session" in result and result["long_session"]["v2v_ms_by_turn"]:
        session = result["long_session"]
        turns = np.array(session["v2v_ms_by_turn"])
        fig, ax = new_plot()
        ax.plot(turns[:, 0], turns[:, 1], ".-", label="voice-to-voice")
        if len(session.get("prompt_tokens_by_turn", ())) == len(turns):
            context = ax.twinx()
            tokens = session["prompt_tokens_by_turn"]
            context.plot(turns[:, 0], tokens, "--", color="grey", label="prompt tokens")
            context.set_ylabel("prompt tokens")
            context.legend(loc="upper right")
        save_plot(fig, ax, "soak_long", "One session, a question every 30 s", "ms", xlabel="minute")


if __name__ == "__main__":
    bench_main("soak", measure, plot)
