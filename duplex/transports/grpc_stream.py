"""`Duplex.Converse` (proto/duplex.proto): one gRPC stream, one session.

    ClientEvent stream ─► _read: config check, audio decode, acks, text, cancel,
                              tool results (the reply after them begins by itself) ─► Session
    Session ─► OutputStage(GrpcWire) ─► Outbox (bounded) ─► writer task ─► context.write

The first message must be a `SessionConfig`; problems with the stream itself end it
with a status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED),
problems with one message are `Error` events. Bytes that are not a `ClientEvent` (not
protobuf, or a string field that is not UTF-8: protobuf refuses to parse both) end the
stream with INVALID_ARGUMENT; a message over ``max_message_bytes`` is refused by grpc
itself with RESOURCE_EXHAUSTED.

A stream holds one of ``max_sessions`` from its start (`Sessions.hold`), and one that
has sent no `SessionConfig` within ``handshake_timeout_s`` ends with DEADLINE_EXCEEDED.
A client that reads slowly gets its audio dropped (counted in
``duplex_grpc_audio_dropped_total``), never unbounded memory. One that stops reading
fills its HTTP/2 flow-control window (64 KiB, or up to megabytes where the client's
BDP probing has grown it), then the writer blocks; once nothing has been taken for
``slow_reader_timeout_s`` the session is closed and the call ends with
RESOURCE_EXHAUSTED ``slow_reader``. HTTP/2 sends that status after the messages the
client has not read, so it gets it if it reads again; the handler waits at most
``slow_reader_timeout_s`` more for it to go, then returns (grpc keeps only the call
until the client cancels or disconnects). A client that half-closes gets the rest of
its turn (the reply plays out), then the stream ends with OK.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc._cython.cygrpc import ExecuteBatchError  # grpc's "a send to this call failed"
from prometheus_client import Counter

from audio_io._proto import duplex_pb2 as pb
from audio_io._proto import duplex_pb2_grpc as pb_grpc
from audio_io.frame import AudioFrame
from audio_io.grpc_codec import FormatError, WireFormat
from audio_io.outbox import Outbox
from duplex.events import SessionError
from duplex.port import SessionPort
from duplex.session_config import SessionConfig
from duplex.sessions import Sessions
from duplex.transports.grpc_messages import GrpcWire, Tooling
from duplex.transports.link import Link
from duplex.transports.output import OutputStage
from models.tools import ToolError

log = logging.getLogger("duplex.grpc")

AUDIO_DROPPED = Counter("duplex_grpc_audio_dropped_total", "reply audio chunks dropped for slow gRPC readers")
MAX_QUEUED_AUDIO = 250  # 5 s of 20 ms chunks waiting for the client to read
MAX_QUEUED_EVENTS = 2000  # more unread events than this: the client is not reading at all
QUIET_AFTER_HALF_CLOSE_S = 1.5  # after the client half-closes, this long with nothing to say ends it
API_VERSION = 1
MALFORMED = "a malformed ClientEvent (not protobuf, or a string that is not UTF-8)"


class StreamEnd(Exception):
    """The stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def half_closed(reader: asyncio.Task[None]) -> bool:
    """The client half-closed its side: the reader ran to its end (not cancelled)."""
    return reader.done() and not reader.cancelled() and reader.exception() is None


async def send_status(context: grpc.aio.ServicerContext, end: StreamEnd, wait_s: float) -> None:
    """End the call with ``end``'s status (grpc's abort, which raises for grpc). The
    status goes out after all the client has not read: it is sent, but a client that
    reads nothing is not waited for more than ``wait_s`` (it gets it if it reads
    again); then, as when the send fails, the call is over with nobody left to tell."""
    try:
        await asyncio.wait_for(context.abort(end.code, str(end)), wait_s)
    except TimeoutError:
        raise asyncio.CancelledError(f"the status was not taken within {wait_s:g} s") from None
    except ExecuteBatchError as e:
        _raise_as_grpc_would(e)


def _raise_as_grpc_would(error: BaseException) -> NoReturn:
    """Raise a writer's or a status's failure for grpc to handle. A send that failed
    because the client is gone, before grpc has marked the call closed (the client's
    RST_STREAM and the failed send race), is the cancellation grpc raises once it has:
    the call is over and nobody is left to tell. Left as it is, grpc logs it as an
    ERROR with a traceback."""
    if isinstance(error, ExecuteBatchError):
        raise asyncio.CancelledError(f"the client is gone: {error}") from None
    raise error  # grpc's own (the server stopping, ...), for grpc to handle


