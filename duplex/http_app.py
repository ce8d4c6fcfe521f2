"""The HTTP listener: demo page, health and probes, metrics (transports add their routes here)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from pathlib import Path

import prometheus_client
from aiohttp import web
from aiohttp.typedefs import Middleware

from duplex.config import Config
from duplex.health import Readiness

# the page: package data beside this module when installed from a wheel (setup.py puts
# it there), else the checkout's demo_web/ (a checkout, an editable install)
_PACKAGED_PAGE = Path(__file__).resolve().parent / "demo_web"
DEMO_DIR = _PACKAGED_PAGE if _PACKAGED_PAGE.is_dir() else Path(__file__).resolve().parent.parent / "demo_web"
READINESS: web.AppKey[Readiness] = web.AppKey("readiness", Readiness)
# the demo's page and static files are not secret (the page sends its own URL's ?token=
# with every API call); the Twilio stream checks its token itself: Twilio cannot send
# query strings on stream URLs, so it also comes as a start message parameter; the
# probes, like /healthz, are public: a kubelet's or load balancer's check sends no token
PUBLIC_PATHS = ("/healthz", "/livez", "/readyz", "/", "/telephony/twilio")
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


async def livez(request: web.Request) -> web.Response:
    """The process answers (200 from the moment it listens, while the models load)."""
    return web.json_response({"status": "alive"})


async def readyz(request: web.Request) -> web.Response:
    """Calls may begin now: 200; else 503 with the reason (starting, restarting, ...)."""
    readiness = request.app[READINESS]
    if readiness.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": readiness.status, "reason": readiness.reason()}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = prometheus_client.generate_latest()
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(DEMO_DIR / "index.html")


# what a page from another site must not reach: opening a session reads the operator's
# instructions (session.created) and spends the machine (cross-site WebSocket hijacking)
SESSION_PATHS = ("/v1/realtime", "/telephony/twilio", "/webrtc/offer")


def origin_allowed(origin: str, host: str, allowed: frozenset[str]) -> bool:
    """May a browser page from ``origin`` open a session through this ``Host``? Yes for
    an allow-listed origin, and for the server's own page when it is addressed by IP or
    as localhost; a page under a domain name must be listed, since DNS rebinding can
    point any name at this machine and make its page "same-origin"."""
    origin = origin.rstrip("/").lower()
    if origin in allowed:
        return True
    scheme, _, netloc = origin.partition("://")
    if scheme not in ("http", "https") or netloc != host.lower():
        return False
    name = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin_middleware(allowed: frozenset[str]) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")  # sent by browsers; other clients send none
        if (
            origin is not None
            and request.path in SESSION_PATHS
            and not origin_allowed(origin, request.host, allowed)
        ):
            message = f"pages from {origin[:80]!r} may not open sessions here (allowed_origins)"
            return web.json_response(
                {"error": {"type": "forbidden", "code": "origin_not_allowed", "message": message}}, status=403
            )
        return await handler(request)

    return check


def build_http_app(config: Config, readiness: Readiness) -> web.Application:
    middlewares = [_origin_middleware(config.origins)]
    if config.auth_token:
        middlewares.append(_auth_middleware(config.auth_token))
    app = web.Application(client_max_size=config.max_message_bytes, middlewares=middlewares)
    app[READINESS] = readiness
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", index)
    # aiohttp's static route resolves each path and refuses anything outside the
    # directory (and symlinks out of it), so "/static/../x" cannot escape demo_web/.
    app.router.add_static("/static/", DEMO_DIR, follow_symlinks=False, show_index=False)
    return app
