"""`RealtimeConnection`: one Realtime client's events, read (`read`, paced by `Pace`),
checked, and handed to its session through `SessionPort`. What the session says back
goes out through `RealtimeWire` (realtime_events.py); both directions share the
connection's item store (`RealtimeItems`, realtime_items.py). A client with a session of
its own (realtime.py) and one joined to a call (realtime_join.py) are served alike.

    client events ─► paced (`Pace`) ─► checked (`RealtimeError` ─► ``error``, the socket stays open)
        input_audio_buffer.append ─► decode (pcm 24 kHz / pcmu / pcma) ─► Session
        conversation.item.create (text), commit ─► Session.add_turn; response.create ─► Session.respond
        conversation.item.truncate ─► Session.truncate (clamped to what was sent)
        conversation.item.retrieve ─► the item, as this connection has told it
        conversation.item.delete ─► Session.forget (its words leave the history and the KV)
        response.cancel ─► Session.cancel

Items this connection does not know (never seen, or older than the `MAX_ITEMS` it
remembers) are an ``invalid_request_error``, ``item_retrieve_invalid_item_id`` /
``item_delete_invalid_item_id``, param ``item_id``.

What one client may cost, and what it is told past that (every other session goes on;
the frame size and a client that stops reading are bounded by the socket and its link,
realtime_route.py and realtime.py):

- An event longer than the protocol's 15 MB append needs is refused from its length
  alone, before JSON decoding (``audio_too_large`` for an append, else
  ``event_too_large``). A long append is decoded and resampled off the event loop
  (realtime_audio.py).
- Events are read at most `EVENT_RATE` a second (each `EVENT_BYTES` of an event counts
  as one more), `EVENT_BURST` at once: a client streaming 20 ms appends sends 50.
  Faster, the reader waits (`Pace`; TCP holds the rest: nothing is lost, nothing piles
  up here); a client still over the rate after `PATIENCE_S` of waiting is closed with
  1008 ``rate_limited``. The reader yields to the loop every `SLICE_S` even when its
  messages are already buffered.
- Bounded state: `MAX_ITEMS` conversation items and responses are remembered (older
  ones can no longer be truncated); user input waiting for ``response.create`` is at
  most `MAX_UNANSWERED` messages (``unanswered_input_limit``), and their text at most
  what one reply takes (the session's own bound, ``too_much_input``); one reply at a
  time (``response.create`` during a reply cuts it as heard); manual-turn audio until
  commit, `MAX_BUFFER_S` (``input_audio_buffer_full``); events queued for the client,
  `MAX_QUEUED`.
- Bad JSON (truncated, not an object, nested past Python's recursion limit):
  ``invalid_json`` / ``invalid_event``; a binary frame: ``invalid_event``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web
from prometheus_client import Counter

from audio_io.frame import AudioFrame
from duplex.events import SessionError
from duplex.port import SessionPort
from duplex.transports.link import SLICE_S, Link
from duplex.transports.realtime_audio import MAX_BUFFER_S, RUNTIME_INPUT_RATE, InputAudio  # noqa: F401 (MAX_BUFFER_S: named here)
from duplex.transports.realtime_config import RealtimeError, RealtimeSessionConfig, shown
from duplex.transports.realtime_items import (  # noqa: F401 (MAX_ITEMS, MAX_QUEUED: the bounds named here)
    MAX_ITEMS,
    MAX_QUEUED,
    RealtimeItems,
    user_text,
)
from duplex.transports.realtime_pace import Pace

log = logging.getLogger("duplex.realtime")

MAX_APPEND_BYTES = 15 * 1024 * 1024  # the protocol's bound on one append's audio
MAX_APPEND_CHARS = 4 * -(-MAX_APPEND_BYTES // 3)  # ... as base64
MAX_EVENT_CHARS = MAX_APPEND_CHARS + 1024  # ... in its event (type, event_id): no valid event is longer
MAX_UNANSWERED = 16  # user messages waiting for response.create (their text: `Session.add_turn`)
MAX_ITEM_ID = 64  # characters of a client's item id
EVENT_RATE = 2000.0  # client events a second, sustained: 40x a client streaming 20 ms appends
EVENT_BURST = 2000.0  # ... at once (40 s of 20 ms appends, sent after a network stall)
EVENT_BYTES = 16 * 1024  # each 16 KiB of an event counts as one more event
# a client over the rate this long is closed (7 min of audio uploaded in 20 ms appends is not)
PATIENCE_S = 10.0

EVENTS = Counter("duplex_realtime_events_total", "client events read on /v1/realtime")
RATE_LIMITED = Counter("duplex_realtime_rate_limited_total", "Realtime clients closed for sending too fast")
# an oversized event's type, read without decoding it: clients (the openai SDK) write it first
_TYPE_AT_START = re.compile(r'\s*\{\s*"type"\s*:\s*"([\w.]{1,64})"')


def _parse(raw: str) -> dict[str, Any]:
    """A client event, refused before decoding when no valid event is that long."""
    if len(raw) > MAX_EVENT_CHARS:
        head = _TYPE_AT_START.match(raw[:200])
        if head is not None and head.group(1) == "input_audio_buffer.append":
            raise RealtimeError(f"'audio' is over {MAX_APPEND_BYTES} bytes.", "audio_too_large", "audio")
        raise RealtimeError(f"The event is over {MAX_EVENT_CHARS} characters.", "event_too_large")
    try:
        message = json.loads(raw)
    except ValueError:
        raise RealtimeError("The event is not valid JSON.", "invalid_json") from None
    except RecursionError:  # arrays or objects nested about 1000 deep
        raise RealtimeError("The event's JSON is nested too deeply.", "invalid_json") from None
    if not isinstance(message, dict):
        raise RealtimeError("An event is a JSON object.", "invalid_event")
    return message


class RealtimeConnection(RealtimeItems):
    """One WebSocket: its session settings, its items, and the client's events."""

    def __init__(self, ws: web.WebSocketResponse, config: RealtimeSessionConfig) -> None:
        super().__init__(config)
        self.ws = ws
        self.session: SessionPort | None = None
        self.joined = False  # a client joined to a call (`realtime_join`): its audio is the call's
        self._audio = InputAudio()
        # user input given to the session since the last response.create (an upper bound:
        # a turn the session answered by itself is still counted until then)
        self._unanswered = 0
        self._text_items = itertools.count()

    # -- client events --

    async def handle(self, raw: str) -> None:
        event_id: str | None = None
        try:
            message = _parse(raw)
            event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
            kind = message.get("type")
            handler = HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise RealtimeError(
                    f"Invalid value: {shown(kind)}. Unknown event type.", "invalid_value", "type"
                )
            if self.joined and str(kind).startswith("input_audio_buffer."):
                raise RealtimeError("The call's audio comes from its phone line.", "not_supported", "type")
            await handler(self, message)
        except RealtimeError as e:
            self.error(e, event_id)
        except SessionError as e:
            self.error(RealtimeError(str(e), e.code), event_id)
        except Exception:  # a bug: this client is told, its connection and every other go on
            log.exception("realtime %s: an event failed", self.config.id)
            failed = RealtimeError(
                "The server failed to handle this event.", "server_error", kind="server_error"
            )
            self.error(failed, event_id)

    async def _session_update(self, message: dict[str, Any]) -> None:
        before = (self.config.turn_detection, self.config.instructions)
        assert self.session is not None
        raw = message.get("session")
        tools = None
        if isinstance(raw, dict) and ("tools" in raw or "tool_choice" in raw):
            given = raw.get("tools", [t.declaration() for t in self.config.tools])
            try:  # checked before anything changes: all or nothing
                tools = await self.session.tools.parse([] if given is None else given, raw.get("tool_choice"))
            except SessionError as e:
                param = "session.tool_choice" if e.code == "invalid_tool_choice" else "session.tools"
                raise RealtimeError(str(e), e.code, param) from None
        self.config.update(raw)
        if tools is not None:
            self.session.tools.declare(*tools)
            self.config.tools, self.config.tool_choice = tools
        if self.config.turn_detection != before[0]:
            self.apply_turn_detection()
        if self.config.instructions != before[1]:
            self.session.set_instructions(self.config.instructions or None)
        self.send("session.updated", session=self.config.as_dict())

    def apply_turn_detection(self) -> None:
        """The session's turn-taking as ``turn_detection`` says (server VAD); with none,
        the session hears nothing: audio waits in the buffer for a commit."""
        td = self.config.turn_detection
        if td is None:
            return
        assert self.session is not None
        self.session.configure(
            {
                "end_of_turn_ms": td.silence_duration_ms,
                "vad_threshold": min(0.95, max(0.2, td.threshold)),
                "speech_prefix_ms": td.prefix_padding_ms,
                "answer_turns": td.create_response,
                "barge_in": td.interrupt_response,
            }
        )

    async def _append(self, message: dict[str, Any]) -> None:
        audio = message.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError("Missing required parameter: 'audio'.", "missing_required_parameter", "audio")
        if len(audio) > MAX_APPEND_CHARS:
            raise RealtimeError(f"'audio' is over {MAX_APPEND_BYTES} bytes.", "audio_too_large", "audio")
        assert self.session is not None
        if not audio:  # nothing to decode or to hear: a flood of these costs little
            self.session.touch()
            return
        pcm = await self._audio.decode(audio, self.config.input_format["type"])
        if self.config.turn_detection is not None:
            self.session.push_audio(AudioFrame(pcm, RUNTIME_INPUT_RATE))
            return
        self.session.touch()  # manual turns: held until commit
        self._audio.hold(pcm)

    def _check_unanswered(self, param: str | None) -> None:
        if self._unanswered >= MAX_UNANSWERED:
            raise RealtimeError(
                f"At most {MAX_UNANSWERED} user messages may wait for an answer: send response.create first.",
                "unanswered_input_limit",
                param,
            )

    def _add_turn(self, text: str) -> None:
        assert self.session is not None
        self.session.add_turn(text)
        self._unanswered += 1

    async def _item_create(self, message: dict[str, Any]) -> None:
        item: Any = message.get("item")
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            await self._call_output(item)
            return
        text = user_text(item)  # (an item that is not a dict is refused there)
        item_id = self._new_item_id(item)
        self._check_unanswered("item")
        self._add_turn(text)
        self.text_item(item_id, text)

    def _new_item_id(self, item: dict[str, Any]) -> str:
        """The id of an item the client creates: its own (checked), or one made here."""
        given = item.get("id")
        if isinstance(given, str) and len(given) > MAX_ITEM_ID:
            raise RealtimeError(
                f"An item id has at most {MAX_ITEM_ID} characters.", "string_above_max_length", "item.id"
            )
        item_id = given if isinstance(given, str) else f"item_text_{next(self._text_items)}"
        if self.item(item_id) is not None:
            raise RealtimeError(f"Item '{item_id}' already exists.", "duplicate_item_id", "item.id")
        return item_id

    async def _call_output(self, item: dict[str, Any]) -> None:
        """A function's result: it answers the model's call ``call_id``; the reply that
        uses it comes with ``response.create``."""
        item_id = self._new_item_id(item)
        call_id, output = item.get("call_id"), item.get("output")
        assert self.session is not None
        try:
            self.session.tools.result(call_id, output)
        except SessionError as e:
            param = "item.call_id" if e.code == "invalid_call_id" else "item.output"
            raise RealtimeError(str(e), e.code, param) from None
        self.call_output(item_id, str(call_id), str(output))

    async def _response_create(self, message: dict[str, Any]) -> None:
        assert self.session is not None
        response = message.get("response")
        if isinstance(response, dict) and "tool_choice" in response:
            try:
                self.session.tools.choose(response["tool_choice"])
            except SessionError as e:
                raise RealtimeError(str(e), e.code, "response.tool_choice") from None
        try:
            await self.session.respond()
        except SessionError as e:
            if e.code == "no_input":  # nothing was waiting after all (the session answered it)
                self._unanswered = 0
            raise
        self._unanswered = 0  # all of it is answered now

    async def _response_cancel(self, message: dict[str, Any]) -> None:
        assert self.session is not None
        await self.session.cancel()

    async def _truncate(self, message: dict[str, Any]) -> None:
        item_id, end = message.get("item_id"), message.get("audio_end_ms")
        if not isinstance(item_id, str):
            raise RealtimeError(
                "Missing required parameter: 'item_id'.", "missing_required_parameter", "item_id"
            )
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise RealtimeError(
                "Invalid 'audio_end_ms': expected an integer >= 0.", "integer_below_min_value", "audio_end_ms"
            )
        response_id = self.response_of(item_id)
        if response_id is None:
            raise RealtimeError(
                f"Item '{item_id}' is not an assistant audio message of this session.",
                "item_not_found",
                "item_id",
            )
        assert self.session is not None
        kept = await self.session.truncate(response_id, end)
        self.truncated(item_id, kept)

    def _known_item(self, message: dict[str, Any], verb: str) -> tuple[str, dict[str, Any]]:
        """The ``item_id`` of a retrieve or delete, and its item, if it names an item of
        this connection."""
        item_id = message.get("item_id")
        if not isinstance(item_id, str):
            raise RealtimeError(
                "Missing required parameter: 'item_id'.", "missing_required_parameter", "item_id"
            )
        item = self.item(item_id)
        if item is None:
            raise RealtimeError(
                f"Item with item_id not found: {shown(item_id)}.", f"item_{verb}_invalid_item_id", "item_id"
            )
        return item_id, item

    async def _item_retrieve(self, message: dict[str, Any]) -> None:
        _, item = self._known_item(message, "retrieve")
        self.send("conversation.item.retrieved", item=item)

    async def _item_delete(self, message: dict[str, Any]) -> None:
        """The item leaves the conversation: its words leave the session's history and KV
        (a reply in progress stops first: it is cut as heard, then deleted)."""
        item_id, item = self._known_item(message, "delete")
        assert self.session is not None
        if item["role"] == "assistant":
            response_id = self.response_of(item_id)
            if response_id is not None:
                await self.session.forget(response_id, reply=True)
                self.forget_response(response_id)
        elif (taken := self.take_text(item_id)) is not None:
            turn, text, waiting = taken
            if waiting:
                self._unanswered = max(0, self._unanswered - 1)
            await self.session.forget(turn, user_text=text)
        elif self.transcribing(item_id):
            raise RealtimeError(
                f"Item {shown(item_id)} is still being transcribed: delete it once it is done.",
                "item_delete_in_progress",
                "item_id",
            )
        self.deleted(item_id)

    async def _clear(self, message: dict[str, Any]) -> None:
        self._audio.clear()
        self.send("input_audio_buffer.cleared")

    async def _commit(self, message: dict[str, Any]) -> None:
        """Manual turns: the buffered audio becomes a user item, transcribed; the reply
        waits for ``response.create``."""
        if self.config.turn_detection is not None:
            raise RealtimeError(
                "With server_vad, the server commits the input audio itself.", "not_supported"
            )
        if self._audio.held < RUNTIME_INPUT_RATE // 10:
            raise RealtimeError(
                "Error committing input audio buffer: buffer too small. Expected at least 100ms of audio.",
                "input_audio_buffer_commit_empty",
            )
        self._check_unanswered(None)
        audio = self._audio.take()
        item_id = f"item_audio_{next(self._text_items)}"
        self.user_item(item_id, committed=True)
        assert self.session is not None
        transcript = await self.session.transcribe(audio)
        self.send(
            "conversation.item.input_audio_transcription.completed",
            item_id=item_id,
            content_index=0,
            transcript=transcript,
            usage={"type": "duration", "seconds": round(audio.size / RUNTIME_INPUT_RATE, 3)},
        )
        self.item_done(item_id, "user", [{"type": "input_audio", "transcript": transcript}])
        if transcript.strip():
            self._add_turn(transcript)
            self.given(item_id, transcript.strip())


