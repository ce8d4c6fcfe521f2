"""`Duplex.Converse` (proto/duplex.proto): one gRPC stream, one session.

    ClientEvent stream ─► _read: config check, audio decode, acks, text, cancel ─► Session
    Session ─► GrpcSink ─► Outbox (bounded) ─► Converse yields ServerEvents

The first message must be a `SessionConfig`; problems with the stream itself end it
with a status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED),
problems with one message are `Error` events. A client that stops reading gets its
audio dropped (counted in ``duplex_grpc_audio_dropped_total``), never unbounded memory;
one that stops reading events altogether is ended. A client that half-closes gets the
rest of its turn (the reply plays out), then the stream ends with OK.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import Counter

from audio_io._proto import duplex_pb2 as pb
from audio_io._proto import duplex_pb2_grpc as pb_grpc
from audio_io.frame import AudioFrame, Int16Array
from audio_io.grpc_codec import FormatError, WireFormat
from audio_io.resample import FrameResampler
from duplex import events as ev
from duplex.events import Event, SessionError
from duplex.session import Session, SessionConfig
from duplex.sessions import Sessions
from duplex.state import State

log = logging.getLogger("duplex.grpc")

AUDIO_DROPPED = Counter("duplex_grpc_audio_dropped_total", "reply audio chunks dropped for slow gRPC readers")
MAX_QUEUED_AUDIO = 250  # 5 s of 20 ms chunks waiting for the client to read
MAX_QUEUED_EVENTS = 2000  # more unread events than this: the client is not reading at all
QUIET_AFTER_HALF_CLOSE_S = 1.5  # after the client half-closes, this long with nothing to say ends it
API_VERSION = 1

_TURN = {
    ev.SPEECH_STARTED: pb.TurnEvent.SPEECH_STARTED,
    ev.SPEECH_STOPPED: pb.TurnEvent.SPEECH_STOPPED,
    ev.RESPONSE_CREATED: pb.TurnEvent.RESPONSE_STARTED,
    ev.RESPONSE_DONE: pb.TurnEvent.RESPONSE_DONE,
    ev.TRUNCATED: pb.TurnEvent.INTERRUPTED,
    ev.RESUMED: pb.TurnEvent.RESUMED,
}


class StreamEnd(Exception):
    """The stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def server_event(event: Event) -> pb.ServerEvent | None:
    """A session event as the API's message (None: not part of the API)."""
    d: dict[str, Any] = event.data
    if event.type in (ev.TRANSCRIPT_DELTA, ev.TRANSCRIPT_DONE):
        final = event.type == ev.TRANSCRIPT_DONE
        text = d["transcript"] if final else d["delta"]
        words = [pb.Word(**w) for w in d.get("words", ())]
        transcript = pb.Transcript(item_id=d["item_id"], text=text, final=final, words=words)
        return pb.ServerEvent(transcript=transcript)
    if event.type == ev.TEXT_DELTA:
        text = pb.AssistantText(response_id=d["response_id"], item_id=d["item_id"], delta=d["delta"])
        return pb.ServerEvent(text=text)
    if event.type == ev.METRICS:
        steps = {k: float(v) for k, v in d.items() if k.endswith("_ms") and k != "voice_to_voice_ms"}
        voice = float(d.get("voice_to_voice_ms", 0.0))  # a reply to text input has none
        metrics = pb.Metrics(response_id=d["response_id"], voice_to_voice_ms=voice, steps_ms=steps)
        return pb.ServerEvent(metrics=metrics)
    if event.type == ev.ERROR:
        return pb.ServerEvent(error=pb.Error(code=d["error"]["code"], message=d["error"]["message"]))
    kind = _TURN.get(event.type)
    if kind is None:
        return None  # duplex.state: the turn events say it
    turn = pb.TurnEvent(
        kind=kind,
        item_id=d.get("item_id", ""),
        response_id=d.get("response_id", ""),
        audio_ms=int(d.get("audio_start_ms", d.get("audio_end_ms", 0))),
        heard_text=d.get("transcript", ""),
        status=d.get("status", ""),
    )
    return pb.ServerEvent(turn=turn)


class Outbox:
    """What waits for the client to read: bounded, audio dropped first."""

    def __init__(self) -> None:
        self._items: collections.deque[pb.ServerEvent] = collections.deque()
        self._audio = 0
        self.ready = asyncio.Event()
        self.overflowed = False

    def put(self, item: pb.ServerEvent) -> None:
        if item.HasField("audio"):
            if self._audio >= MAX_QUEUED_AUDIO:
                AUDIO_DROPPED.inc()
                return
            self._audio += 1
        elif len(self._items) - self._audio >= MAX_QUEUED_EVENTS:
            self.overflowed = True
        self._items.append(item)
        self.ready.set()

    def drop_audio(self) -> None:
        """Barge-in: the reply's audio not yet read goes."""
        self._items = collections.deque(i for i in self._items if not i.HasField("audio"))
        self._audio = 0

    def take(self) -> list[pb.ServerEvent]:
        items, self._items, self._audio = list(self._items), collections.deque(), 0
        self.ready.clear()
        return items