class DuplexService(pb_grpc.DuplexServicer):
    def __init__(self, sessions: Sessions, handshake_timeout_s: float, slow_reader_timeout_s: float) -> None:
        self.sessions = sessions
        self.handshake_timeout_s = handshake_timeout_s
        self.slow_reader_timeout_s = slow_reader_timeout_s

    async def Converse(
        self, request_iterator: AsyncIterator[pb.ClientEvent], context: grpc.aio.ServicerContext
    ) -> None:
        """Written with ``context.write`` from a task of its own (not by yielding), so that
        a write blocked on a client that reads nothing can be given up, and the call
        still ended with a status."""
        requests = aiter(request_iterator)
        try:
            with self.sessions.hold():  # from the first byte on: streams that never configure count
                config, wire_in, output, voice, tooling = await self._configure(requests)
                wire, stage, session = await self._open(config, output, voice)
                session.tools.declare(tooling.tools, tooling.choice)
        except SessionError as e:
            await send_status(context, StreamEnd(*_refused(e)), self.slow_reader_timeout_s)
        except StreamEnd as e:
            await send_status(context, e, self.slow_reader_timeout_s)
        stream = _Stream(session, wire_in, wire, stage.outbox, tooling.manual_replies)
        wait_s = self.slow_reader_timeout_s

        async def close_connection() -> None:
            # the session is over: the writer sends what is left and ends; one blocked
            # on a client that reads nothing is given up (at once if that is why)
            await stream.wake()
            asyncio.get_running_loop().call_later(0.0 if link.stalled else wait_s, writer.cancel)

        link = Link(session, lambda: self.sessions.close(session), close_connection, stage.close)
        link.watch_reader(stage.outbox, wait_s)
        reader = link.own(stream.read(requests), "grpc-read")
        started = pb.SessionStarted(
            session_id=session.id,
            input_format=wire_in.message(),
            output_format=wire.output.message(),
            voice=session.voice.name,
            api_version=API_VERSION,
        )
        writer = asyncio.create_task(stream.write(context, started, reader), name=f"{session.id}-grpc-write")
        try:
            await asyncio.wait([writer])
        finally:
            writer.cancel()  # if this call itself was cancelled (the client went away)
            await link.close()
        if writer.cancelled():
            end: StreamEnd | None = StreamEnd(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"slow_reader: the client read nothing for {wait_s:g} s"
            )
        elif (error := writer.exception()) is not None:
            _raise_as_grpc_would(error)
        else:
            end = stream.end
        if end is not None:
            await send_status(context, end, wait_s)

    async def _configure(
        self, requests: AsyncIterator[pb.ClientEvent]
    ) -> tuple[SessionConfig, WireFormat, WireFormat | None, str, Tooling]:
        timeout = self.handshake_timeout_s
        try:
            first = await asyncio.wait_for(anext(requests), timeout)
        except StopAsyncIteration:
            raise StreamEnd(
                grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before a SessionConfig"
            ) from None
        except TimeoutError:
            raise StreamEnd(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no SessionConfig within {timeout:g} s"
            ) from None
        except DecodeError:
            raise StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED) from None
        if first.WhichOneof("event") != "config":
            raise StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a SessionConfig")
        message = first.config
        try:
            wire_in = WireFormat.parse(message.input_format, "input_format")
            output = (
                WireFormat.parse(message.output_format, "output_format")
                if message.HasField("output_format")
                else None  # the voice's own rate, known once the models are loaded
            )
        except FormatError as e:
            raise StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        turn = message.turn_taking
        options: dict[str, Any] = {
            f.name: getattr(turn, f.name) for f in turn.DESCRIPTOR.fields if turn.HasField(f.name)
        }
        try:
            config = SessionConfig(
                input_rate=wire_in.sample_rate,
                system_prompt=message.system_prompt or None,
                playback_acks=message.playback_acks,
                word_times=message.word_times,
                **options,
            )
            tooling = await asyncio.to_thread(Tooling.parse, message)  # (jsonschema: off the loop)
        except (SessionError, ToolError) as e:
            raise StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return config, wire_in, output, message.voice, tooling

    async def _open(
        self, config: SessionConfig, output: WireFormat | None, voice: str
    ) -> tuple[GrpcWire, OutputStage[pb.ServerEvent], SessionPort]:
        ours = self.sessions.check_room(holding=True)
        if voice and voice != ours.name:
            message = f"unknown voice {voice!r} (this server has {ours.name!r})"
            raise StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, message)
        wire = GrpcWire(output or WireFormat(pb.PCM16, ours.sample_rate))
        outbox = Outbox[pb.ServerEvent](MAX_QUEUED_AUDIO, MAX_QUEUED_EVENTS, AUDIO_DROPPED.inc)
        stage = OutputStage(wire, outbox)
        return wire, stage, await self.sessions.open(stage, config, holding=True)


def _refused(error: SessionError) -> tuple[grpc.StatusCode, str]:
    """The status of a stream refused a session: no room, or no models (yet)."""
    code = (
        grpc.StatusCode.RESOURCE_EXHAUSTED
        if error.code == "too_many_sessions"
        else grpc.StatusCode.UNAVAILABLE
    )
    return code, f"{error.code}: {error}"


