"""Faults in a running `duplex serve`: its LLM engine process killed mid-reply, and
SIGTERM with a long transcription in flight. A real process, the openai SDK's
realtime client, gRPC health, real signals."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import psutil
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2
from openai import AsyncOpenAI

from tests.test_serve import Server, get_health, grpc_health, outliving

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def offline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


async def ready(server: Server, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.output()
        status, body = await asyncio.to_thread(get_health, server.port)
        if status == 200:
            return body
        await asyncio.sleep(0.5)
    raise AssertionError(f"not ready within {within:g} s: {body}")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server() -> AsyncIterator[Server]:
    server = Server(offline_env())
    try:
        await asyncio.to_thread(server.wait_listening)
        await ready(server, 300)
        yield server
    finally:
        server.output()


def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="dummy", max_retries=0)


async def events_until(conn: Any, kind: str, within: float = 60) -> list[Any]:
    seen: list[Any] = []
    async with asyncio.timeout(within):
        async for event in conn:
            seen.append(event)
            if event.type == kind:
                return seen
    return seen


async def ask(conn: Any, text: str) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await conn.conversation.item.create(item=item)
    await conn.response.create()


def engine_core(server: Server) -> psutil.Process:
    (core,) = [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline())  # vLLM titles it VLLM::EngineCore
    ]
    return core


async def test_the_llm_engine_killed_mid_reply(server: Server) -> None:
    """Health turns not-ready at once, the reply fails with a typed error, new sessions
    are refused with one, the engine comes back by itself, and the live session's next
    turn is answered."""
    async with client(server).realtime.connect(model="duplex") as conn:
        await conn.recv()  # session.created
        await ask(conn, "Tell me a long story about a dragon and a knight.")
        seen = await events_until(conn, "response.output_audio_transcript.delta")  # the LLM is generating
        core = engine_core(server)
        core.kill()
        killed = time.monotonic()
        seen += await events_until(conn, "response.done", within=30)
        errors = [e.error.code for e in seen if e.type == "error"]
        assert errors == ["llm_unavailable"], errors
        assert seen[-1].response.status == "failed"
        status, body = await asyncio.to_thread(get_health, server.port)
        assert status == 503 and body["components"]["llm"]["state"] == "restarting", body
        assert (
            await asyncio.to_thread(grpc_health, server.grpc_port)
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        async with client(server).realtime.connect(model="duplex") as refused:
            first = await refused.recv()
            assert first.type == "error" and first.error.code == "llm_unavailable"
        await ready(server, 120)
        back_after = time.monotonic() - killed
        assert (
            await asyncio.to_thread(grpc_health, server.grpc_port) == health_pb2.HealthCheckResponse.SERVING
        )
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
        await ask(conn, "What is two plus two?")
        seen = await events_until(conn, "response.done", within=60)
        assert seen[-1].response.status == "completed", [e.type for e in seen]
        assert any(e.type == "response.output_audio.delta" for e in seen)
        assert not [e for e in seen if e.type == "error"]
    print(f"the LLM engine was back {back_after:.1f} s after its process was killed")


async def test_sigterm_with_a_long_transcription_in_flight_exits_within_5_s(server: Server) -> None:
    async with client(server).realtime.connect(model="duplex") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await conn.recv()
        rng = np.random.default_rng(0)  # 90 s of noise: three 30 s windows for the ASR
        audio = (rng.standard_normal(90 * 24000) * 3000).astype("<i2").tobytes()
        for i in range(0, len(audio), 48000):
            await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + 48000]).decode())
        await conn.input_audio_buffer.commit()
        await asyncio.sleep(0.5)  # the windows are queued and the first is being transcribed
        server.note_descendants()
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(server.proc.wait, 15)
        seconds = time.monotonic() - started
    output = server.output()
    assert server.proc.returncode == 0, output
    assert seconds < 5.0, output
    assert not outliving(server.descendants, grace=2.0), output
    assert "Traceback" not in output.split("shutting down", 1)[-1], output
