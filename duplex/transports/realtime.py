"""``WS /v1/realtime``: the OpenAI Realtime API (GA event protocol) over one session, so a
client written for it can talk to this server (base URL on our host, any key unless
``auth_token`` is set).

    client events ─► checked (`RealtimeError` ─► ``error``, the socket stays open)
        input_audio_buffer.append ─► decode (pcm 24 kHz / pcmu / pcma) ─► Session
        conversation.item.create (text), commit ─► Session.add_turn; response.create ─► Session.respond
        conversation.item.truncate ─► Session.truncate (clamped to what was sent)
        response.cancel ─► Session.cancel
    session events ─► `RealtimeWire` ─► GA server events (items, parts, deltas, done)

The runtime's events already carry the Realtime names; this module adds what the
protocol wraps around them: item and response objects, content parts, base64 audio in
the session's output format.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import logging
from typing import Any

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from audio_io.frame import AudioFrame, Int16Array
from audio_io.g711 import decode_wire, encode_wire
from audio_io.outbox import Outbox
from audio_io.resample import Resampler
from duplex import events as ev
from duplex.config import Config
from duplex.events import Event, SessionError
from duplex.session_config import MAX_SYSTEM_PROMPT, SessionConfig
from duplex.sessions import Sessions
from duplex.transports.link import send_all, websocket_link
from duplex.transports.output import Cursor, OutputStage
from duplex.transports.port import SessionPort
from duplex.transports.realtime_config import FORMATS, RealtimeError, RealtimeSessionConfig

log = logging.getLogger("duplex.realtime")

PATH = "/v1/realtime"
MAX_EVENT_BYTES = 24 * 1024 * 1024  # an append over 15 MB must reach us whole, to be refused with an error
MAX_APPEND_BYTES = 15 * 1024 * 1024
RUNTIME_INPUT_RATE = 16000
MAX_QUEUED = 2000  # events waiting for a client that does not read
MAX_BUFFER_S = 300  # manual turns: input audio held until commit


LAWS = {"audio/pcmu": "ulaw", "audio/pcma": "alaw", "audio/pcm": None}  # for decode_wire


def _decode(audio: bytes, kind: str) -> Int16Array:
    try:
        return decode_wire(audio, LAWS[kind])
    except ValueError:
        raise RealtimeError("PCM16 audio must be whole 16-bit samples.", param="audio") from None


def _user_message(item_id: str, part: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [part],
    }


class RealtimeWire:
    """A connection's output on the wire: runtime events and audio as GA server events
    (sent through the connection's bookkeeping of items and responses)."""

    def __init__(self, connection: RealtimeConnection) -> None:
        self.connection = connection
        self._transcripts: dict[str, str] = {}  # response id -> text so far
        self._partial: dict[str, str] = {}  # user item id -> transcript deltas sent

    @property
    def rate(self) -> int:
        return FORMATS[self.connection.config.output_format["type"]]

    def frame(self, samples: Int16Array, cursor: Cursor) -> list[str]:
        c = self.connection
        c.config.audio_started = True
        law = LAWS[c.config.output_format["type"]]
        data = base64.b64encode(encode_wire(samples, law)).decode()
        return [c.message("response.output_audio.delta", **c.part(cursor.response_id), delta=data)]

    def end_reply(self, cursor: Cursor, completed: bool) -> list[str]:
        return []

    def flushed(self) -> list[str]:
        return []

    def event(self, event: Event) -> list[str]:
        """Sent as they are made (`RealtimeConnection.send`): nothing returned."""
        c, d = self.connection, event.data
        if event.type == ev.SPEECH_STARTED:
            c.send(
                "input_audio_buffer.speech_started", audio_start_ms=d["audio_start_ms"], item_id=d["item_id"]
            )
        elif event.type == ev.SPEECH_STOPPED:
            c.send("input_audio_buffer.speech_stopped", audio_end_ms=d["audio_end_ms"], item_id=d["item_id"])
            c.user_item(d["item_id"], committed=True)
        elif event.type == ev.TRANSCRIPT_DELTA:
            sent = self._partial.get(d["item_id"], "")
            if d["delta"].startswith(sent) and len(d["delta"]) > len(sent):  # deltas only append
                c.send(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=d["item_id"],
                    content_index=0,
                    delta=d["delta"][len(sent) :],
                )
                self._partial[d["item_id"]] = d["delta"]
        elif event.type == ev.TRANSCRIPT_DONE:
            c.user_item(d["item_id"], committed=True)
            c.send(
                "conversation.item.input_audio_transcription.completed",
                item_id=d["item_id"],
                content_index=0,
                transcript=d["transcript"],
                usage={"type": "duration", "seconds": 0},
            )
            c.item_done(d["item_id"], "user", [{"type": "input_audio", "transcript": d["transcript"]}])
        elif event.type == ev.RESPONSE_CREATED:
            c.response_created(d["response_id"], d["item_id"])
        elif event.type == ev.TEXT_DELTA:
            self._transcripts[d["response_id"]] = self._transcripts.get(d["response_id"], "") + d["delta"]
            c.send("response.output_audio_transcript.delta", **c.part(d["response_id"]), delta=d["delta"])
        elif event.type == ev.RESPONSE_DONE:
            c.response_done(d["response_id"], d["status"], self._transcripts.pop(d["response_id"], ""))
        elif event.type == ev.TRUNCATED:
            c.truncated(d["item_id"], d["audio_end_ms"])
        elif event.type == ev.ERROR:
            error = d["error"]
            c.send(
                "error",
                error={
                    "type": error.get("type", "invalid_request_error"),
                    "code": error["code"],
                    "message": error["message"],
                    "param": None,
                    "event_id": None,
                },
            )
        return []


class RealtimeConnection:
    """One WebSocket: its session settings, its items, and the events to send."""

    _events = itertools.count()

    def __init__(self, ws: web.WebSocketResponse, config: RealtimeSessionConfig) -> None:
        self.ws = ws
        self.config = config
        self.session: SessionPort | None = None
        self.outbox: Outbox[str] = Outbox(max_control=MAX_QUEUED)  # a client that reads nothing gets no more
        self._items: dict[str, dict[str, Any]] = {}  # by item id, as the client sees them
        self._order: list[str] = []
        self._responses: dict[str, str] = {}  # response id -> its item id
        self._resampler = Resampler(24000, RUNTIME_INPUT_RATE)
        self._buffer: list[Int16Array] = []  # manual turns: audio appended since the last commit
        self._buffered = 0
        self._text_items = itertools.count()

    # -- sending --

    def message(self, type_: str, **fields: Any) -> str:
        return json.dumps({"type": type_, "event_id": f"event_{next(self._events)}", **fields})

    def send(self, type_: str, **fields: Any) -> None:
        self.outbox.put([self.message(type_, **fields)])

    def error(self, error: RealtimeError, event_id: str | None) -> None:
        self.send("error", error=error.body(event_id))

    # -- items --

    def _add_item(self, item: dict[str, Any]) -> None:
        previous = self._order[-1] if self._order else None
        self._items[item["id"]] = item
        self._order.append(item["id"])
        self.send("conversation.item.added", previous_item_id=previous, item=item)

    def user_item(self, item_id: str, committed: bool) -> None:
        if item_id in self._items:
            return
        if committed:
            previous = self._order[-1] if self._order else None
            self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        self._add_item(_user_message(item_id, {"type": "input_audio", "transcript": None}))

    def item_done(self, item_id: str, role: str, content: list[dict[str, Any]]) -> None:
        item = self._items.get(item_id)
        if item is None:
            return
        item["content"], item["status"] = content, "completed" if role == "user" else item["status"]
        previous = self._order[self._order.index(item_id) - 1] if self._order.index(item_id) else None
        self.send("conversation.item.done", previous_item_id=previous, item=item)

    def part(self, response_id: str) -> dict[str, Any]:
        return {
            "response_id": response_id,
            "item_id": self._responses.get(response_id, ""),
            "output_index": 0,
            "content_index": 0,
        }

    def _response(self, response_id: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": "turn_detected"}
        return {
            "object": "realtime.response",
            "id": response_id,
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": "conv_" + self.config.id,
            "output_modalities": ["audio"],
            "max_output_tokens": "inf",
            "metadata": None,
            "usage": None,
            "audio": {"output": {"format": self.config.output_format, "voice": self.config.voice}},
        }

    def response_created(self, response_id: str, item_id: str) -> None:
        self._responses[response_id] = item_id
        self.send("response.created", response=self._response(response_id, "in_progress", []))
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.send("response.output_item.added", response_id=response_id, output_index=0, item=item)
        self._add_item(item)
        self.send(
            "response.content_part.added", **self.part(response_id), part={"type": "audio", "transcript": ""}
        )

    def response_done(self, response_id: str, status: str, transcript: str) -> None:
        item_id = self._responses.get(response_id, "")
        item = self._items.get(item_id)
        part = self.part(response_id)
        self.send("response.output_audio.done", **part)
        self.send("response.output_audio_transcript.done", **part, transcript=transcript)
        self.send("response.content_part.done", **part, part={"type": "audio", "transcript": transcript})
        output = []
        if item is not None:
            item["status"] = "completed" if status == "completed" else "incomplete"
            item["content"] = [{"type": "output_audio", "transcript": transcript}]
            self.send("response.output_item.done", response_id=response_id, output_index=0, item=item)
            self.item_done(item_id, "assistant", item["content"])
            output = [item]
        self.send("response.done", response=self._response(response_id, status, output))

    def truncated(self, item_id: str, audio_end_ms: int) -> None:
        self.send("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=audio_end_ms)

    # -- client events --

    async def handle(self, raw: str) -> None:
        event_id: str | None = None
        try:
            try:
                message = json.loads(raw)
            except ValueError:
                raise RealtimeError("The event is not valid JSON.", "invalid_json") from None
            if not isinstance(message, dict):
                raise RealtimeError("An event is a JSON object.", "invalid_event")
            event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
            kind = message.get("type")
            handler = HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise RealtimeError(
                    f"Invalid value: {str(kind)[:60]!r}. Unknown event type.", "invalid_value", "type"
                )
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
        self.config.update(message.get("session"))
        assert self.session is not None
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
        if len(audio) > MAX_APPEND_BYTES * 4 // 3 + 4:
            raise RealtimeError(f"'audio' is over {MAX_APPEND_BYTES} bytes.", "audio_too_large", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("'audio' is not valid base64.", "invalid_base64", "audio") from None
        kind = self.config.input_format["type"]
        samples = _decode(data, kind)
        rate = FORMATS[kind]
        if self._resampler.in_rate != rate:
            self._resampler = Resampler(rate, RUNTIME_INPUT_RATE)
        assert self.session is not None
        pcm = self._resampler.process(samples)
        if self.config.turn_detection is not None:
            self.session.push_audio(AudioFrame(pcm, RUNTIME_INPUT_RATE))
            return
        self.session.touch()  # manual turns: held until commit
        if self._buffered + pcm.size > MAX_BUFFER_S * RUNTIME_INPUT_RATE:
            raise RealtimeError(
                f"The input audio buffer holds at most {MAX_BUFFER_S} s: commit or clear it.",
                "input_audio_buffer_full",
                "audio",
            )
        self._buffer.append(pcm)
        self._buffered += pcm.size

    async def _item_create(self, message: dict[str, Any]) -> None:
        item = message.get("item")
        if not isinstance(item, dict):
            raise RealtimeError("Missing required parameter: 'item'.", "missing_required_parameter", "item")
        if item.get("type") != "message" or item.get("role") != "user":
            raise RealtimeError("Only user messages can be created.", "unsupported", "item.type")
        content = item.get("content")
        parts = content if isinstance(content, list) else []
        texts = [
            p["text"]
            for p in parts
            if isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)
        ]
        if not texts or len(texts) != len(parts):
            raise RealtimeError("A user message needs 'input_text' content.", "invalid_value", "item.content")
        text = " ".join(texts)
        if len(text) > 4000:
            raise RealtimeError(
                "The message is over 4000 characters.", "string_above_max_length", "item.content"
            )
        given = item.get("id")
        item_id = given if isinstance(given, str) else f"item_text_{next(self._text_items)}"
        if item_id in self._items:
            raise RealtimeError(f"Item '{item_id}' already exists.", "duplicate_item_id", "item.id")
        assert self.session is not None
        self.session.add_turn(text)
        self._add_item(_user_message(item_id, {"type": "input_text", "text": text}))
        self.send("conversation.item.done", previous_item_id=None, item=self._items[item_id])

    async def _response_create(self, message: dict[str, Any]) -> None:
        assert self.session is not None
        await self.session.respond()

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
        response_id = next((r for r, i in self._responses.items() if i == item_id), None)
        if response_id is None:
            raise RealtimeError(
                f"Item '{item_id}' is not an assistant audio message of this session.",
                "item_not_found",
                "item_id",
            )
        assert self.session is not None
        kept = await self.session.truncate(response_id, end)
        self.truncated(item_id, kept)

    async def _clear(self, message: dict[str, Any]) -> None:
        self._buffer, self._buffered = [], 0
        self.send("input_audio_buffer.cleared")

    async def _commit(self, message: dict[str, Any]) -> None:
        """Manual turns: the buffered audio becomes a user item, transcribed; the reply
        waits for ``response.create``."""
        if self.config.turn_detection is not None:
            raise RealtimeError(
                "With server_vad, the server commits the input audio itself.", "not_supported"
            )
        if self._buffered < RUNTIME_INPUT_RATE // 10:
            raise RealtimeError(
                "Error committing input audio buffer: buffer too small. Expected at least 100ms of audio.",
                "input_audio_buffer_commit_empty",
            )
        audio, self._buffer, self._buffered = np.concatenate(self._buffer), [], 0
        item_id = f"item_audio_{next(self._text_items)}"
        self.user_item(item_id, committed=True)
        assert self.session is not None
        transcript = await self.session.transcribe(audio)
        self.send(
            "conversation.item.input_audio_transcription.completed",
            item_id=item_id,
            content_index=0,
            transcript=transcript,
            usage={"type": "duration", "seconds": audio.size / RUNTIME_INPUT_RATE},
        )
        self.item_done(item_id, "user", [{"type": "input_audio", "transcript": transcript}])
        if transcript.strip():
            self.session.add_turn(transcript)


HANDLERS = {
    "session.update": RealtimeConnection._session_update,
    "input_audio_buffer.append": RealtimeConnection._append,
    "input_audio_buffer.commit": RealtimeConnection._commit,
    "input_audio_buffer.clear": RealtimeConnection._clear,
    "conversation.item.create": RealtimeConnection._item_create,
    "conversation.item.truncate": RealtimeConnection._truncate,
    "response.create": RealtimeConnection._response_create,
    "response.cancel": RealtimeConnection._response_cancel,
}


class RealtimeEndpoint:
    def __init__(self, config: Config, sessions: Sessions) -> None:
        self.config = config
        self.sessions = sessions

    def routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.connect)

    async def connect(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=MAX_EVENT_BYTES, heartbeat=None)
        await ws.prepare(request)
        try:
            voice = self.sessions.check_room()
        except SessionError as e:
            await ws.send_str(
                json.dumps(
                    {
                        "type": "error",
                        "event_id": "event_0",
                        "error": RealtimeError(str(e), e.code, kind="server_error").body(None),
                    }
                )
            )
            await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=e.code.encode())
            return ws
        settings = RealtimeSessionConfig("", voice.name, self.config.system_prompt or "", MAX_SYSTEM_PROMPT)
        connection = RealtimeConnection(ws, settings)
        stage = OutputStage(RealtimeWire(connection), connection.outbox)
        session = await self.sessions.open(stage, SessionConfig(input_rate=RUNTIME_INPUT_RATE))
        settings.id = session.id
        connection.session = session
        connection.apply_turn_detection()  # the API's defaults, as session.created shows them
        connection.send("session.created", session=settings.as_dict())
        link = websocket_link(self.sessions, session, stage, ws)
        link.own(send_all(connection.outbox, ws.send_str), "realtime-send")
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await connection.handle(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    connection.error(RealtimeError("Events are JSON text frames.", "invalid_event"), None)
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            await link.close()
        return ws