class _Stream:
    """One Converse call: reads the client's messages into the session, and hands the
    outbox's messages to the caller until the stream is over."""

    def __init__(
        self,
        session: SessionPort,
        wire_in: WireFormat,
        wire: GrpcWire,
        outbox: Outbox[pb.ServerEvent],
        manual_tool_replies: bool = False,
    ) -> None:
        self.session = session
        self.input = wire_in
        self.wire = wire
        self.output = wire.output
        self.outbox = outbox
        self.manual_tool_replies = manual_tool_replies
        self.end: StreamEnd | None = None  # how the stream ends, if not with OK
        self._voice_rate = session.voice.sample_rate

    async def read(self, requests: AsyncIterator[pb.ClientEvent]) -> None:
        """Until the client half-closes (returns) or sends what ends the stream."""
        try:
            await self._read(requests)
        except DecodeError:  # grpc hands on the deserializer's error
            self._fail(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED)

    async def _read(self, requests: AsyncIterator[pb.ClientEvent]) -> None:
        session = self.session
        async for request in requests:
            kind = request.WhichOneof("event")
            if kind == "audio":
                try:
                    samples = self.input.decode(request.audio.data)
                except FormatError as e:
                    self._fail(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    return
                session.push_audio(AudioFrame(samples, self.input.sample_rate))
            elif kind == "playback":
                played = request.playback.played_samples * self._voice_rate // self.output.sample_rate
                session.playback(played)
            elif kind == "text":
                await session.push_text(request.text.text)
            elif kind == "cancel":
                await session.cancel()
            elif kind == "tool_result":
                await self._tool_result(request.tool_result)
            elif kind == "respond":
                await self._respond(quiet=False)
            elif kind == "config":
                self._fail(grpc.StatusCode.INVALID_ARGUMENT, "SessionConfig may come only first")
                return
            else:
                self._fail(grpc.StatusCode.INVALID_ARGUMENT, "an empty ClientEvent")
                return

    async def _tool_result(self, result: pb.ToolResult) -> None:
        """A call's result; once every call of the reply has its result, the reply that
        uses them begins: now, or when the reply in progress (its words before the
        calls) has played out, never cutting it (unless ``manual_tool_replies``)."""
        try:
            self.session.tools.result(result.call_id, result.output)
        except SessionError as e:
            self.session.send_error(e)
            return
        if self.manual_tool_replies or not self.session.tools.complete:
            return
        # a reply playing: the session answers once it has played (`Session.respond`); the
        # caller speaking: the results go with their turn
        if self.wire.replying or not self.session.busy:
            await self._respond()

    async def _respond(self, quiet: bool = True) -> None:
        """A reply to what waits (``quiet``: if nothing does any more, a turn of the
        caller's took the results meanwhile, and that is no error)."""
        try:
            await self.session.respond()
        except SessionError as e:
            if not (quiet and e.code == "no_input"):
                self.session.send_error(e)

    def _fail(self, code: grpc.StatusCode, message: str) -> None:
        self.end = StreamEnd(code, message)
        self.outbox.ready.set()

    async def write(
        self, context: grpc.aio.ServicerContext, started: pb.SessionStarted, reader: asyncio.Task[None]
    ) -> None:
        """The writer: ``started``, then the outbox's messages while the stream lasts."""
        await context.write(pb.ServerEvent(started=started))
        async for message in self.messages(reader):
            await context.write(message)

    async def wake(self) -> None:
        """The session ended: `messages` sees it now, not at its next poll."""
        self.outbox.ready.set()

    async def messages(self, reader: asyncio.Task[None]) -> AsyncIterator[pb.ServerEvent]:
        """The outbox's messages, until the session closes, the stream fails, or the
        client has half-closed and the conversation has gone quiet."""
        session, outbox = self.session, self.outbox
        quiet_since: float | None = None
        while True:
            for message in outbox.take():
                quiet_since = None
                yield message
            if outbox.overflowed:
                self.end = StreamEnd(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "the client does not read its events"
                )
            if self.end is not None or session.closed.is_set():
                if session.closed.is_set() and self.end is None and not half_closed(reader):
                    self.end = StreamEnd(grpc.StatusCode.DEADLINE_EXCEEDED, "the session was closed (idle)")
                return
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                self.end = StreamEnd(grpc.StatusCode.INTERNAL, "the server failed to read the stream")
                return
            if half_closed(reader):  # the reply in progress plays out
                busy = session.busy
                now = time.monotonic()
                quiet_since = None if busy else quiet_since or now
                if quiet_since is not None and now - quiet_since >= QUIET_AFTER_HALF_CLOSE_S:
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(outbox.ready.wait(), 0.1)
