"""SIP (RFC 3261) messages over UDP, SDP offer/answer (RFC 3264) for G.711 calls, and
digest authentication (RFC 8760, MD5).

`parse` reads one datagram into a `SipMessage` and raises `SipError` for anything that
is not a well-formed request or response with the headers a dialog needs (with what it
could read, so that a request can still be answered 400); `response` builds the answer
to a request (its Vias, From, To, Call-ID and CSeq copied, as a UAS must); `in_dialog`
says whether a request belongs to the dialog an INVITE began. Bookkeeping only: no
sockets, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_MESSAGE_BYTES = 16 * 1024
COMPACT = {"v": "via", "f": "from", "t": "to", "i": "call-id", "m": "contact", "l": "content-length",
           "c": "content-type", "k": "supported", "s": "subject"}  # fmt: skip
REQUIRED = ("via", "from", "to", "call-id", "cseq")
REASONS = {
    100: "Trying", 180: "Ringing", 200: "OK", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 408: "Request Timeout", 413: "Request Entity Too Large",
    415: "Unsupported Media Type", 481: "Call/Transaction Does Not Exist", 486: "Busy Here",
    487: "Request Terminated", 488: "Not Acceptable Here", 500: "Server Internal Error",
    501: "Not Implemented", 503: "Service Unavailable",
}  # fmt: skip
_TOKEN = re.compile(r"^[A-Za-z0-9.!%*_+`'~-]+$")


class SipError(ValueError):
    """Not a message we can act on; ``partial`` holds what was read of it (a request
    with its Via can still be answered 400)."""

    def __init__(self, message: str, partial: SipMessage | None = None) -> None:
        super().__init__(message)
        self.partial = partial


@dataclass
class SipMessage:
    method: str = ""  # requests
    uri: str = ""
    status: int = 0  # responses
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)  # (lower-case name, value), in order
    body: bytes = b""

    @property
    def is_request(self) -> bool:
        return bool(self.method)

    def get(self, name: str, default: str = "") -> str:
        return next((v for n, v in self.headers if n == name), default)

    def all(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n == name]

    @property
    def call_id(self) -> str:
        return self.get("call-id")

    @property
    def cseq(self) -> tuple[int, str]:
        number, _, method = self.get("cseq").partition(" ")
        return int(number), method.strip()

    @property
    def branch(self) -> str:
        return param(self.get("via"), "branch")

    def to_bytes(self) -> bytes:
        first = f"{self.method} {self.uri} SIP/2.0" if self.method else f"SIP/2.0 {self.status} {self.reason}"
        lines = [first]
        lines += [f"{_title(n)}: {v}" for n, v in self.headers if n != "content-length"]
        lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


def _title(name: str) -> str:
    return {"call-id": "Call-ID", "cseq": "CSeq", "www-authenticate": "WWW-Authenticate"}.get(
        name, "-".join(p.capitalize() for p in name.split("-"))
    )


def param(header: str, name: str) -> str:
    """A ``;name=value`` parameter of a header ("" when absent)."""
    match = re.search(rf";\s*{re.escape(name)}=([^;,\s>]+)", header, re.IGNORECASE)
    return match.group(1) if match else ""


def _is_number(text: str) -> bool:
    """ASCII digits only, at most 10: `str.isdigit` takes "²" and "٣", which `int` refuses
    or reads as another number, and a 5,000-digit "number" costs `int` real time."""
    return 0 < len(text) <= 10 and text.isascii() and text.isdigit()


def parse(data: bytes) -> SipMessage:
    if len(data) > MAX_MESSAGE_BYTES:
        raise SipError(f"message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise SipError("no blank line after the headers")
    try:
        text, wrong = head.decode("utf-8"), ""
    except UnicodeDecodeError:  # read on, so that a request whose Via is legible gets its 400
        text, wrong = head.decode("utf-8", "replace"), "headers are not UTF-8"
    first, *lines = text.split("\r\n")
    message = SipMessage()
    parts = first.split(" ", 2)
    if len(parts) == 3 and parts[0] == "SIP/2.0":
        if not _is_number(parts[1]) or not 100 <= int(parts[1]) <= 699:
            raise SipError(f"bad status line {first[:60]!r}")
        message.status, message.reason = int(parts[1]), parts[2]
    elif len(parts) == 3 and parts[2] == "SIP/2.0" and _TOKEN.match(parts[0]) and parts[1]:
        message.method, message.uri = parts[0].upper(), parts[1]
    else:
        raise SipError(f"bad start line {first[:60]!r}")
    for line in lines:
        if line[:1] in (" ", "\t") and message.headers:  # a folded continuation
            name, value = message.headers[-1]
            message.headers[-1] = (name, value + " " + line.strip())
            continue
        name, colon, value = line.partition(":")
        name = name.strip().lower()
        if not colon or not name or not _TOKEN.match(name):
            raise SipError(f"bad header line {line[:60]!r}")
        message.headers.append((COMPACT.get(name, name), value.strip()))
    missing = [h for h in REQUIRED if not message.get(h)]
    if missing:
        raise SipError(f"missing headers: {', '.join(missing)}", message)
    if wrong:
        raise SipError(wrong, message)
    number, _, method = message.get("cseq").partition(" ")
    if not _is_number(number.strip()) or not method.strip():
        raise SipError(f"bad CSeq {message.get('cseq')[:40]!r}", message)
    length = message.get("content-length", str(len(body)))
    if not _is_number(length) or int(length) > len(body):
        raise SipError(f"Content-Length {length[:20]!r} does not match the body", message)
    message.body = body[: int(length)]
    return message


def response(request: SipMessage, status: int, to_tag: str = "", extra: list[tuple[str, str]] | None = None,
             body: bytes = b"", source: tuple[str, int] | None = None) -> SipMessage:  # fmt: skip
    """The response to ``request``. ``source``: where it came from, recorded in the top
    Via (``received``, and ``rport`` when asked for) as RFC 3261 and 3581 say."""
    vias = request.all("via")
    if source is not None:
        vias[0] = re.sub(r";\s*rport(?=;|$)", f";rport={source[1]}", vias[0]) + f";received={source[0]}"
    headers: list[tuple[str, str]] = [("via", via) for via in vias]
    to = request.get("to")
    if to_tag and not param(to, "tag"):
        to += f";tag={to_tag}"
    headers += [("from", request.get("from")), ("to", to), ("call-id", request.call_id),
                ("cseq", request.get("cseq")), ("server", "duplex")]  # fmt: skip
    headers += extra or []
    return SipMessage(status=status, reason=REASONS.get(status, "Unknown"), headers=headers, body=body)


def in_dialog(request: SipMessage, invite: SipMessage, to_tag: str) -> bool:
    """Does ``request`` (with the Call-ID of ``invite``) belong to the dialog ``invite``
    began, to which we gave ``to_tag`` ("" before we answered)?

    The Call-ID travels in clear and is often guessable: alone it must not end or change
    a call. The caller's From tag must be the INVITE's, and (RFC 3261 12.2.2) the To tag
    ours. A CANCEL and the INVITE sent again belong to the INVITE's own transaction
    (17.2.3, 9.2): its top Via branch and CSeq number, and its To, with no tag. Where the
    request came from is for the caller of this to check."""
    if param(request.get("from"), "tag") != param(invite.get("from"), "tag"):
        return False
    their_to = param(request.get("to"), "tag")
    if request.method == "CANCEL" or (request.method == "INVITE" and not their_to):
        return (
            request.branch == invite.branch
            and request.cseq[0] == invite.cseq[0]
            and their_to == param(invite.get("to"), "tag")
        )
    return bool(to_tag) and their_to == to_tag


def new_tag() -> str:
    return secrets.token_hex(6)


def new_branch() -> str:
    return "z9hG4bK" + secrets.token_hex(8)


# -- SDP --


@dataclass(frozen=True)
class Offer:
    address: str  # where the caller wants our RTP
    port: int
    codecs: tuple[int, ...]  # static payload types offered, in preference order
    telephone_event: int | None  # dynamic payload type of RFC 4733 events, if offered


def parse_offer(body: bytes) -> Offer:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise SipError("the SDP is not UTF-8") from None
    addresses = {"session": "", "media": ""}  # a media-level c= overrides the session's
    media: list[str] | None = None
    rtpmap: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "c":
            fields = value.split()
            if len(fields) == 3 and fields[:2] == ["IN", "IP4"]:
                addresses["session" if media is None else "media"] = fields[2]
        elif key == "m" and value.startswith("audio ") and media is None:
            media = value.split()
        elif key == "a" and value.startswith("rtpmap:"):
            pt, _, name = value[7:].partition(" ")
            rtpmap[pt] = name.lower()
    address = addresses["media"] or addresses["session"]
    try:  # a name would be looked up on every packet sent, on the event loop
        ipaddress.IPv4Address(address)
    except ValueError:
        raise SipError(f"the SDP's connection address {address[:40]!r} is not an IPv4 address") from None
    if media is None or len(media) < 4 or not _is_number(media[1]) or not address:
        raise SipError("the SDP has no audio stream with an IPv4 address")
    types = [int(t) for t in media[3:] if _is_number(t) and int(t) < 128]
    codecs = tuple(t for t in types if t in (0, 8))
    events = [t for t in types if rtpmap.get(str(t), "").startswith("telephone-event/8000")]
    port = int(media[1])
    if not 0 < port < 65536:
        raise SipError(f"bad RTP port {port}")
    return Offer(address, port, codecs, events[0] if events else None)


def answer_sdp(address: str, port: int, codec: int, telephone_event: int | None, session_id: int) -> bytes:
    types = f"{codec}" + (f" {telephone_event}" if telephone_event is not None else "")
    lines = [
        "v=0",
        f"o=duplex {session_id} {session_id} IN IP4 {address}",
        "s=duplex",
        f"c=IN IP4 {address}",
        "t=0 0",
        f"m=audio {port} RTP/AVP {types}",
        f"a=rtpmap:{codec} {'PCMU' if codec == 0 else 'PCMA'}/8000",
    ]
    if telephone_event is not None:
        lines += [f"a=rtpmap:{telephone_event} telephone-event/8000", f"a=fmtp:{telephone_event} 0-15"]
    lines += ["a=ptime:20", "a=sendrecv"]
    return ("\r\n".join(lines) + "\r\n").encode()


# -- digest authentication --


def _md5(text: str) -> str:
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


class DigestAuth:
    """Challenges and checks ``Authorization: Digest`` (MD5, qop=auth or none).

    A captured header must not open a second call: each nonce carries the time it was
    issued (HMAC-signed, so it cannot be forged) and is good for `NONCE_TTL_S`; each use
    of it must count up (``nc``, RFC 2617 3.2.2; a use without qop is the nonce's only
    one); and the digest's ``uri`` must be the request's own. The record of uses is
    bounded: nonces past their lifetime are forgotten, and at most `MAX_NONCES` kept."""

    NONCE_TTL_S = 300
    MAX_NONCES = 4096

    def __init__(
        self, username: str, password: str, realm: str = "duplex", clock: Callable[[], float] = time.time
    ) -> None:
        self.username, self.realm = username, realm
        self._ha1 = _md5(f"{username}:{realm}:{password}")
        self._key = secrets.token_bytes(16)
        self._clock = clock
        self._used: dict[str, int] = {}  # nonce -> the highest nc it was used with
        self._floor = -1  # nonces issued at or before this second are refused (their records went)

    def _nonce(self, salt: str) -> str:
        return salt + hmac.new(self._key, salt.encode(), "sha256").hexdigest()[:24]

    def challenge(self) -> str:
        issued = f"{int(self._clock()) & 0xFFFFFFFF:08x}"
        nonce = self._nonce(issued + secrets.token_hex(4))
        return f'Digest realm="{self.realm}", nonce="{nonce}", algorithm=MD5, qop="auth"'

    def check(self, request: SipMessage) -> bool:
        header = request.get("authorization")
        if not header.lower().startswith("digest "):
            return False
        fields = {k.lower(): a or b for k, a, b in re.findall(r'(\w+)=(?:"([^"]*)"|([^,\s]*))', header[7:])}
        nonce = fields.get("nonce", "")
        if (
            fields.get("username") != self.username
            or fields.get("realm") != self.realm
            or fields.get("uri") != request.uri
            or len(nonce) != 40
            or not hmac.compare_digest(nonce, self._nonce(nonce[:16]))
        ):
            return False
        issued = int(nonce[:8], 16)
        if (int(self._clock()) - issued) & 0xFFFFFFFF > self.NONCE_TTL_S or issued <= self._floor:
            return False  # stale: the client gets a new challenge
        ha2 = _md5(f"{request.method}:{fields['uri']}")
        nc = fields.get("nc", "")
        if fields.get("qop"):
            if not (len(nc) == 8 and all(c in "0123456789abcdefABCDEF" for c in nc)):
                return False
            count = int(nc, 16)
            expected = _md5(f"{self._ha1}:{nonce}:{nc}:{fields.get('cnonce', '')}:auth:{ha2}")
        else:
            count = 1
            expected = _md5(f"{self._ha1}:{nonce}:{ha2}")
        if not hmac.compare_digest(expected, fields.get("response", "")):
            return False
        if count <= self._used.get(nonce, 0):
            return False  # a replay of a header already used
        self._remember(nonce, count)
        return True

    def _remember(self, nonce: str, count: int) -> None:
        self._used[nonce] = count
        if len(self._used) > self.MAX_NONCES:
            now = int(self._clock())
            live = {
                n: c for n, c in self._used.items() if (now - int(n[:8], 16)) & 0xFFFFFFFF <= self.NONCE_TTL_S
            }
            while len(live) > self.MAX_NONCES:  # all live: the oldest go, and with them every
                oldest = next(iter(live))  # nonce as old (a forgotten one must not replay)
                self._floor = max(self._floor, int(oldest[:8], 16))
                del live[oldest]
            self._used = live
