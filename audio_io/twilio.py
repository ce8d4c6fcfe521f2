"""Twilio Media Streams: the JSON messages of a bidirectional stream (``<Connect><Stream>``).

The provider connects to our WebSocket and sends, in order:

    connected ─► start (streamSid, callSid, customParameters, mediaFormat)
              ─► media (base64 μ-law, 8 kHz, 20 ms) ... dtmf ... mark (echoes) ... ─► stop

and takes from us ``media`` (audio to play, queued in order), ``mark`` (echoed back
once the audio sent before it has been played: the playout ledger's evidence) and
``clear`` (drop the queued audio: barge-in). This module parses and builds those
messages; it knows nothing of sessions. `parse` checks every field it uses and raises
`ProtocolError` with a code, so a bad message is refused on its own, never half-read.
What a message may carry is bounded (a second of audio in a ``media``, `MAX_PARAMETERS`
custom parameters in ``start``), so nothing a call keeps grows with what a caller sends.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import quoteattr

RATE = 8000
FRAME_BYTES = 160  # 20 ms of μ-law at 8 kHz
MAX_MEDIA_BYTES = 8000  # one second; Twilio sends 20 ms chunks
DIGITS = frozenset("0123456789*#ABCD")
MAX_PARAMETERS = 64  # <Parameter>s of a <Stream> (the token among them); kept for the whole call


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Connected:
    protocol: str


@dataclass(frozen=True)
class Start:
    stream_sid: str
    call_sid: str
    account_sid: str
    custom_parameters: dict[str, str] = field(default_factory=dict)
    tracks: tuple[str, ...] = ("inbound",)


@dataclass(frozen=True)
class Media:
    payload: bytes  # μ-law codes
    timestamp_ms: int | None  # from the stream's start, when given
    track: str


@dataclass(frozen=True)
class Mark:
    name: str


@dataclass(frozen=True)
class Dtmf:
    digit: str


@dataclass(frozen=True)
class Stop:
    pass


Message = Connected | Start | Media | Mark | Dtmf | Stop


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", f"{where} must be an object")
    return value


def _string(obj: dict[str, Any], key: str, where: str, max_len: int = 256) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise ProtocolError("bad_message", f"{where}.{key} must be a non-empty string")
    return value


def _millis(stamp: Any) -> int | None:
    """``media.timestamp``: milliseconds since the stream began, a string of digits as
    Twilio sends it (or a whole number); anything else (``1e400``, ``-5``, ``true``, ``"²"``)
    is a `ProtocolError`."""
    if stamp is None:
        return None
    if isinstance(stamp, str) and 0 < len(stamp) <= 15 and stamp.isascii() and stamp.isdigit():
        return int(stamp)
    if isinstance(stamp, int) and not isinstance(stamp, bool) and 0 <= stamp < 10**15:
        return stamp
    raise ProtocolError("bad_media", "media.timestamp must be milliseconds (a string of digits)")


def parse(text: str | bytes) -> Message:
    """One message from the provider; `ProtocolError` for anything malformed."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("bad_json", "messages are JSON objects") from None
    message = _object(raw, "the message")
    kind = message.get("event")
    if kind == "media":
        media = _object(message.get("media"), "media")
        payload = media.get("payload")
        if not isinstance(payload, str) or len(payload) > MAX_MEDIA_BYTES * 4 // 3 + 4:
            raise ProtocolError(
                "bad_media", f"media.payload must be base64 of at most {MAX_MEDIA_BYTES} bytes"
            )
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("bad_media", "media.payload is not valid base64") from None
        timestamp = _millis(media.get("timestamp"))
        track = media.get("track", "inbound")
        return Media(audio, timestamp, track if isinstance(track, str) else "inbound")
    if kind == "mark":
        return Mark(_string(_object(message.get("mark"), "mark"), "name", "mark"))
    if kind == "dtmf":
        digit = _object(message.get("dtmf"), "dtmf").get("digit")
        if not isinstance(digit, str) or digit not in DIGITS:
            raise ProtocolError("bad_message", "dtmf.digit must be one of 0-9 * # A-D")
        return Dtmf(digit)
    if kind == "start":
        start = _object(message.get("start"), "start")
        params = start.get("customParameters") or {}
        if (
            not isinstance(params, dict)
            or len(params) > MAX_PARAMETERS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items())
        ):
            raise ProtocolError(
                "bad_message", f"start.customParameters must map strings to strings, at most {MAX_PARAMETERS}"
            )
        fmt = _object(start.get("mediaFormat") or {}, "start.mediaFormat")
        encoding, rate = fmt.get("encoding", "audio/x-mulaw"), fmt.get("sampleRate", RATE)
        if encoding != "audio/x-mulaw" or rate != RATE or fmt.get("channels", 1) != 1:
            raise ProtocolError(
                "bad_format", f"only audio/x-mulaw, 8000 Hz, mono is supported (got {encoding}, {rate} Hz)"
            )
        tracks = start.get("tracks", ["inbound"])
        return Start(
            stream_sid=_string(start, "streamSid", "start"),
            call_sid=_string(start, "callSid", "start"),
            account_sid=start.get("accountSid", "") if isinstance(start.get("accountSid"), str) else "",
            custom_parameters=params,
            tracks=tuple(t for t in tracks if isinstance(t, str))
            if isinstance(tracks, list)
            else ("inbound",),
        )
    if kind == "connected":
        protocol = message.get("protocol")
        return Connected(protocol if isinstance(protocol, str) else "")
    if kind == "stop":
        return Stop()
    raise ProtocolError("unknown_event", f"unknown event {str(kind)[:40]!r}")


def media(stream_sid: str, ulaw: bytes) -> str:
    payload = base64.b64encode(ulaw).decode("ascii")
    return json.dumps({"event": "media", "streamSid": stream_sid, "media": {"payload": payload}})


def mark(stream_sid: str, name: str) -> str:
    return json.dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def clear(stream_sid: str) -> str:
    return json.dumps({"event": "clear", "streamSid": stream_sid})


def twiml(stream_url: str, parameters: dict[str, str]) -> str:
    """The TwiML that connects a call to a bidirectional stream at ``stream_url``."""
    params = "".join(f"<Parameter name={quoteattr(k)} value={quoteattr(v)}/>" for k, v in parameters.items())
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Connect><Stream url={quoteattr(stream_url)}>{params}</Stream></Connect></Response>"
    )
