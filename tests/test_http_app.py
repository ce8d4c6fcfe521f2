"""The HTTP listener in-process: health, auth, static serving, body limits."""

from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from yarl import URL

from duplex.config import Config
from duplex.health import ComponentState, Readiness
from duplex.http_app import build_http_app

TOKEN = "test-token-123456"


@pytest.fixture
async def server(request) -> AsyncIterator[tuple[TestServer, Readiness]]:
    config = Config(**getattr(request, "param", {}))
    readiness = Readiness(["vad", "llm"])
    srv = TestServer(build_http_app(config, readiness), host="127.0.0.1")
    await srv.start_server()
    yield srv, readiness
    await srv.close()


async def test_healthz_is_503_until_every_component_is_ready(server):
    srv, readiness = server
    async with ClientSession() as http:
        async with http.get(srv.make_url("/healthz")) as r:
            assert r.status == 503
            body = await r.json()
            assert body["status"] == "starting"
            assert body["components"]["vad"]["state"] == "starting"
        readiness.set("vad", ComponentState.READY, "/models/vad.onnx")
        readiness.set("llm", ComponentState.READY, "/models/llm")
        async with http.get(srv.make_url("/healthz")) as r:
            assert r.status == 200
            assert (await r.json())["components"]["vad"] == {"state": "ready", "detail": "/models/vad.onnx"}
        readiness.set("llm", ComponentState.FAILED, "boom")
        async with http.get(srv.make_url("/healthz")) as r:
            assert r.status == 503 and (await r.json())["status"] == "failed"


async def test_demo_page_and_metrics_are_served(server):
    srv, _ = server
    async with ClientSession() as http:
        async with http.get(srv.make_url("/")) as r:
            assert r.status == 200 and "<title>duplex</title>" in await r.text()
        async with http.get(srv.make_url("/metrics")) as r:
            assert r.status == 200 and "python_info" in await r.text()


@pytest.mark.parametrize(
    "path",
    [
        "/static/../duplex/config.py",
        "/static/%2e%2e/duplex/config.py",
        "/static/..%2fpyproject.toml",
        "/static/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/static//etc/passwd",
    ],
)
async def test_static_serving_does_not_escape_demo_web(server, path):
    srv, _ = server
    async with ClientSession() as http:
        url = URL(str(srv.make_url("/")).rstrip("/") + path, encoded=True)
        async with http.get(url) as r:
            body = await r.text()
            assert r.status in (403, 404)
            assert "ConfigError" not in body and "root:" not in body


@pytest.mark.parametrize("server", [{"auth_token": TOKEN}], indirect=True)
async def test_token_auth_guards_everything_but_health_and_the_demo_page(server):
    srv, _ = server
    async with ClientSession() as http:
        async with http.get(srv.make_url("/metrics")) as r:
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "unauthorized"
        async with http.get(srv.make_url("/metrics"), headers={"Authorization": "Bearer wrong-token"}) as r:
            assert r.status == 401
        async with http.get(srv.make_url("/metrics"), headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
        async with http.get(srv.make_url("/")) as r:
            assert r.status == 200  # the demo page and its files are public; its API calls are not
        async with http.get(srv.make_url("/static/app.js")) as r:
            assert r.status == 200
        async with http.post(srv.make_url("/webrtc/offer"), json={"type": "offer", "sdp": ""}) as r:
            assert r.status == 401
        async with http.get(srv.make_url("/healthz")) as r:
            assert r.status == 503  # public, and honest about readiness


async def test_oversized_body_is_refused_by_the_configured_limit():
    app = build_http_app(Config(max_message_bytes=4096), Readiness(["vad"]))
    app.router.add_post("/echo", _echo)  # a route that reads its body, as transports will
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        async with ClientSession() as http:
            async with http.post(srv.make_url("/echo"), data=b"x" * 10_000) as r:
                assert r.status == 413
            async with http.post(srv.make_url("/echo"), data=b"x" * 1000) as r:
                assert r.status == 200 and len(await r.read()) == 1000
    finally:
        await srv.close()


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


def test_log_lines_mask_secrets_in_fields_and_tracebacks(capsys):
    import logging

    from duplex.logs import setup_logging

    for fmt in ("text", "json"):
        setup_logging("info", fmt, [TOKEN])
        log = logging.getLogger("duplex.test")
        log.info("request", extra={"fields": {"url": f"/ws?token={TOKEN}"}})
        try:
            raise ValueError(f"bad token {TOKEN}")
        except ValueError:
            log.exception("failed")
        err = capsys.readouterr().err
        assert TOKEN not in err and "***" in err
    logging.getLogger().handlers.clear()
