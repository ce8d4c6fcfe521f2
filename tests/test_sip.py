"""Telephony over SIP/RTP: SIP, SDP, digest and RTP bookkeeping alone, then the listener
with the real models, called by a real SIP agent (baresip: ``aufile`` plays the
caller's WAV, ``sndfile`` records what it hears, ALSA's ``null`` device plays it) and
by a raw UDP client for hostile input, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import random
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from audio_io import sip
from audio_io.g711 import ulaw_encode
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from audio_io.rtp import Concealer, DtmfReceiver, JitterBuffer, Released, RtpError, RtpPacket
from audio_io.wav import read_wav, write_wav
from benchmarks.speech_set import wer
from duplex import events as ev
from duplex.config import Config
from duplex.events import Event
from duplex.metrics import LoopLag
from duplex.sessions import Sessions
from duplex.transports.sip import ACK_TIMEOUT_S, BAD_SIP, SipListener
from duplex.transports.sip_call import SipCall
from duplex.transports.sip_media import RTP_DROPPED, RtpWire, heard_from
from tests.conftest import speech

QUESTION = "What is the largest ocean on Earth?"

# -- SIP, SDP and digest alone --

INVITE = (
    "INVITE sip:duplex@127.0.0.1:5080 SIP/2.0\r\n"
    "Via: SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bK1;rport\r\n"
    "Via: SIP/2.0/UDP 10.0.0.9:5060;branch=z9hG4bK0\r\n"
    "f: <sip:caller@127.0.0.1>;tag=abc\r\n"
    "To: <sip:duplex@127.0.0.1>\r\n"
    "Call-ID: call-1\r\n"
    "CSeq: 1 INVITE\r\n"
    "Contact: <sip:caller@127.0.0.1:5071>\r\n"
    "Content-Type: application/sdp\r\n"
    "Content-Length: {length}\r\n\r\n{body}"
)
SDP = (
    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio {port} RTP/AVP {types}\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\n"
    "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\n"
)


def invite(
    port: int = 4000, types: str = "8 0 101", call_id: str = "call-1", cseq: int = 1, **headers: str
) -> bytes:
    body = SDP.format(port=port, types=types)
    text = (
        INVITE.format(length=len(body), body=body)
        .replace("call-1", call_id)
        .replace("1 INVITE", f"{cseq} INVITE")
    )
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return text.replace("Content-Type", extra + "Content-Type", 1).encode()


def test_sip_messages_are_read_answered_and_refused():
    message = sip.parse(invite())
    assert message.method == "INVITE" and message.call_id == "call-1" and message.cseq == (1, "INVITE")
    assert message.get("from") == "<sip:caller@127.0.0.1>;tag=abc"  # compact form "f"
    offer = sip.parse_offer(message.body)
    assert offer == sip.Offer("127.0.0.1", 4000, (8, 0), 101)
    ok = sip.response(message, 200, "xyz", source=("127.0.0.1", 5071))
    text = ok.to_bytes().decode()
    assert text.startswith("SIP/2.0 200 OK\r\n")
    assert "Via: SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bK1;rport=5071;received=127.0.0.1\r\n" in text
    assert "Via: SIP/2.0/UDP 10.0.0.9:5060;branch=z9hG4bK0\r\n" in text
    assert "To: <sip:duplex@127.0.0.1>;tag=xyz\r\n" in text and text.endswith("Content-Length: 0\r\n\r\n")
    assert sip.parse(ok.to_bytes()).status == 200
    answer = sip.parse_offer(sip.answer_sdp("127.0.0.1", 4002, 8, 101, 7))
    assert answer == sip.Offer("127.0.0.1", 4002, (8,), 101)
    for bad in [
        b"hello",
        b"INVITE sip:x SIP/2.0\r\nVia: x\r\n\r\n",  # no Call-ID, CSeq, ...
        invite().replace(b"CSeq: 1 INVITE", b"CSeq: one INVITE"),
        invite().replace(b"Content-Length: ", b"Content-Length: 9"),
        # digits to str.isdigit, not to int: once a traceback and no answer
        invite().replace(b"Content-Length: ", "Content-Length: \u00b2".encode()),
        invite().replace(b"CSeq: 1 INVITE", "CSeq: \u00b2 INVITE".encode()),
        "SIP/2.0 \u00b200 OK\r\nVia: x\r\nFrom: a\r\nTo: b\r\nCall-ID: c\r\nCSeq: 1 BYE\r\n\r\n".encode(),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"INVITE sip:x SIP/2.0\r\n\xff\xfe: x\r\n\r\n",
        b"X" * 20000,
    ]:
        with pytest.raises(sip.SipError):
            sip.parse(bad)
    for sdp in [
        b"v=0\r\n",
        SDP.format(port=70000, types="0").encode(),
        SDP.format(port="\u00b2", types="0").encode(),
        SDP.replace("c=IN IP4 127.0.0.1", "c=IN IP4 pbx.example").format(port=4000, types="0").encode(),
        b"\xff",
    ]:
        with pytest.raises(sip.SipError):
            sip.parse_offer(sdp)
    assert sip.parse_offer(SDP.format(port=4000, types="9 101").encode()).codecs == ()


def test_a_request_with_bytes_not_utf8_in_a_header_can_still_be_answered_400():
    bad = invite().replace(b"CSeq: 1 INVITE", b"Subject: caf\xe9\r\nCSeq: 1 INVITE")
    with pytest.raises(sip.SipError) as raised:
        sip.parse(bad)
    assert raised.value.partial is not None and raised.value.partial.call_id == "call-1"
    assert sip.parse(sip.response(raised.value.partial, 400).to_bytes()).status == 400


def request_in(dialog: bytes, method: str, cseq: int = 1, **change: str) -> sip.SipMessage:
    """``method`` with the headers of ``dialog`` (an INVITE), some of them changed."""
    text = dialog.decode().replace("INVITE sip:", f"{method} sip:", 1).replace("1 INVITE", f"{cseq} {method}")
    for name, value in change.items():
        text = re.sub(
            rf"^{name}: [^\r\n]*", f"{name}: {value}", text, count=1, flags=re.MULTILINE | re.IGNORECASE
        )
    return sip.parse(text.encode())


def test_in_dialog_requests_must_carry_the_dialogs_tags():
    first = sip.parse(invite())  # From tag "abc", no To tag; we answered with To tag "ours"
    ours = "To: <sip:duplex@127.0.0.1>;tag=ours"
    theirs = "f: <sip:caller@127.0.0.1>;tag=abc"
    assert sip.in_dialog(request_in(invite(), "BYE", 2, To=ours[4:]), first, "ours")
    assert sip.in_dialog(request_in(invite(), "ACK", 1, To=ours[4:]), first, "ours")
    assert sip.in_dialog(request_in(invite(), "INVITE", 2, To=ours[4:]), first, "ours")  # a re-INVITE
    assert sip.in_dialog(request_in(invite(), "INVITE", 1), first, "ours")  # the INVITE again
    assert sip.in_dialog(request_in(invite(), "CANCEL", 1), first, "")  # before the answer too
    for stranger in [
        request_in(invite(), "BYE", 2),  # no To tag: knows the Call-ID only
        request_in(invite(), "BYE", 2, To="<sip:duplex@127.0.0.1>;tag=guess"),
        request_in(invite(), "BYE", 2, To=ours[4:], f=theirs[3:].replace("abc", "abd")),
        request_in(invite(), "BYE", 2, To=ours[4:], f="<sip:caller@127.0.0.1>"),
        request_in(invite(), "ACK", 1, f=theirs[3:].replace("abc", "xyz"), To=ours[4:]),
        request_in(invite(), "INVITE", 2),  # a "re-INVITE" outside the dialog
        request_in(invite(), "INVITE", 1, f="<sip:caller@127.0.0.1>;tag=other"),
        request_in(invite(), "CANCEL", 1, Via="SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bKother"),
        request_in(invite(), "CANCEL", 2),
    ]:
        assert not sip.in_dialog(stranger, first, "ours"), stranger.to_bytes()
    assert not sip.in_dialog(request_in(invite(), "BYE", 2, To=ours[4:]), first, "")  # not answered yet


def test_digest_authentication_checks_the_response():
    auth = sip.DigestAuth("alice", "secret")
    challenge = auth.challenge()
    nonce = re.search(r'nonce="([^"]+)"', challenge).group(1)  # type: ignore[union-attr]

    def md5(s: str) -> str:
        return hashlib.md5(s.encode()).hexdigest()

    def authorized(password: str, nonce: str = nonce, user: str = "alice") -> sip.SipMessage:
        ha1, ha2 = md5(f"{user}:duplex:{password}"), md5("INVITE:sip:duplex@127.0.0.1:5080")
        response = md5(f"{ha1}:{nonce}:00000001:c0ffee:auth:{ha2}")
        header = (
            f'Digest username="{user}", realm="duplex", nonce="{nonce}", uri="sip:duplex@127.0.0.1:5080", '
            f'response="{response}", qop=auth, nc=00000001, cnonce="c0ffee", algorithm=MD5'
        )
        return sip.parse(invite(Authorization=header))

    assert auth.check(authorized("secret"))
    assert not auth.check(authorized("wrong"))
    assert not auth.check(authorized("secret", user="mallory"))
    assert not auth.check(authorized("secret", nonce="0" * 40))  # a nonce we never gave
    assert not auth.check(sip.parse(invite()))


def test_a_digest_header_cannot_be_replayed_and_its_nonce_expires():
    now = [1_000_000.0]
    auth = sip.DigestAuth("alice", "secret", clock=lambda: now[0])
    uri = "sip:duplex@127.0.0.1:5080"  # the Request-URI of `invite()`

    def md5(s: str) -> str:
        return hashlib.md5(s.encode()).hexdigest()

    def fresh_nonce() -> str:
        found = re.search(r'nonce="([^"]+)"', auth.challenge())
        assert found is not None
        return found.group(1)

    def call(nonce: str, nc: int | None, call_id: str, digest_uri: str = uri) -> sip.SipMessage:
        ha1, ha2 = md5("alice:duplex:secret"), md5(f"INVITE:{digest_uri}")
        if nc is None:  # RFC 2069: no qop, no count
            fields = f'response="{md5(f"{ha1}:{nonce}:{ha2}")}"'
        else:
            count = f"{nc:08x}"
            response = md5(f"{ha1}:{nonce}:{count}:c0ffee:auth:{ha2}")
            fields = f'response="{response}", qop=auth, nc={count}, cnonce="c0ffee"'
        header = f'Digest username="alice", realm="duplex", nonce="{nonce}", uri="{digest_uri}", {fields}'
        return sip.parse(invite(call_id=call_id, Authorization=header))

    nonce = fresh_nonce()
    assert auth.check(call(nonce, 1, "call-1"))
    assert not auth.check(call(nonce, 1, "call-2"))  # the same header on a new Call-ID: a replay
    assert auth.check(call(nonce, 2, "call-3"))  # the client counts up
    assert not auth.check(call(nonce, 2, "call-4")) and not auth.check(call(nonce, 1, "call-5"))
    assert not auth.check(call(nonce, 3, "call-6", digest_uri="sip:someone@127.0.0.1"))  # not this request's
    bare = fresh_nonce()
    assert auth.check(call(bare, None, "call-7"))
    assert not auth.check(call(bare, None, "call-8"))  # without qop a nonce is good once
    now[0] += sip.DigestAuth.NONCE_TTL_S + 1
    assert not auth.check(call(nonce, 9, "call-9"))  # stale
    assert auth.check(call(fresh_nonce(), 1, "call-10"))
    # the record of uses is bounded, and a nonce whose record went cannot come back
    auth.MAX_NONCES = 3
    nonces = []
    for i in range(5):
        now[0] += 1
        nonces.append(fresh_nonce())
        assert auth.check(call(nonces[-1], 1, f"flood-{i}"))
    assert len(auth._used) <= 3
    assert not auth.check(call(nonces[0], 2, "flood-again"))
    assert auth.check(call(nonces[-1], 2, "flood-next"))


def call_from(signaling: tuple[str, int], offer: sip.Offer) -> SipCall:
    return SipCall("c", sip.parse(invite()), signaling, "t", offer, 0, "127.0.0.1")


def test_media_goes_to_the_caller_and_rtp_is_latched_to_its_source():
    listener = SipListener(Config(), Sessions(1, 60))
    assert listener._media_host("198.51.100.9", "127.0.0.1") == "127.0.0.1"  # never a third party
    assert listener._media_host("127.0.0.1", "127.0.0.1") == "127.0.0.1"
    gateway = SipListener(Config(sip_allow="10.0.0.0/8"), Sessions(1, 60))
    assert gateway._media_host("10.0.0.5", "127.0.0.1") == "10.0.0.5"  # an allow-listed media host
    heard = heard_from
    # behind NAT: the SDP names a private address; the caller's RTP comes from its NAT's port
    natted = call_from(("203.0.113.5", 5060), sip.Offer("192.168.1.20", 4000, (0,), 101))
    natted.media = ("203.0.113.5", 4000)
    assert not heard(natted, ("198.51.100.9", 4000))  # another host: never
    assert heard(natted, ("203.0.113.5", 31000)) and natted.media == ("203.0.113.5", 31000)  # latched
    assert not heard(natted, ("203.0.113.5", 4000))  # then another port of that host is not the caller
    # not behind NAT: a packet from exactly the SDP's address wins the media back
    direct = call_from(("127.0.0.1", 5060), sip.Offer("127.0.0.1", 4000, (0,), 101))
    direct.media = ("127.0.0.1", 4000)
    assert heard(direct, ("127.0.0.1", 5555))  # first from that host: latched ...
    assert heard(direct, ("127.0.0.1", 4000)) and direct.media == (
        "127.0.0.1",
        4000,
    )  # ... until the SDP's own
    assert not heard(direct, ("127.0.0.1", 5555))


# -- RTP alone --


def packet(
    seq: int, ts: int | None = None, ssrc: int = 7, pt: int = 0, payload: bytes | None = None
) -> RtpPacket:
    return RtpPacket(pt, seq % 65536, (ts if ts is not None else seq * 160) % (1 << 32), ssrc,
                     payload if payload is not None else bytes([seq % 256]) * 160)  # fmt: skip


def test_rtp_packets_round_trip_and_refuse_garbage():
    p = packet(65535, marker_ts := 123, 99)
    assert RtpPacket.parse(p.build()) == p and marker_ts == 123
    # CSRCs, an extension and padding are skipped
    raw = bytes([0xB1, 0x00]) + struct.pack("!HII", 1, 2, 3) + b"\0\0\0\1" + b"\xbe\xde\0\1" + b"\0" * 4
    raw += b"\x55" * 160 + b"\0\0\3"
    assert RtpPacket.parse(raw).payload == b"\x55" * 160
    for bad in [b"", b"\x80\x00", b"\x40" + b"\0" * 20, bytes([0x90]) + b"\0" * 11]:
        with pytest.raises(RtpError):
            RtpPacket.parse(bad)


def test_the_jitter_buffer_reorders_conceals_and_follows_new_streams():
    buffer = JitterBuffer(depth=3)

    def seqs(out: list[Released]) -> list[object]:
        return [o.payload[0] if o.payload else f"lost {o.concealed}" for o in out]

    assert seqs(buffer.push(packet(5))) == [5]
    assert seqs(buffer.push(packet(6))) == [6]
    assert seqs(buffer.push(packet(8))) == []  # 7 missing: held
    assert seqs(buffer.push(packet(7))) == [7, 8]  # reordered, in time
    assert seqs(buffer.push(packet(6))) == [] and buffer.late == 1  # repeated
    assert seqs(buffer.push(packet(10))) == []
    assert seqs(buffer.push(packet(11))) == []
    assert seqs(buffer.push(packet(12))) == ["lost 160", 10, 11, 12]  # 9 given up
    assert buffer.lost == 1
    assert seqs(buffer.push(packet(9))) == []  # too late now
    assert seqs(buffer.push(packet(13, ssrc=8))) == [13] and buffer.restarts == 1  # a new source
    assert seqs(buffer.push(packet(65535 + 14, ssrc=8))) == []  # wraps: held behind 14
    assert seqs(buffer.push(packet(14, ssrc=8))) == [14]
    assert seqs(buffer.push(packet(5000, ssrc=8))) == [5000 % 256]  # a jump: a fresh start
    concealer = Concealer()
    concealer.good(np.full(160, 1000, np.int16))
    filled = concealer.conceal(480)
    assert filled[0] == 1000 and filled[100] > 0 and not filled[320:].any()  # fades out, then silence
    dtmf = DtmfReceiver()
    press = [packet(1, 800, pt=101, payload=bytes([5, 0, 0, d])) for d in (80, 160, 240)]
    assert [dtmf.push(p) for p in press] == ["5", None, None]  # one press, one digit
    assert dtmf.push(packet(9, 2400, pt=101, payload=b"\x0b\x80\x00\xf0")) == "#"


# -- the listener, with the real models --


class Recorder:
    """Every event the calls' sessions sent (a spy on the real sink)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[Event] = []
        original = RtpWire.event

        def on_event(wire: RtpWire, e: Event) -> list[bytes]:
            self.events.append(e)
            return original(wire, e)

        monkeypatch.setattr(RtpWire, "event", on_event)

    def of(self, type_: str) -> list[Event]:
        return [e for e in self.events if e.type == type_]