class GrpcSink:
    """The session's `Sink`: reply audio in the client's output format, events as messages."""

    def __init__(self, outbox: Outbox, output: WireFormat) -> None:
        self.outbox = outbox
        self.output = output
        self._frames = FrameResampler(output.sample_rate)
        self._sequence = 0

    def audio(self, frame: AudioFrame, response_id: str) -> None:
        for samples in self._frames.push(frame.samples, frame.sample_rate):
            self._chunk(samples, response_id)

    def _chunk(self, samples: Int16Array, response_id: str) -> None:
        chunk = pb.AudioChunk(
            data=self.output.encode(samples), sequence=self._sequence, response_id=response_id
        )
        self._sequence += 1
        self.outbox.put(pb.ServerEvent(audio=chunk))

    def event(self, event: Event) -> None:
        if event.type == ev.RESPONSE_DONE:  # its last partial chunk, padded; nothing if cut
            for samples in self._frames.end(event.data.get("status") == "completed"):
                self._chunk(samples, str(event.data["response_id"]))
        try:
            message = server_event(event)
        except (KeyError, TypeError, ValueError):  # a bug here must not break the session's tasks
            log.exception("gRPC: no message for event %s", event.type)
            return
        if message is not None:
            self.outbox.put(message)

    def flush(self) -> None:
        self.outbox.drop_audio()
        self._frames.reset()


class DuplexService(pb_grpc.DuplexServicer):
    def __init__(self, sessions: Sessions, first_message_timeout_s: float) -> None:
        self.sessions = sessions
        self.first_message_timeout_s = first_message_timeout_s

    async def Converse(
        self, request_iterator: AsyncIterator[pb.ClientEvent], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ServerEvent]:
        requests = aiter(request_iterator)
        outbox = Outbox()
        try:
            config, wire_in, output, voice = await self._configure(requests)
            sink, session = await self._open(outbox, config, output, voice)
        except StreamEnd as e:
            await context.abort(e.code, str(e))
            return
        stream = _Stream(session, wire_in, sink.output, outbox)
        reader = asyncio.create_task(stream.read(requests), name=f"{session.id}-grpc-read")
        try:
            started = pb.SessionStarted(
                session_id=session.id,
                input_format=wire_in.message(),
                output_format=sink.output.message(),
                voice=session.engines.tts.name,
                api_version=API_VERSION,
            )
            yield pb.ServerEvent(started=started)
            async for message in stream.messages(reader):
                yield message
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await self.sessions.close(session)
        if stream.end is not None:
            await context.abort(stream.end.code, str(stream.end))

    async def _configure(
        self, requests: AsyncIterator[pb.ClientEvent]
    ) -> tuple[SessionConfig, WireFormat, WireFormat | None, str]:
        try:
            first = await asyncio.wait_for(anext(requests), self.first_message_timeout_s)
        except StopAsyncIteration:
            raise StreamEnd(
                grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before a SessionConfig"
            ) from None
        except TimeoutError:
            raise StreamEnd(grpc.StatusCode.DEADLINE_EXCEEDED, "no SessionConfig in time") from None
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
        except SessionError as e:
            raise StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return config, wire_in, output, message.voice

    async def _open(
        self, outbox: Outbox, config: SessionConfig, output: WireFormat | None, voice: str
    ) -> tuple[GrpcSink, Session]:
        try:
            engines = self.sessions.check_room()
            if voice and voice != engines.tts.name:
                raise StreamEnd(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"unknown voice {voice!r} (this server has {engines.tts.name!r})",
                )
            sink = GrpcSink(outbox, output or WireFormat(pb.PCM16, engines.tts.sample_rate))
            return sink, await self.sessions.open(sink, config)
        except SessionError as e:
            code = (
                grpc.StatusCode.UNAVAILABLE if e.code == "not_ready" else grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            raise StreamEnd(code, str(e)) from None


class _Stream:
    """One Converse call: reads the client's messages into the session, and hands the
    outbox's messages to the caller until the stream is over."""

    def __init__(self, session: Session, wire_in: WireFormat, output: WireFormat, outbox: Outbox) -> None:
        self.session = session
        self.input = wire_in
        self.output = output
        self.outbox = outbox
        self.end: StreamEnd | None = None  # how the stream ends, if not with OK
        self._voice_rate = session.engines.tts.sample_rate

    async def read(self, requests: AsyncIterator[pb.ClientEvent]) -> None:
        """Until the client half-closes (returns) or sends what ends the stream."""
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
            elif kind == "config":
                self._fail(grpc.StatusCode.INVALID_ARGUMENT, "SessionConfig may come only first")
                return
            else:
                self._fail(grpc.StatusCode.INVALID_ARGUMENT, "an empty ClientEvent")
                return

    def _fail(self, code: grpc.StatusCode, message: str) -> None:
        self.end = StreamEnd(code, message)
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
                if session.closed.is_set() and self.end is None and not reader.done():
                    self.end = StreamEnd(grpc.StatusCode.DEADLINE_EXCEEDED, "the session was closed (idle)")
                return
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                log.error("session %s: reading the stream failed", session.id, exc_info=reader.exception())
                self.end = StreamEnd(grpc.StatusCode.INTERNAL, "the server failed to read the stream")
                return
            if reader.done():  # half-closed: the reply in progress plays out
                busy = session.state not in (State.LISTENING, State.IDLE)
                now = time.monotonic()
                quiet_since = None if busy else quiet_since or now
                if quiet_since is not None and now - quiet_since >= QUIET_AFTER_HALF_CLOSE_S:
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(outbox.ready.wait(), 0.1)
