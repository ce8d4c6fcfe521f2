"""The HTTP listener: demo page, health, metrics (transports add their routes here)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import prometheus_client
from aiohttp import web
from aiohttp.typedefs import Middleware

from duplex.config import Config
from duplex.health import Readiness

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_web"
READINESS: web.AppKey[Readiness] = web.AppKey("readiness", Readiness)
# the demo's page and static files are not secret (the page sends its own URL's ?token=
# with every API call); the Twilio stream checks its token itself: Twilio cannot send
# query strings on stream URLs, so it also comes as a start message parameter
PUBLIC_PATHS = ("/healthz", "/", "/telephony/twilio")
PUBLIC_PREFIX = "/static/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _token_ok(request: web.Request, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else request.query.get("token", "")
    return hmac.compare_digest(given.encode(), token.encode())


def _auth_middleware(token: str) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        public = request.path in PUBLIC_PATHS or request.path.startswith(PUBLIC_PREFIX)
        if not public and not _token_ok(request, token):
            return web.json_response(
                {"error": {"type": "unauthorized", "message": "missing or wrong token"}}, status=401
            )
        return await handler(request)

    return check


async def healthz(request: web.Request) -> web.Response:
    readiness = request.app[READINESS]
    return web.json_response(readiness.snapshot(), status=200 if readiness.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = prometheus_client.generate_latest()
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(DEMO_DIR / "index.html")


def build_http_app(config: Config, readiness: Readiness) -> web.Application:
    middlewares = [_auth_middleware(config.auth_token)] if config.auth_token else []
    app = web.Application(client_max_size=config.max_message_bytes, middlewares=middlewares)
    app[READINESS] = readiness
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", index)
    # aiohttp's static route resolves each path and refuses anything outside the
    # directory (and symlinks out of it), so "/static/../x" cannot escape demo_web/.
    app.router.add_static("/static/", DEMO_DIR, follow_symlinks=False, show_index=False)
    return app