async def start_listener(
    engines, ack_timeout_s: float = ACK_TIMEOUT_S, max_unacked: int = 8, max_unacked_per_source: int = 2,
    **options: object,
) -> tuple[SipListener, Sessions]:  # fmt: skip
    config = Config(**{"sip_port": 0, "session_idle_timeout_s": 3, "max_sessions": 4, **options})  # type: ignore[arg-type]
    sessions = Sessions(config.max_sessions, config.session_idle_timeout_s)
    sessions.attach(engines)
    listener = SipListener(
        config, sessions, ack_timeout_s=ack_timeout_s, max_unacked=max_unacked,
        max_unacked_per_source=max_unacked_per_source,
    )  # fmt: skip
    await listener.start()
    return listener, sessions


@pytest_asyncio.fixture(loop_scope="session")
async def served(engines):
    listener, sessions = await start_listener(engines)
    yield listener, sessions
    await listener.stop()
    await sessions.close_all()


class Baresip:
    """baresip as the caller, in its own config directory: it dials, plays ``wav``
    (at 8 kHz), records what it hears, and hangs up when the file ends."""

    def __init__(self, directory: Path, wav: Path, account: str = "") -> None:
        self.directory = directory
        (directory / "rec").mkdir(parents=True)
        port = free_sip_port()
        (directory / "config").write_text(
            "\n".join(
                [
                    "poll_method epoll",
                    f"sip_listen 127.0.0.1:{port}",
                    "net_interface 127.0.0.1",
                    f"audio_source aufile,{wav}",
                    "audio_player alsa,null",
                    "audio_alert alsa,null",
                    "module_path /usr/lib/baresip/modules",
                    "module g711.so",
                    "module aufile.so",
                    "module alsa.so",
                    "module sndfile.so",
                    "module_app menu.so",
                    "module_app account.so",
                    f"snd_path {directory / 'rec'}",
                    "rtp_timeout 0",
                    "",
                ]
            )
        )
        (directory / "accounts").write_text(f"<sip:caller@127.0.0.1>;regint=0{account}\n")
        self.process: asyncio.subprocess.Process | None = None
        self.log = ""

    async def call(self, port: int, seconds: float) -> None:
        self.process = await asyncio.create_subprocess_exec(
            "baresip", "-f", str(self.directory), "-e", f"/dial sip:duplex@127.0.0.1:{port}",
            "-t", str(int(seconds)), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(self.process.communicate(), seconds + 20)
        self.log = out.decode(errors="replace")

    def heard(self) -> np.ndarray:
        (path,) = (self.directory / "rec").glob("*-dec.wav")
        audio, rate = read_wav(path)
        return resample(audio, rate, RUNTIME_RATE)


async def eventually(condition: Callable[[], bool], within: float) -> None:
    """Poll ``condition`` (state of the server under test, which has no event to wait on)."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def free_sip_port() -> int:
    """A port for baresip's ``sip_listen``: it binds UDP and TCP there, and TLS (TCP) on
    the next port. A port free for UDP alone once failed the call ("SIP/TLS transport
    failed: Address already in use" on the next port, in make test)."""
    while True:
        with contextlib.ExitStack() as stack:
            udp = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            try:
                for p in (port, port + 1):
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(
                        ("127.0.0.1", p)
                    )
            except OSError:
                continue
        return port


def caller_wav(tts_engine, path: Path, text: str, silence_s: float) -> Path:
    voice = resample(speech(tts_engine, text), RUNTIME_RATE, 8000)
    write_wav(
        path,
        np.concatenate([np.zeros(4000, np.int16), voice, np.zeros(int(silence_s * 8000), np.int16)]),
        8000,
    )
    return path


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_baresip_calls_asks_and_hears_the_reply_then_hangs_up(
    served, tts_engine, asr_engine, tmp_path, monkeypatch
):
    listener, sessions = served
    recorder = Recorder(monkeypatch)
    phone = Baresip(tmp_path / "baresip", caller_wav(tts_engine, tmp_path / "q.wav", QUESTION, silence_s=12))
    await phone.call(listener.port, seconds=30)
    assert "Call established" in phone.log and "terminated" in phone.log, phone.log[-2000:]
    (final,) = recorder.of(ev.TRANSCRIPT_DONE)
    assert wer([(QUESTION, final.data["transcript"])]) <= 0.2
    reply = "".join(e.data["delta"] for e in recorder.of(ev.TEXT_DELTA))
    assert "Pacific" in reply and recorder.of(ev.RESPONSE_DONE)[0].data["status"] == "completed"
    heard = phone.heard()  # what baresip decoded from our RTP
    voiced = np.abs(heard.astype(np.int32)) > 500
    assert voiced.sum() / RUNTIME_RATE >= 0.5  # not silence
    assert wer([(reply, asr_engine.transcribe(heard))]) <= 0.3
    await asyncio.sleep(0.3)  # the caller's BYE ended the call and its session
    assert not listener.calls and len(sessions) == 0
    assert not [t for t in asyncio.all_tasks() if "-sip-" in t.get_name()]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_the_server_hangs_up_and_digest_auth_lets_the_right_caller_in(
    engines, tts_engine, tmp_path, monkeypatch
):
    listener, sessions = await start_listener(engines, sip_username="alice", sip_password="s3cret-pass")
    try:
        wav = caller_wav(tts_engine, tmp_path / "q.wav", "Hello there.", silence_s=20)
        wrong = Baresip(tmp_path / "wrong", wav, ";auth_user=alice;auth_pass=nope")
        await wrong.call(listener.port, seconds=4)
        assert "Call established" not in wrong.log and "401" in wrong.log or "403" in wrong.log, wrong.log[
            -1500:
        ]
        phone = Baresip(tmp_path / "right", wav, ";auth_user=alice;auth_pass=s3cret-pass")
        calling = asyncio.create_task(phone.call(listener.port, seconds=20))
        await eventually(lambda: bool(listener.calls), 15)
        (call,) = listener.calls.values()
        await asyncio.sleep(1.0)
        assert call.session is not None
        await sessions.close(call.session)  # the session ends (as at an idle timeout): BYE
        await calling
        assert "Call established" in phone.log
        assert re.search(r"terminated \(duration: [0-9] secs?\)", phone.log), phone.log[-1500:]
        assert not listener.calls and len(sessions) == 0
    finally:
        await listener.stop()


class RawPhone:
    """A hand-made SIP/RTP endpoint on UDP, for what no real agent sends; at ``host``
    (any 127.x address: another source for the listener on 127.0.0.1)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sip.bind((host, 0))
        self.sip.setblocking(False)
        self.rtp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rtp.bind((host, 0))
        self.rtp.setblocking(False)
        self.rtp_port = self.rtp.getsockname()[1]
        self.inbox: list[sip.SipMessage] = []  # messages of other calls, read meanwhile

    async def request(self, data: bytes, port: int, until: int = 200) -> list[sip.SipMessage]:
        """Send, and read responses until a final one (>= ``until``); what comes for
        other calls meanwhile is kept for `received`."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendto(self.sip, data, ("127.0.0.1", port))
        call_id = re.search(rb"^Call-ID: *(\S*)", data, re.MULTILINE | re.IGNORECASE)
        out: list[sip.SipMessage] = []
        async with asyncio.timeout(10):
            while not out or out[-1].status < until:
                data = (await loop.sock_recvfrom(self.sip, 65536))[0]
                try:
                    message = sip.parse(data)
                except sip.SipError as e:  # an answer to a request that lacked headers lacks them too
                    assert e.partial is not None
                    message = e.partial
                if call_id is not None and message.call_id not in ("", call_id.group(1).decode()):
                    self.inbox.append(message)
                else:
                    out.append(message)
        return out

    async def silent(self, data: bytes, port: int, wait: float = 0.5) -> bool:
        """Send; True when nothing comes back."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendto(self.sip, data, ("127.0.0.1", port))
        try:
            async with asyncio.timeout(wait):
                await loop.sock_recvfrom(self.sip, 65536)
        except TimeoutError:
            return True
        return False

    def invite(self, call_id: str, types: str = "0 101", cseq: int = 1, **headers: str) -> bytes:
        sip_port = self.sip.getsockname()[1]
        return (
            invite(self.rtp_port, types, call_id, cseq, **headers)
            .replace(b"127.0.0.1:5071", f"{self.host}:{sip_port}".encode())
            .replace(b"IN IP4 127.0.0.1", f"IN IP4 {self.host}".encode())  # as long: Content-Length holds
        )

    async def call(self, request: bytes, port: int) -> sip.SipMessage:
        """INVITE (``request``), 200, ACK: an answered call; its 200."""
        answered = await self.request(request, port)
        assert [m.status for m in answered] == [100, 200], [m.status for m in answered]
        loop = asyncio.get_running_loop()
        await loop.sock_sendto(self.sip, in_dialog(request, answered[-1], "ACK"), ("127.0.0.1", port))
        return answered[-1]

    def received(self) -> list[sip.SipMessage]:
        """What has come to the SIP socket so far, not waiting."""
        out, self.inbox = self.inbox, []
        with contextlib.suppress(BlockingIOError):
            while True:
                out.append(sip.parse(self.sip.recv(65536)))
        return out

    def rtp_received(self) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                self.rtp.recv(2048)
                count += 1
        return count

    def close(self) -> None:
        self.sip.close()
        self.rtp.close()


def dropped(reason: str) -> float:
    return RTP_DROPPED.labels(reason)._value.get()


def refused(reason: str) -> float:
    return BAD_SIP.labels(reason)._value.get()


def in_dialog(
    invite: bytes, ok: sip.SipMessage, method: str, cseq: int | None = None, **change: str
) -> bytes:
    """A request in the dialog that ``invite`` began and ``ok`` (our 200) answered: the
    INVITE's top Via (a new branch), From and Call-ID, our To with its tag; ``change``
    replaces headers by name (``From="..."``)."""
    request = sip.parse(invite)
    headers = {
        "Via": request.get("via").replace(request.branch, sip.new_branch()),
        "From": request.get("from"),
        "To": ok.get("to"),
        "Call-ID": request.call_id,
        "CSeq": f"{request.cseq[0] if cseq is None else cseq} {method}",
        **change,
    }
    lines = [
        f"{method} {request.uri} SIP/2.0",
        *(f"{k}: {v}" for k, v in headers.items()),
        "Content-Length: 0",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Flow:
    """A call's audio both ways while a test runs: the caller's silence every 20 ms (its
    session stays up) and the arrival time of each of our packets."""

    def __init__(self, phone: RawPhone, ok: sip.SipMessage) -> None:
        self.phone = phone
        self.target = ("127.0.0.1", sip.parse_offer(ok.body).port)
        self.arrivals: list[float] = []
        self._tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._hear())]

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        silence = ulaw_encode(np.zeros(160, np.int16)).tobytes()
        for i in itertools.count():
            packet = RtpPacket(0, i % 65536, i * 160 % (1 << 32), 4321, silence)
            await loop.sock_sendto(self.phone.rtp, packet.build(), self.target)
            await asyncio.sleep(0.02)

    async def _hear(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await loop.sock_recv(self.phone.rtp, 2048)
            self.arrivals.append(time.monotonic())

    def heard_since(self, start: float) -> int:
        return sum(1 for t in self.arrivals if t >= start)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_hostile_sip_and_rtp_get_the_right_answer_and_disturb_no_call(served, tts_engine, monkeypatch):
    listener, sessions = served
    recorder = Recorder(monkeypatch)
    port = listener.port
    phone = RawPhone()
    try:
        assert await phone.silent(b"\x00\x01garbage", port)  # not SIP: dropped
        (bad,) = await phone.request(
            b"INVITE sip:x SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:9;branch=z9hG4bKx\r\n\r\n", port
        )
        assert bad.status == 400  # a request missing its dialog headers, answered where it came from
        (options,) = await phone.request(invite().replace(b"INVITE", b"OPTIONS"), port)
        assert options.status == 200 and "INVITE" in options.get("allow")
        (unknown,) = await phone.request(invite().replace(b"INVITE", b"SUBSCRIBE"), port)
        assert unknown.status == 501
        (bye,) = await phone.request(invite(call_id="nobody").replace(b"INVITE", b"BYE"), port)
        assert bye.status == 481
        no_codec = await phone.request(phone.invite("c-488", types="9 101"), port)
        assert [m.status for m in no_codec] == [100, 488]
        not_sdp = await phone.request(phone.invite("c-415").replace(b"application/sdp", b"text/plain"), port)
        assert not_sdp[-1].status == 415
        assert len(sessions) == 0
        # a real call: 30% of its RTP lost and the rest reordered; RTP from a stranger and
        # with a wrong payload type is dropped; the question is still heard
        answered = await phone.request(phone.invite("c-lossy"), port)
        assert [m.status for m in answered] == [100, 200]
        answer = sip.parse_offer(answered[-1].body)
        assert answer.codecs == (0,) and answer.telephone_event == 101
        ack = in_dialog(phone.invite("c-lossy"), answered[-1], "ACK")
        assert await phone.silent(ack, port, wait=0.1)
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        stranger.bind(("127.0.0.1", 0))
        before = (dropped("unknown_source"), dropped("payload_type"))
        voice = resample(speech(tts_engine, QUESTION), RUNTIME_RATE, 8000)
        codes = ulaw_encode(
            np.concatenate([np.zeros(800, np.int16), voice, np.zeros(16000, np.int16)])
        ).tobytes()
        packets = [
            RtpPacket(0, i, i * 160, 1234, codes[i * 160 : (i + 1) * 160]) for i in range(len(codes) // 160)
        ]
        rng = random.Random(7)
        kept = [p for p in packets if rng.random() >= 0.3]
        for i in range(0, len(kept) - 1, 4):  # swap neighbours: reordering within the buffer's depth
            kept[i], kept[i + 1] = kept[i + 1], kept[i]
        loop = asyncio.get_running_loop()
        target = ("127.0.0.1", answer.port)
        for k, p in enumerate(kept):
            await loop.sock_sendto(phone.rtp, p.build(), target)
            if k % 10 == 0:
                stranger.sendto(p.build(), target)
                await loop.sock_sendto(
                    phone.rtp, RtpPacket(18, p.sequence, p.timestamp, 1234, b"\0" * 20).build(), target
                )
            await asyncio.sleep(0.02 / 0.7)  # the survivors spread over the call's real time
        # a key pressed (RFC 4733: the same event three times, then its end three times)
        last = kept[-1]
        for k in range(6):
            event = bytes([7, 0x80 if k >= 3 else 0]) + (160 * (k + 1)).to_bytes(2, "big")
            dtmf = RtpPacket(101, (last.sequence + 1 + k) % 65536, last.timestamp + 160, 1234, event)
            await loop.sock_sendto(phone.rtp, dtmf.build(), target)
        await eventually(lambda: bool(recorder.of(ev.TRANSCRIPT_DONE) and recorder.of(ev.DTMF)), 20)
        await asyncio.sleep(0.1)
        assert [e.data["event"] for e in recorder.of(ev.DTMF)] == ["7"]  # once, not six times
        stranger.close()
        (final,) = recorder.of(ev.TRANSCRIPT_DONE)
        assert wer([(QUESTION, final.data["transcript"])]) <= 0.5, final.data["transcript"]
        assert dropped("unknown_source") > before[0] and dropped("payload_type") > before[1]
        (call,) = listener.calls.values()
        assert call.jitter.lost >= len(packets) * 0.2
        # the caller goes quiet without a BYE: the session times out and we send one
        async with asyncio.timeout(15):
            while True:
                message = sip.parse((await loop.sock_recvfrom(phone.sip, 65536))[0])
                if message.method == "BYE":
                    break
        assert message.call_id == "c-lossy" and "tag=abc" in message.get("to")
        await asyncio.sleep(0.2)
        assert not listener.calls and len(sessions) == 0
    finally:
        phone.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_media_never_goes_to_a_third_party_the_sdp_names(served):
    """An INVITE whose SDP names another host (127.0.0.2, a "victim") gets its call, but
    our RTP goes to the caller's own address, never to the victim; a host name in the SDP
    is refused (it would be looked up on the event loop for every packet)."""
    listener, sessions = served
    phone = RawPhone()
    victim = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    victim.bind(("127.0.0.2", phone.rtp_port))  # the same port, at another address
    victim.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        named = phone.invite("c-victim").replace(b"c=IN IP4 127.0.0.1", b"c=IN IP4 127.0.0.2")
        ok = await phone.call(named, listener.port)
        heard = 0
        async with asyncio.timeout(10):
            while heard < 25:  # half a second of our RTP reaches the caller
                await loop.sock_recv(phone.rtp, 2048)
                heard += 1
        with pytest.raises(BlockingIOError):
            victim.recv(2048)  # and not one packet the victim
        (done,) = await phone.request(in_dialog(named, ok, "BYE", 2), listener.port)
        assert done.status == 200
        by_name = phone.invite("c-name").replace(b"c=IN IP4 127.0.0.1", b"c=IN IP4 victim.ex")  # same length
        (refused,) = [m for m in await phone.request(by_name, listener.port) if m.status >= 200]
        assert refused.status == 400
        await eventually(lambda: len(sessions) == 0, 5)
    finally:
        phone.close()
        victim.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_the_allow_list_comes_before_any_parsing_or_reply(engines):
    """A source off the allow-list gets nothing back, not even a 403 or a 400: its
    datagrams are counted and dropped unread."""
    listener, sessions = await start_listener(engines, sip_allow="10.0.0.0/8, 192.168.1.7")
    phone = RawPhone()
    try:
        before = (refused("forbidden"), refused("malformed"))
        assert await phone.silent(phone.invite("c-403"), listener.port)
        assert await phone.silent(
            invite().replace(b"Content-Length: ", "Content-Length: \u00b2".encode()), listener.port
        )
        assert await phone.silent(b"\x00garbage", listener.port, wait=0.1)
        assert refused("forbidden") == before[0] + 3
        assert refused("malformed") == before[1]  # never parsed
        assert len(sessions) == 0 and not listener.calls
    finally:
        phone.close()
        await listener.stop()


@pytest.mark.asyncio(loop_scope="session")
async def test_in_dialog_requests_must_come_from_the_dialogs_source_with_its_tags(served):
    """A BYE (CANCEL, re-INVITE, ACK, INVITE again) that has the call's Call-ID but not
    its tags, or comes from another address or port than the INVITE, gets 481 (an ACK:
    nothing) and the call goes on, its audio flowing; the caller's own BYE ends it."""
    listener, sessions = served
    port = listener.port
    phone, other_port, other_host = RawPhone(), RawPhone(), RawPhone("127.0.0.2")
    first = phone.invite("c-dialog")
    ok = await phone.call(first, port)
    flow = Flow(phone, ok)
    try:
        start = time.monotonic()
        bye = in_dialog(first, ok, "BYE", 2)
        strangers = [
            (other_port, bye),  # the right BYE, from another port
            (other_host, bye),  # ... from another address
            (phone, in_dialog(first, ok, "BYE", 2, From="<sip:caller@127.0.0.1>;tag=abd")),
            (phone, in_dialog(first, ok, "BYE", 2, To="<sip:duplex@127.0.0.1>;tag=guess")),
            (phone, in_dialog(first, ok, "BYE", 2, To="<sip:duplex@127.0.0.1>")),  # the Call-ID alone
            (other_port, first.replace(b"INVITE sip", b"CANCEL sip").replace(b"1 INVITE", b"1 CANCEL")),
            (phone, in_dialog(first, ok, "INVITE", 3, To="<sip:duplex@127.0.0.1>;tag=guess")),
            (other_port, first),  # the INVITE again, from elsewhere: not our 200 and its SDP
        ]
        for sender, request in strangers:
            (answer,) = await sender.request(request, port)
            assert answer.status == 481, request
        assert await other_port.silent(in_dialog(first, ok, "ACK"), port, wait=0.1)
        (call,) = listener.calls.values()
        assert call.call_id == "c-dialog" and call.session is not None and not call.session.closed.is_set()
        await asyncio.sleep(0.2)
        assert flow.heard_since(start) >= 10  # our audio went on all along
        (again,) = await phone.request(in_dialog(first, ok, "INVITE", 3), port)  # a re-INVITE of its own
        assert again.status == 200 and sip.parse_offer(again.body).port == sip.parse_offer(ok.body).port
        (done,) = await phone.request(bye, port)
        assert done.status == 200
        await eventually(lambda: not listener.calls and len(sessions) == 0, 5)
    finally:
        await flow.stop()
        for p in (phone, other_port, other_host):
            p.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_an_invite_flood_that_never_acks_holds_bounded_state(engines):
    """Answered calls that have no ACK yet are capped (here 2 a source address, 3 in
    all); more INVITEs get 503 and open nothing. None of them is sent RTP; each gets its
    200 again (T1, 2*T1, ...) until the ACK timeout, then our BYE, and everything it
    held is freed. A neighbour call's audio flows throughout."""
    listener, sessions = await start_listener(
        engines, ack_timeout_s=2.0, max_unacked=3, max_unacked_per_source=2, max_sessions=8
    )
    port = listener.port
    neighbour, near, far = RawPhone(), RawPhone(), RawPhone("127.0.0.2")
    flow: Flow | None = None
    try:
        ok = await neighbour.call(neighbour.invite("c-neighbour"), port)
        flow = Flow(neighbour, ok)
        await asyncio.sleep(0.1)
        fds, start = open_fds(), time.monotonic()
        loop = asyncio.get_running_loop()

        async def flood(phone: RawPhone, name: str, count: int) -> dict[str, sip.SipMessage]:
            for i in range(count):
                await loop.sock_sendto(phone.sip, phone.invite(f"{name}-{i}"), ("127.0.0.1", port))
            finals: dict[str, sip.SipMessage] = {}
            async with asyncio.timeout(10):
                while len(finals) < count:
                    message = sip.parse((await loop.sock_recvfrom(phone.sip, 65536))[0])
                    if message.status >= 200:
                        finals.setdefault(message.call_id, message)
            return finals

        near_finals = await flood(near, "near", 10)
        assert sorted(m.status for m in near_finals.values()) == [200] * 2 + [503] * 8  # 2 a source
        far_finals = await flood(far, "far", 5)
        assert sorted(m.status for m in far_finals.values()) == [200] + [503] * 4  # 3 in all
        assert len(listener.calls) == 4 and len(sessions) == 4
        assert open_fds() - fds <= 3  # an RTP socket each, no more
        # an ACK from another source does not confirm a call: still capped, still no RTP
        answered = [cid for cid, m in near_finals.items() if m.status == 200]
        wrong_ack = in_dialog(near.invite(answered[0]), near_finals[answered[0]], "ACK")
        await loop.sock_sendto(far.sip, wrong_ack, ("127.0.0.1", port))
        (busy,) = [m for m in await near.request(near.invite("near-more"), port) if m.status >= 200]
        assert busy.status == 503 and busy.get("retry-after")
        await asyncio.sleep(0.5)
        assert near.rtp_received() == 0 and far.rtp_received() == 0  # no RTP before an ACK
        # the ACK timeout: every unconfirmed call gone, with all it held
        await eventually(lambda: len(listener.calls) == 1, 10)
        await eventually(lambda: len(sessions) == 1 and open_fds() <= fds, 5)
        assert not listener._pending and not listener._tasks
        assert near.rtp_received() == 0 and far.rtp_received() == 0
        messages = near.received()
        for call_id in answered:
            oks = [m for m in messages if m.call_id == call_id and m.status == 200]
            byes = [m for m in messages if m.call_id == call_id and m.method == "BYE"]
            assert len(oks) >= 2 and len(byes) == 1  # the 200 retransmitted, then our BYE
        # room again: a call that ACKs is heard
        new = near.invite("near-after")
        after = await near.call(new, port)
        await eventually(lambda: near.rtp_received() > 0, 5)
        (bye,) = await near.request(in_dialog(new, after, "BYE", 2), port)
        assert bye.status == 200
        assert flow.heard_since(start) >= 50  # the neighbour heard us all along
        (done,) = await neighbour.request(in_dialog(neighbour.invite("c-neighbour"), ok, "BYE", 2), port)
        assert done.status == 200
        await eventually(lambda: not listener.calls and len(sessions) == 0, 5)
    finally:
        if flow is not None:
            await flow.stop()
        for p in (neighbour, near, far):
            p.close()
        await listener.stop()
        await sessions.close_all()


URI = "sip:duplex@127.0.0.1:5080"  # the Request-URI of `invite()`


def digest(challenge: str, nc: int, password: str = "s3cret-pass") -> str:
    """The ``Authorization`` an honest client sends for ``challenge``, its ``nc``-th use."""
    found = re.search(r'nonce="([^"]+)"', challenge)
    assert found is not None, challenge

    def md5(s: str) -> str:
        return hashlib.md5(s.encode()).hexdigest()

    nonce, count = found.group(1), f"{nc:08x}"
    response = md5(f"{md5(f'alice:duplex:{password}')}:{nonce}:{count}:c0ffee:auth:{md5(f'INVITE:{URI}')}")
    return (
        f'Digest username="alice", realm="duplex", nonce="{nonce}", uri="{URI}", '
        f'response="{response}", qop=auth, nc={count}, cnonce="c0ffee", algorithm=MD5'
    )


async def challenged(phone: RawPhone, port: int) -> str:
    (challenge,) = await phone.request(phone.invite("c-challenge"), port)
    assert challenge.status == 401
    return challenge.get("www-authenticate")


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_hostile_sip_input_suite_leaves_a_neighbour_call_unharmed(engines, caplog):
    """Issue 20's hostile SIP cases against a listener with digest auth and an
    allow-list, while a neighbour call's audio flows. Each case gets the protocol's own
    answer (400, 401, 481, 503, or nothing), the neighbour hears our RTP during it, the
    event loop's lag p99 stays under 50 ms, nothing is logged with a traceback, and
    nothing is left behind."""
    caplog.set_level(logging.INFO)
    listener, sessions = await start_listener(
        engines, ack_timeout_s=2.0, max_unacked=3, max_unacked_per_source=2, max_sessions=8,
        sip_username="alice", sip_password="s3cret-pass", sip_allow="127.0.0.1, 127.0.0.2",
    )  # fmt: skip
    port = listener.port
    neighbour, hostile = RawPhone(), RawPhone()
    outsider, victim = RawPhone("127.0.0.5"), RawPhone("127.0.0.9")
    loop = asyncio.get_running_loop()
    lags: dict[str, float] = {}
    flow: Flow | None = None

    @contextlib.asynccontextmanager
    async def case(name: str) -> AsyncIterator[None]:
        lag, start = LoopLag(), time.monotonic()
        lag.start()
        yield
        await asyncio.sleep(max(0.0, start + 0.5 - time.monotonic()))  # long enough to hear the neighbour
        await lag.stop()
        assert flow is not None and flow.heard_since(start) > 0, f"{name}: the neighbour heard nothing"
        lags[name] = float(np.percentile(lag.samples_ms, 99))
        assert lags[name] < 50, (name, lags)

    try:
        header = digest(await challenged(neighbour, port), 1)
        first = neighbour.invite("c-neighbour", cseq=2, Authorization=header)
        ok = await neighbour.call(first, port)
        flow = Flow(neighbour, ok)
        await asyncio.sleep(0.2)

        async with case("malformed"):
            assert await hostile.silent(b"\x00\x01garbage", port)
            assert await hostile.silent(b"X" * 20000, port, wait=0.1)  # over the size limit
            malformed = [
                invite().replace(b"Content-Length: ", "Content-Length: \u00b2".encode()),
                invite().replace(b"CSeq: 1 INVITE", "CSeq: \u0663 INVITE".encode()),
                invite().replace(b"CSeq: 1 INVITE", b"Subject: caf\xe9\r\nCSeq: 1 INVITE"),  # not UTF-8
            ]
            for request in malformed:
                (bad,) = await hostile.request(request, port)
                assert bad.status == 400
            status = "SIP/2.0 \u00b200 OK\r\nVia: x\r\nFrom: a\r\nTo: b\r\nCall-ID: c\r\nCSeq: 1 BYE\r\n\r\n"
            assert await hostile.silent(status.encode(), port, wait=0.1)
            assert await outsider.silent(malformed[0], port, wait=0.1)  # off the allow-list: not read

        async with case("replayed authorization"):
            replay = hostile.invite("c-replay", cseq=2, Authorization=header)
            (refused_,) = await hostile.request(replay, port)
            assert refused_.status == 401 and "c-replay" not in listener.calls

        challenge = await challenged(hostile, port)
        async with case("sdp names a third party"):
            named = hostile.invite("c-third", cseq=2, Authorization=digest(challenge, 1)).replace(
                b"c=IN IP4 127.0.0.1", b"c=IN IP4 127.0.0.9"
            )
            third = await hostile.call(named, port)
            async with asyncio.timeout(5):
                for _ in range(10):  # our RTP reaches the caller ...
                    await loop.sock_recv(hostile.rtp, 2048)
            assert victim.rtp_received() == 0  # ... and not the address its SDP named
            (bye,) = await hostile.request(in_dialog(named, third, "BYE", 3), port)
            assert bye.status == 200

        async with case("hostname in c="):
            by_name = hostile.invite("c-name", cseq=2, Authorization=digest(challenge, 2)).replace(
                b"c=IN IP4 127.0.0.1", b"c=IN IP4 victim.ex"
            )
            (name_refused,) = [m for m in await hostile.request(by_name, port) if m.status >= 200]
            assert name_refused.status == 400

        async with case("wrong-tag and wrong-source BYE"):
            wrong_tag = in_dialog(first, ok, "BYE", 3, From="<sip:caller@127.0.0.1>;tag=evil")
            (answer,) = await neighbour.request(wrong_tag, port)
            assert answer.status == 481
            (answer,) = await hostile.request(in_dialog(first, ok, "BYE", 3), port)
            assert answer.status == 481
            assert "c-neighbour" in listener.calls

        hostile.rtp_received()  # what the third party's call sent it, read and forgotten
        async with case("invite flood"):
            for i in range(10):  # without credentials: 401 each, no state
                (no_auth,) = await hostile.request(hostile.invite(f"flood-x-{i}"), port)
                assert no_auth.status == 401
            for i in range(10):  # with them (one nonce, counting up), never an ACK
                await loop.sock_sendto(
                    hostile.sip,
                    hostile.invite(f"flood-{i}", cseq=2, Authorization=digest(challenge, 3 + i)),
                    ("127.0.0.1", port),
                )
            finals: dict[str, int] = {}
            async with asyncio.timeout(10):
                while len(finals) < 10:
                    message = sip.parse((await loop.sock_recvfrom(hostile.sip, 65536))[0])
                    if message.status >= 200 and message.call_id.startswith("flood-"):
                        finals.setdefault(message.call_id, message.status)
            assert sorted(finals.values()) == [200] * 2 + [503] * 8
            assert len(listener.calls) == 3 and len(sessions) == 3
        await eventually(lambda: len(listener.calls) == 1, 10)  # the ACK timeout frees them
        assert hostile.rtp_received() == 0  # none of the flood was sent RTP

        (done,) = await neighbour.request(in_dialog(first, ok, "BYE", 4), port)
        assert done.status == 200
        await eventually(lambda: not listener.calls and len(sessions) == 0, 5)
        assert not listener._pending and not listener._tasks
        assert not [t for t in asyncio.all_tasks() if "-sip-" in t.get_name()]
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        print("loop lag p99 (ms) per case:", {k: round(v, 1) for k, v in lags.items()})
    finally:
        if flow is not None:
            await flow.stop()
        for p in (neighbour, hostile, outsider, victim):
            p.close()
        await listener.stop()
        await sessions.close_all()
