"""A Twilio voice webhook that puts phone calls through to duplex.

    DUPLEX_AUTH_TOKEN=... TWILIO_AUTH_TOKEN=... python examples/twilio_app.py \\
        --stream-url wss://duplex.example.com/telephony/twilio --port 8081

In the Twilio console, set your number's "A call comes in" webhook to this app's
public https://.../voice (HTTP POST). For each call, Twilio fetches TwiML from here;
the answer, ``<Connect><Stream url="...">``, makes Twilio stream the call's audio both
ways to duplex's Media Streams endpoint. Twilio drops query strings from stream URLs,
so duplex's token travels as a ``<Parameter name="token">``, which duplex reads from the
stream's ``start`` message. With TWILIO_AUTH_TOKEN set, a request that does not carry
Twilio's signature (X-Twilio-Signature) is refused, so that nobody else can ask this app
for the token. (duplex also answers POST /telephony/twilio/voice itself; an app of your
own is where per-call decisions go: who may call, which instructions, logging.)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
from xml.etree import ElementTree

from aiohttp import web

STREAM_URL: web.AppKey[str] = web.AppKey("stream_url", str)
PUBLIC_URL: web.AppKey[str] = web.AppKey("public_url", str)


def twilio_signature(auth_token: str, url: str, form: dict[str, str]) -> str:
    """Twilio's request signature: HMAC-SHA1 over the URL it called and the POST
    parameters sorted by name, each name followed by its value; base64."""
    data = url + "".join(name + form[name] for name in sorted(form))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def twiml(stream_url: str, token: str | None) -> str:
    response = ElementTree.Element("Response")
    stream = ElementTree.SubElement(ElementTree.SubElement(response, "Connect"), "Stream", url=stream_url)
    if token:
        ElementTree.SubElement(stream, "Parameter", name="token", value=token)
    return '<?xml version="1.0" encoding="UTF-8"?>' + ElementTree.tostring(response, encoding="unicode")


async def voice(request: web.Request) -> web.Response:
    form = {name: str(value) for name, value in (await request.post()).items()}
    auth_token = os.environ.get("TWILIO_AUTH_TOKEN")
    if auth_token:
        # the URL as Twilio called it: behind a proxy, give it with --public-url
        url = request.app[PUBLIC_URL] or str(request.url)
        expected = twilio_signature(auth_token, url, form)
        if not hmac.compare_digest(expected, request.headers.get("X-Twilio-Signature", "")):
            raise web.HTTPForbidden(text="bad or missing X-Twilio-Signature")
    print(f"call {form.get('CallSid', '?')} from {form.get('From', '?')}: to duplex", flush=True)
    body = twiml(request.app[STREAM_URL], os.environ.get("DUPLEX_AUTH_TOKEN"))
    return web.Response(text=body, content_type="text/xml")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Answer Twilio's voice webhook with a stream to duplex.")
    parser.add_argument("--stream-url", required=True, help="duplex's wss://host/telephony/twilio")
    parser.add_argument("--public-url", default="", help="this app's /voice URL as Twilio calls it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    args = parser.parse_args()
    app = web.Application()
    app[STREAM_URL] = args.stream_url
    app[PUBLIC_URL] = args.public_url
    app.router.add_post("/voice", voice)
    web.run_app(app, host=args.host, port=args.port)
