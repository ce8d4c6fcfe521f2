"""Your web app's side of a browser voice client: serve the page (index.html beside
this file) and pass its WebRTC offer on to duplex.

    python examples/browser/serve.py --duplex http://127.0.0.1:8000 --port 8080
    # then open http://127.0.0.1:8080/ and press Talk

Why a server of your own, rather than the page calling duplex itself: the page never
sees duplex's token (DUPLEX_AUTH_TOKEN stays here), and this is where your own login
decides who may talk. The audio itself flows between the browser and duplex directly:
only the offer and the answer pass through here. Browsers give a page the microphone on
https:// or on localhost/127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import ClientError, ClientSession, web

PAGE = Path(__file__).with_name("index.html")
MAX_OFFER_BYTES = 64 * 1024  # an SDP offer is a few kB
CLIENT: web.AppKey[ClientSession] = web.AppKey("client", ClientSession)
DUPLEX: web.AppKey[str] = web.AppKey("duplex", str)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(PAGE)


async def offer(request: web.Request) -> web.Response:
    """The page's offer, {"type": "offer", "sdp": ...}, to duplex's POST /webrtc/offer;
    duplex's answer (or its JSON error) back to the page as it is."""
    body = await request.read()
    headers = {"Content-Type": "application/json"}
    if token := os.environ.get("DUPLEX_AUTH_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    try:
        url = f"{request.app[DUPLEX]}/webrtc/offer"
        async with request.app[CLIENT].post(url, data=body, headers=headers) as answer:
            return web.Response(
                body=await answer.read(), status=answer.status, content_type="application/json"
            )
    except ClientError as e:
        return web.json_response({"error": {"code": "duplex_unreachable", "message": str(e)}}, status=502)


async def client_session(app: web.Application) -> AsyncIterator[None]:
    app[CLIENT] = ClientSession()
    yield
    await app[CLIENT].close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Serve the browser example and relay its offers to duplex.")
    parser.add_argument("--duplex", default="http://127.0.0.1:8000", help="duplex's HTTP address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    app = web.Application(client_max_size=MAX_OFFER_BYTES)
    app[DUPLEX] = args.duplex.rstrip("/")
    app.router.add_get("/", index)
    app.router.add_post("/offer", offer)
    app.cleanup_ctx.append(client_session)
    web.run_app(app, host=args.host, port=args.port)
