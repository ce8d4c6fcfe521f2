"""`OutputStage`: the one output path of every transport (pipecat's BaseOutputTransport).

    Session ─ audio(frame) ──► FrameResampler (wire rate, 20 ms) ─► wire.frame() ─► Outbox.put_frame
            ─ event ─────────────────────────────────────────────► wire.event() ─► Outbox.put
            ─ end_reply ─► the last partial frame, padded (played out) or dropped (cut)
                           ─► wire.frame() ... wire.end_reply() ─► Outbox
            ─ flush ─────► Outbox.drop_audio, FrameResampler.reset ─► wire.flushed() ─► Outbox

A transport writes a `Wire`: how one 20 ms frame and one event look on its wire, and
what (if anything) it adds at a reply's end or a flush. It then reads its `Outbox`:
a writer task awaits `Outbox.get` (WebSocket, gRPC), a clock pulls `Outbox.next_audio`
every 20 ms (RTP, a WebRTC track). Resampling, framing, padding, the bound on what is
queued and what a barge-in drops are the same for all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from audio_io.frame import AudioFrame, Int16Array
from audio_io.outbox import Outbox
from audio_io.resample import FrameResampler, downmix
from duplex.events import Event

log = logging.getLogger("duplex.transports")

T = TypeVar("T")


@dataclass
class Cursor:
    """Where the session's output stands, in the playout ledger's stream (samples at the
    voice's rate): the reply being sent, where its audio began, and how far the session
    has handed it over. What a transport needs to name played positions (Twilio marks)."""

    response_id: str = ""
    start: int = 0
    end: int = 0


class Wire(Protocol[T]):
    """A transport's wire format for output (``T``: what its writer sends)."""

    transport: str  # its name in /metrics (``duplex_sessions_open{transport}``)

    @property
    def rate(self) -> int:
        """The wire's audio sample rate (it may change between replies: Realtime)."""
        ...

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[T]:
        """One 20 ms frame at `rate` of ``cursor.response_id``: its message first, then
        any that belong to it."""
        ...

    def event(self, event: Event) -> list[T]:
        """A session event's messages (none if the wire does not carry it)."""
        ...

    def end_reply(self, cursor: Cursor, completed: bool) -> list[T]:
        """After a reply's last frame (Twilio: its last mark)."""
        ...

    def flushed(self) -> list[T]:
        """After a barge-in dropped the queued audio (Twilio: ``clear``)."""
        ...


class OutputStage(Generic[T]):
    """The session's `Sink` for one connection (duplex/port.py)."""

    def __init__(self, wire: Wire[T], outbox: Outbox[T] | None = None) -> None:
        self.wire = wire
        self.outbox: Outbox[T] = outbox if outbox is not None else Outbox()
        self._frames = FrameResampler(wire.rate)
        self.cursor = Cursor()
        self.closed = False  # the connection is gone: nothing more is queued

    def audio(self, frame: AudioFrame, response_id: str) -> None:
        if self.closed:
            return
        if self._frames.out_rate != self.wire.rate:
            self._frames = FrameResampler(self.wire.rate)
        self._reply(response_id).end += frame.num_samples
        for samples in self._frames.push(downmix(frame.samples, frame.channels), frame.sample_rate):
            self.outbox.put_frame(self.wire.frame(samples, self.cursor))

    def event(self, event: Event) -> None:
        if self.closed:
            return
        try:
            messages = self.wire.event(event)
        except (KeyError, TypeError, ValueError):  # a bug here must not break the session's tasks
            log.exception("no wire message for event %s", event.type)
            return
        self.outbox.put(messages)

    def end_reply(self, response_id: str, completed: bool) -> None:
        if self.closed:
            return
        self._reply(response_id)  # a reply that sent no audio has its cursor too
        for samples in self._frames.end(completed):
            self.outbox.put_frame(self.wire.frame(samples, self.cursor))
        self.outbox.put_tail(self.wire.end_reply(self.cursor, completed))

    def _reply(self, response_id: str) -> Cursor:
        """The cursor of this reply: a new one begins where the last one ended."""
        if response_id != self.cursor.response_id:
            self.cursor = Cursor(response_id, self.cursor.end, self.cursor.end)
        return self.cursor

    def flush(self) -> None:
        self.outbox.drop_audio()
        self._frames.reset()
        if not self.closed:
            self.outbox.put(self.wire.flushed())

    def close(self) -> None:
        self.closed = True
        self.outbox.drop_audio()
