"""The two narrow interfaces between a transport and a session.

    transport ── SessionPort ──► Session        (audio, text, acks, cancel, config)
    transport ◄─────── Sink ──── Session        (audio frames, events, flush, end of reply)
    other clients ◄── watch ──── Session        (its events: a Realtime client joined to a call)

A transport adapter holds only its wire protocol: it drives the session through
`SessionPort` and hands the session a `Sink` (in practice an `OutputStage` around its
wire encoder, duplex/transports/output.py). No transport imports the engines, the
conversation or the session's internals; everything a wire protocol needs from the
models (a manual commit's transcription, new instructions) is a call here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from audio_io.frame import AudioFrame, Int16Array
from duplex.events import Event, SessionError
from models.tools import Tool, ToolChoice


@dataclass(frozen=True)
class Voice:
    """The voice a session speaks with: its name and its sample rate."""

    name: str
    sample_rate: int


Watcher = Callable[[Event], None]  # told of a session's events besides its transport (`SessionPort.watch`)
Unwatch = Callable[[], None]  # ... no more (idempotent)


class Sink(Protocol):
    """What a transport gives the session for its output; no call may block.

    Per reply: `audio` frames (20 ms at the voice's rate) and events, then exactly one
    `end_reply` before its ``response.done`` event: ``completed`` if it played out (the
    transport sends its last partial frame, padded), False if it was cut (nothing more
    of it goes out). `flush` (barge-in) drops every frame still queued for the wire."""

    def audio(self, frame: AudioFrame, response_id: str) -> None: ...

    def event(self, event: Event) -> None: ...

    def flush(self) -> None: ...

    def end_reply(self, response_id: str, completed: bool) -> None: ...


class Tools(Protocol):
    """A session's tools, as its transport changes them (`duplex.tool_calls.ToolCalls`);
    a bad value is a `SessionError`, and nothing changes."""

    async def parse(self, raw_tools: Any, raw_choice: Any = None) -> tuple[tuple[Tool, ...], ToolChoice]: ...

    def declare(self, tools: tuple[Tool, ...], choice: ToolChoice) -> None: ...

    def choose(self, raw_choice: Any) -> None:
        """The next response's own ``tool_choice``."""

    def result(self, call_id: Any, output: Any) -> None:
        """A call's result: it opens the next turn."""

    @property
    def waiting(self) -> bool:
        """Results wait for a response."""

    @property
    def complete(self) -> bool:
        """Results wait, and every call of the last reply has its result."""


class SessionPort(Protocol):
    """What a transport may do with its session."""

    id: str
    closed: asyncio.Event  # set when the session has ended (idle timeout, shutdown)
    tools: Tools

    @property
    def voice(self) -> Voice: ...

    @property
    def busy(self) -> bool:
        """The caller is speaking or a reply is in progress."""
        ...

    def push_audio(self, frame: AudioFrame) -> None: ...

    async def push_text(self, text: str) -> None: ...

    def add_turn(self, text: str) -> None: ...

    async def respond(self) -> None: ...

    async def cancel(self) -> None: ...

    async def truncate(self, response_id: str, audio_end_ms: int) -> int: ...

    async def forget(
        self, response_id: str | None, user_text: str | None = None, reply: bool = False
    ) -> None:
        """A client deleted a user message or a reply: it leaves the history and the KV."""
        ...

    def configure(self, changes: dict[str, object]) -> None: ...

    def set_instructions(self, instructions: str | None) -> None: ...

    async def transcribe(self, samples: Int16Array) -> str:
        """A whole utterance at 16 kHz (a manual commit), through the ASR worker's queue."""
        ...

    def playback(self, stream_position: int) -> None: ...

    def dtmf(self, digit: str) -> None: ...

    def touch(self) -> None:
        """The client is alive (input the transport holds, e.g. a manual turn's audio)."""
        ...

    def send_error(self, error: SessionError) -> None: ...

    def watch(self, watcher: Watcher, limit: int) -> Unwatch | None:
        """Tell ``watcher`` of every event the session sends its transport from now on,
        until the call returned is made: another client following a session it did not
        open (a Realtime client joined to a phone call), while the session's own
        transport carries its audio. None, and not told, when ``limit`` watchers are told
        already. A watcher runs in the session's tasks: it may not block, nor raise."""
        ...