HANDLERS = {
    "session.update": RealtimeConnection._session_update,
    "input_audio_buffer.append": RealtimeConnection._append,
    "input_audio_buffer.commit": RealtimeConnection._commit,
    "input_audio_buffer.clear": RealtimeConnection._clear,
    "conversation.item.create": RealtimeConnection._item_create,
    "conversation.item.truncate": RealtimeConnection._truncate,
    "conversation.item.retrieve": RealtimeConnection._item_retrieve,
    "conversation.item.delete": RealtimeConnection._item_delete,
    "response.create": RealtimeConnection._response_create,
    "response.cancel": RealtimeConnection._response_cancel,
}


async def read(ws: web.WebSocketResponse, connection: RealtimeConnection, link: Link) -> None:
    """The client's events, paced (`Pace`), each handled before the next is read. The
    reader yields to the loop between slices: messages already buffered are read
    without a suspension, so a fast client would otherwise hold the loop. It ends when
    the socket does, or the session, or at ``rate_limited`` (`Link.close_with` says so)."""
    session = connection.session
    assert session is not None
    pace = Pace(EVENT_RATE, EVENT_BURST, time.monotonic())
    slice_end = time.monotonic() + SLICE_S
    async for msg in ws:
        if msg.type == WSMsgType.ERROR:  # aiohttp has closed it with the code (1009, 1007, ...)
            break
        if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            continue
        EVENTS.inc()
        now = time.monotonic()
        wait = pace.wait_s(1 + len(msg.data) // EVENT_BYTES, now)
        if pace.over_s(now) > PATIENCE_S:
            log.info(
                "realtime %s: over %g events/s for %g s; closed",
                connection.config.id,
                EVENT_RATE,
                PATIENCE_S,
            )
            RATE_LIMITED.inc()
            link.close_with = (WSCloseCode.POLICY_VIOLATION, b"rate_limited")
            break
        if wait > 0 or now > slice_end:
            await asyncio.sleep(wait)  # sleep(0): one turn of the loop for everyone else
            slice_end = time.monotonic() + SLICE_S
            if session.closed.is_set():  # meanwhile (max_session_s, a slow reader): not one more event
                break
        if msg.type == WSMsgType.TEXT:
            await connection.handle(msg.data)
        else:
            connection.error(RealtimeError("Events are JSON text frames.", "invalid_event"), None)
