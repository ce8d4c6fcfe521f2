"""The HTTP listener in-process: health, auth, static serving, body limits."""

from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from yarl import URL

from duplex.config import Config, ConfigError, load_config
from duplex.health import ComponentState, Readiness
from duplex.http_app import build_http_app, origin_allowed

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
            assert r.status == 200 and "<title>duplex voice demo</title>" in await r.text()
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


@pytest.mark.parametrize(
    ("origin", "host", "allowed", "ok"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", frozenset(), True),  # the server's own page
        ("http://localhost:8000", "localhost:8000", frozenset(), True),
        ("http://[::1]:8000", "[::1]:8000", frozenset(), True),
        ("http://evil.example", "127.0.0.1:8000", frozenset(), False),  # another site's page
        ("http://127.0.0.1:9999", "127.0.0.1:8000", frozenset(), False),  # another port: another origin
        ("http://evil.example:8000", "evil.example:8000", frozenset(), False),  # DNS rebinding
        ("null", "127.0.0.1:8000", frozenset(), False),  # a sandboxed frame, a file: page
        ("https://voice.example.com", "voice.example.com", frozenset({"https://voice.example.com"}), True),
        ("https://VOICE.example.com/", "10.0.0.5:443", frozenset({"https://voice.example.com"}), True),
    ],
)
def test_which_pages_may_open_sessions(origin, host, allowed, ok):
    assert origin_allowed(origin, host, allowed) is ok


@pytest.mark.parametrize("path", ["/webrtc/offer", "/v1/realtime", "/telephony/twilio"])
async def test_a_page_from_another_site_cannot_open_a_session(path):
    app = build_http_app(Config(allowed_origins="https://voice.example.com"), Readiness(["vad"]))
    srv = TestServer(app, host="127.0.0.1")  # no transport routes: 404 is "let through"
    await srv.start_server()
    own = f"http://127.0.0.1:{srv.port}"
    try:
        async with ClientSession() as http:
            for origin, status in [
                ("http://evil.example", 403),
                (own, 404),
                ("https://voice.example.com", 404),
                (None, 404),  # not a browser: no Origin
            ]:
                headers = {"Origin": origin} if origin else {}
                async with http.post(srv.make_url(path), headers=headers, json={}) as r:
                    assert r.status == status, (origin, await r.text())
                    if status == 403:
                        assert (await r.json())["error"]["code"] == "origin_not_allowed"
            # DNS rebinding: a name of the attacker's that points here, "same-origin" to its page
            rebound = {"Origin": f"http://evil.example:{srv.port}", "Host": f"evil.example:{srv.port}"}
            async with http.get(srv.make_url(path), headers=rebound) as r:
                assert r.status == 403
            async with http.get(srv.make_url("/healthz"), headers={"Origin": "http://evil.example"}) as r:
                assert r.status == 503  # only session routes are guarded
    finally:
        await srv.close()


def test_allowed_origins_are_checked():
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, {"allowed_origins": "voice.example.com"})
    assert info.value.key == "allowed_origins"
    assert load_config(
        None, {}, {"allowed_origins": "https://a.example, http://b.example:8080/"}
    ).origins == {
        "https://a.example",
        "http://b.example:8080",
    }
