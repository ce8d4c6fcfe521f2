"""Probes (``/livez``, ``/readyz``), start-up phases in ``/healthz``, the metric names,
and vLLM's log lines in JSON: in-process for each state, then with a real
``duplex serve`` from a cold process to a call and a clean stop (slow)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator

import prometheus_client
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from duplex import metrics
from duplex.config import Config
from duplex.events import SessionError
from duplex.health import ComponentState, Readiness
from duplex.http_app import build_http_app
from duplex.sessions import Sessions, transport_of
from duplex.startup import PHASES, Startup
from tests.test_serve import get_health
from tests.test_transports import ADAPTERS

TOKEN = "probe-token-123456"
# a service with its LLM in-process goes through every phase but reaching an LLM service
IN_PROCESS_PHASES = [name for name in PHASES if name != "llm_service"]

# duplex's own series, each with its labels (`duplex.metrics`, `duplex.engine_watch`, ...)
DUPLEX_SERIES = (
    "duplex_sessions_active",
    'duplex_sessions_open{transport="realtime"}',
    'duplex_sessions_open{transport="twilio"}',
    'duplex_sessions_open{transport="grpc"}',
    'duplex_sessions_open{transport="webrtc"}',
    'duplex_sessions_open{transport="sip"}',
    'duplex_sessions_open{transport="in-process"}',
    'duplex_sessions_refused_total{reason="too_many_sessions"}',
    'duplex_sessions_refused_total{reason="llm_unavailable"}',
    'duplex_sessions_refused_total{reason="shutting_down"}',
    'duplex_sessions_refused_total{reason="not_ready"}',
    "duplex_build_info{",
    "duplex_voice_to_voice_seconds_bucket",
    "duplex_turn_step_seconds",
    "duplex_barge_in_stop_seconds",
    "duplex_barge_ins_total",
    "duplex_event_loop_lag_seconds",
    "duplex_asyncio_tasks",
    "duplex_threads",
)
# vLLM's own series, registered when its engine starts (documented in duplex/metrics.py)
VLLM_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
)


@pytest.fixture
async def app(request) -> AsyncIterator[tuple[TestServer, Readiness, Startup]]:
    config = Config(**getattr(request, "param", {}))
    startup = Startup()
    readiness = Readiness(["vad", "llm"], startup)
    srv = TestServer(build_http_app(config, readiness), host="127.0.0.1")
    await srv.start_server()
    yield srv, readiness, startup
    await srv.close()


async def _get(http: ClientSession, srv: TestServer, path: str) -> tuple[int, dict]:
    async with http.get(srv.make_url(path)) as r:
        return r.status, await r.json()


async def test_probes_follow_each_state_of_the_service(app):
    srv, readiness, startup = app
    async with ClientSession() as http:
        assert await _get(http, srv, "/livez") == (200, {"status": "alive"})
        assert await _get(http, srv, "/readyz") == (503, {"status": "starting", "reason": "starting"})
        startup.begin("load_asr")
        status, body = await _get(http, srv, "/readyz")
        assert status == 503 and body["reason"].startswith(f"starting: {PHASES['load_asr']} (")
        status, health = await _get(http, srv, "/healthz")
        assert status == 503 and health["startup"]["phase"]["name"] == "load_asr"
        readiness.set("vad", ComponentState.READY, "vad.onnx")
        readiness.set("llm", ComponentState.READY, "SmolLM2")
        startup.finish()
        assert await _get(http, srv, "/readyz") == (200, {"status": "ready"})
        status, health = await _get(http, srv, "/healthz")
        assert status == 200 and health["startup"]["finished"] and health["startup"]["phase"] is None
        assert [d["name"] for d in health["startup"]["done"]] == ["load_asr"]
        # an engine death (duplex/engine_watch.py marks it so within 0.2 s)
        readiness.set("llm", ComponentState.RESTARTING, "the engine stopped; restarting")
        assert await _get(http, srv, "/readyz") == (
            503,
            {"status": "restarting", "reason": "llm: the engine stopped; restarting"},
        )
        readiness.set("llm", ComponentState.READY, "SmolLM2")
        assert (await _get(http, srv, "/readyz"))[0] == 200
        readiness.shut_down()
        assert await _get(http, srv, "/readyz") == (
            503,
            {"status": "shutting_down", "reason": "the server is shutting down"},
        )
        assert (await _get(http, srv, "/healthz"))[1]["status"] == "shutting_down"
        assert await _get(http, srv, "/livez") == (200, {"status": "alive"})  # it still answers


async def test_a_failed_start_is_not_ready(app):
    srv, readiness, _ = app
    readiness.set("llm", ComponentState.FAILED, "model preparation failed (see the log)")
    async with ClientSession() as http:
        assert await _get(http, srv, "/readyz") == (
            503,
            {"status": "failed", "reason": "llm: model preparation failed (see the log)"},
        )


@pytest.mark.parametrize("app", [{"auth_token": TOKEN}], indirect=True)
async def test_probes_need_no_token_like_healthz_while_metrics_does(app):
    srv, _, _ = app
    async with ClientSession() as http:
        for path in ("/livez", "/readyz", "/healthz"):
            async with http.get(srv.make_url(path)) as r:
                assert r.status in (200, 503), path
        async with http.get(srv.make_url("/metrics")) as r:
            assert r.status == 401


def test_duplex_series_are_exported_under_their_names():
    labels = metrics.set_build_info()
    assert labels["version"] and labels["python"].count(".") == 2
    assert labels["torch"] != "none"  # read from the installed packages' metadata
    exported = prometheus_client.generate_latest().decode()
    for series in DUPLEX_SERIES:
        assert series in exported, series
    line = next(x for x in exported.splitlines() if x.startswith("duplex_build_info{"))
    assert line.endswith(" 1.0") and f'vllm="{labels["vllm"]}"' in line


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__.strip("_"))
def test_each_transports_sessions_are_counted_under_its_name(adapter):
    made = adapter()
    assert transport_of(made.stage) == made.name


def test_a_sink_of_no_transport_is_in_process():
    class Collect:
        def audio(self, frame, response_id): ...
        def event(self, event): ...
        def flush(self): ...
        def end_reply(self, response_id, completed): ...

    assert transport_of(Collect()) == "in-process"


def _refused(reason: str) -> float:
    return (
        prometheus_client.REGISTRY.get_sample_value("duplex_sessions_refused_total", {"reason": reason})
        or 0.0
    )


def test_refusals_are_counted_by_the_error_code_sent():
    before = {r: _refused(r) for r in ("not_ready", "too_many_sessions", "llm_unavailable")}
    sessions = Sessions(max_sessions=0, idle_timeout_s=10)
    with pytest.raises(SessionError, match="still loading"):
        sessions.check_room()
    with pytest.raises(SessionError) as full, sessions.hold():
        pass
    assert full.value.code == "too_many_sessions"
    sessions.engines = object()  # type: ignore[assignment]  # only admission is exercised here
    sessions.set_unavailable(SessionError("llm_unavailable", "the LLM engine stopped"))
    with pytest.raises(SessionError):
        sessions.check_room()
    assert {r: _refused(r) - n for r, n in before.items()} == {
        "not_ready": 1,
        "too_many_sessions": 1,
        "llm_unavailable": 1,
    }


# -- the real service --------------------------------------------------------------


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


async def _realtime_session_then_scrape(port: int) -> str:
    """Open one session over the Realtime WebSocket and scrape /metrics while it is open."""
    async with ClientSession() as http, http.ws_connect(f"http://127.0.0.1:{port}/v1/realtime") as ws:
        created = await ws.receive_json(timeout=30)
        assert created["type"] == "session.created", created
        return await asyncio.to_thread(_scrape, port)


async def _refused_session(port: int) -> str:
    """The error code a new Realtime session is refused with."""
    async with ClientSession() as http, http.ws_connect(f"http://127.0.0.1:{port}/v1/realtime") as ws:
        first = await ws.receive_json(timeout=30)
        assert first["type"] == "error", first
        return str(first["error"]["code"])


@pytest.mark.slow
def test_serve_probes_phases_metrics_and_json_logs(offline_env):
    """A real `duplex serve --log-format json`: /livez 200 while /readyz is 503 and
    /healthz shows the phase under way; every phase done with its time once ready;
    vLLM's and duplex's series in /metrics, a Realtime session counted under its
    transport; its engine core killed: /readyz 503 (restarting) and a session refused
    and counted, until it is back; and every line it wrote, vLLM's engine core's
    included (the first and the restarted one), one JSON object."""
    from tests.test_serve import Server

    server = Server(offline_env, "--log-format", "json")
    try:
        server.wait_listening()
        assert get_health(server.port, "/livez", timeout=5) == (200, {"status": "alive"})
        status, ready = get_health(server.port, "/readyz", timeout=5)
        assert status == 503 and ready["status"] == "starting", ready
        phases_seen: set[str] = set()
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            status, health = get_health(server.port, "/healthz", timeout=5)
            current = health["startup"]["phase"]
            if current is not None:
                phases_seen.add(current["name"])
                assert current["seconds"] >= 0 and current["what"] == PHASES[current["name"]]
                livez = get_health(server.port, "/livez", timeout=5)
                assert livez[0] == 200, livez  # while the models load
            if status == 200:
                break
            assert health["status"] == "starting", health
            server.note_descendants()
            time.sleep(0.25)
        assert status == 200, health
        assert get_health(server.port, "/readyz", timeout=5) == (200, {"status": "ready"})
        startup = health["startup"]
        assert startup["finished"] and startup["phase"] is None
        done = {d["name"]: d for d in startup["done"]}
        assert list(done) == IN_PROCESS_PHASES, startup  # every phase, in order
        assert all(d["seconds"] >= 0 for d in done.values())
        assert done["llm_compile"]["detail"] in (
            "loaded the compiled graph from the cache",
            "compiled (the next start loads it)",
        )
        assert len(phases_seen) >= 2, phases_seen  # seen as they happened, not only at the end
        exported = _scrape(server.port)
        for series in DUPLEX_SERIES + VLLM_SERIES:
            assert series in exported, series
        during = asyncio.run(_realtime_session_then_scrape(server.port))
        assert 'duplex_sessions_open{transport="realtime"} 1.0' in during
        deadline = time.monotonic() + 10  # the session closes as its socket does
        while 'duplex_sessions_open{transport="realtime"} 0.0' not in (after := _scrape(server.port)):
            assert time.monotonic() < deadline, after
            time.sleep(0.1)
        # the engine core dies: not ready, with the reason, until it is back; alive all along
        from tests.test_faults_served import engine_core

        engine_core(server).kill()
        deadline = time.monotonic() + 30
        while (readyz := get_health(server.port, "/readyz", timeout=5))[0] == 200:
            assert time.monotonic() < deadline, "the engine's death never showed in /readyz"
            time.sleep(0.05)
        assert readyz == (503, {"status": "restarting", "reason": "llm: the engine stopped; restarting"})
        assert get_health(server.port, "/livez", timeout=5)[0] == 200
        refused = asyncio.run(_refused_session(server.port))
        assert refused == "llm_unavailable"
        assert 'duplex_sessions_refused_total{reason="llm_unavailable"} 1.0' in _scrape(server.port)
        deadline = time.monotonic() + 180
        while get_health(server.port, "/readyz", timeout=5)[0] != 200:
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.5)
        server_pid = server.proc.pid
        server.stop_cleanly()
    finally:
        output = server.output()
    lines = output.splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
    assert all({"ts", "level", "logger", "msg", "pid"} <= r.keys() for r in records)
    vllm = [r for r in records if r["logger"].startswith("vllm")]
    assert any(r["pid"] != server_pid for r in vllm), "the engine core's own lines"
    assert any(r["pid"] == server_pid for r in vllm), "vLLM's lines in the server process"
    took = {r["phase"]: r["seconds"] for r in records if r["msg"].startswith("start-up: ") and "seconds" in r}
    assert list(took) == IN_PROCESS_PHASES, took  # each phase logged with its time as it ended
