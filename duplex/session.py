"""`Session`: one conversation, transport-agnostic: the controller of its turns.

A transport drives it through `SessionPort` and gives it a `Sink` for what goes out
(both in duplex/port.py); every event goes through a `WatchedSink`, which also tells the
session's watchers (`watch`: a Realtime client joined to a call).

    push_audio ─► Inbound (checks, queue, 16 kHz) ─► TurnTaking: Listener (VAD + ASR), verdicts
                                                                                     │
    Sink.audio ◄─ Reply: _send ◄─ Pacer ◄─ _synthesize (TTS) ◄─ _generate (LLM) ◄────┘

Who speaks when is decided in `duplex.turn_taking` (on the pure rules of
`duplex.turn_policy`); the session acts on it (`TurnHost`), and every change of its
state is made here. A barge-in cuts the reply, in the conversation and in its KV, to the
words the caller heard (playout ledger and TTS word marks). Every task has an owner: the
session owns the hearing loop and the current `Reply` (which owns its three tasks),
turn-taking its prefills and judgements; `close` cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace

from audio_io.frame import AudioFrame, Int16Array
from audio_io.ledger import PlayoutLedger
from duplex import events as ev
from duplex import metrics
from duplex.echo import EchoGate
from duplex.echo_canceller import EchoCanceller
from duplex.engines import Engines
from duplex.events import Event, SessionError
from duplex.inbound import Inbound
from duplex.port import SessionPort, Sink, Unwatch, Voice, Watcher
from duplex.reply import Outlet, Reply, gather_cancelled
from duplex.session_config import SessionConfig, check_system_prompt
from duplex.session_watch import WatchedSink
from duplex.state import State, StateMachine
from duplex.tool_calls import ToolCalls
from duplex.tool_wait import ToolWait, saying
from duplex.turn import TurnTimes, UnansweredTurns
from duplex.turn_ports import ReplyView
from duplex.turn_taking import TurnTaking
from models.asr_types import AsrClosed
from models.conversation import Conversation, check_user_text
from models.listen import Listener
from models.llm import LlmError
from models.vad import VadConfig

log = logging.getLogger("duplex.session")


class Session(SessionPort):
    _ids = itertools.count()

    def __init__(self, engines: Engines, sink: Sink, config: SessionConfig | None = None) -> None:
        self.engines = engines
        self.sink = sink
        self._watched = WatchedSink(sink)  # the sink, its events told to watchers first (`watch`)
        self.config = config or SessionConfig()
        self.id = f"sess_{next(self._ids)}"
        self.machine = StateMachine(self._on_state)
        self.conversation = Conversation(engines.llm, self.config.system_prompt)
        self.tools = ToolCalls(self.conversation)  # the client's functions, their calls and results
        self.tool_wait = ToolWait(self.conversation, self)  # what the caller hears while they run
        self.ledger = PlayoutLedger(engines.tts.sample_rate)
        self.echo = EchoGate(self.config.echo_suppression_db)
        canceller = EchoCanceller() if self.config.echo_cancellation else None
        acks = self.config.playback_acks
        self._out = Outlet(self._watched, self.ledger, self.echo, canceller, played_when_sent=not acks)
        self._vad_config = self.config.vad(VadConfig())
        self._listener: Listener | None = None
        self._inbound = Inbound(self.config, self.echo, canceller)
        self._turns: TurnTaking | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._reply: Reply | None = None
        self._items = itertools.count()
        self.unanswered = UnansweredTurns()  # user turns not answered yet (`respond`)
        self.last_input = time.monotonic()  # when the transport last sent anything (`touch`)
        self.closed = asyncio.Event()  # set by `close`, for the transport to end its side

    # -- lifecycle --

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def turns(self) -> TurnTaking:
        """Who speaks when, with its counts (barge-ins, resumes, false alarms, pauses)."""
        assert self._turns is not None, "the session has not started"
        return self._turns

    async def start(self) -> None:
        self._listener = Listener(self.engines.vad, self.engines.asr, self._vad_config)
        self._listener.word_times = self.config.word_times
        self._turns = TurnTaking(self, self._listener, self._inbound)
        self._listen_task = asyncio.create_task(self._turns.run(), name=f"{self.id}-listen")
        metrics.SESSIONS.inc()
        self.machine.to(State.LISTENING)

    async def close(self) -> None:
        """End the session: stop every task and free the KV; idempotent."""
        if self.state is State.CLOSED:
            return
        self.machine.to(State.CLOSED)
        self.closed.set()
        if self._listen_task is not None:
            metrics.SESSIONS.dec()
        reply = self._reply
        if reply is not None:
            await reply.stop()
            self._finish(reply, "cancelled")
        await self.tool_wait.close()
        await self.tools.close()
        tasks = [*self._turns.tasks, self._listen_task] if self._turns and self._listen_task else []
        await gather_cancelled(tasks)
        if self._listener is not None:
            self._listener.close()
        self.conversation.close()

    # -- the port: what the transport may do --

    @property
    def voice(self) -> Voice:
        return Voice(self.engines.tts.name, self.engines.tts.sample_rate)

    @property
    def busy(self) -> bool:
        """The caller is speaking or a reply is in progress."""
        return self.state not in (State.LISTENING, State.IDLE)

    def touch(self) -> None:
        self.last_input = time.monotonic()

    def push_audio(self, frame: AudioFrame) -> None:
        """Inbound audio; bad audio is an ``error`` event, and the session goes on."""
        if self.state is State.CLOSED:
            return
        self.touch()
        error = self._inbound.push(frame)
        if error is not None:
            self.send_error(error)

    async def push_text(self, text: str) -> None:
        """A user turn as text (instead of speech): the reply in progress, if any, ends."""
        self.touch()
        try:
            text = check_user_text(text)
        except LlmError as e:
            self.send_error(SessionError("bad_text", str(e)))
            return
        await self.answer(text, TurnTimes(final=time.monotonic()))

    def add_turn(self, text: str) -> None:
        """A user turn (a text item, a committed buffer) waiting for `respond`; bad: `SessionError`."""
        self.touch()
        try:
            text = check_user_text(text)
        except LlmError as e:
            raise SessionError("bad_text", str(e)) from None
        self.unanswered.add(text)

    async def respond(self) -> None:
        """Answer what waits: user turns (`add_turn`'s, those held while ``answer_turns`` is off),
        tool results. A reply in progress is cut as heard first, unless only its calls' results wait."""
        self.touch()
        if not self.unanswered and not self.tools.waiting:
            raise SessionError("no_input", "there is no new user input to respond to")
        if self._reply is not None and not self._reply.held and self.tools.complete and not self.unanswered:
            self.unanswered.after_reply = True  # its words before the calls play out, not cut
            return
        await self.answer("", TurnTimes(final=time.monotonic()))

    def dtmf(self, digit: str) -> None:
        """A key pressed on the phone: an event in the Realtime API's shape (key, Unix s)."""
        self.touch()
        self.emit(ev.DTMF, event=digit, received_at=int(time.time()))

    async def cancel(self) -> None:
        """The client cancels the reply in progress (kept as far as it was heard)."""
        self.touch()
        await self._stop(None)

    async def truncate(self, response_id: str, audio_end_ms: int) -> int:
        """The client played only ``audio_end_ms`` of this reply: it stops here if still
        going, and is kept, in history and KV, as far as heard (if the conversation's
        last reply). Clamped to the audio sent (clients race); returns the ms kept."""
        self.touch()
        if response_id not in self.ledger.turns:
            raise SessionError("unknown_item", f"no reply {response_id!r} in this session")
        await self._stop(response_id)
        rate = self.ledger.sample_rate
        kept = self.ledger.truncate(response_id, max(0, audio_end_ms) * rate // 1000)
        self.conversation.truncate(response_id, self.ledger.heard_text(response_id))
        return kept * 1000 // rate

    async def forget(
        self, response_id: str | None, user_text: str | None = None, reply: bool = False
    ) -> None:
        """A client deleted a user message (``user_text``: of the turn ``response_id`` answered,
        or waiting if None) or that reply: out of the history (the KV follows), stopped first."""
        self.touch()
        if response_id is None:
            self.unanswered.remove(user_text)
            return
        await self._stop(response_id)
        self.conversation.forget(response_id, user_text, reply)

    def configure(self, changes: dict[str, object]) -> None:
        """Change turn-taking settings while the session runs (`SessionConfig.RUNTIME_KEYS`);
        a bad key or value is a `SessionError`, and nothing changes."""
        self.config = self.config.changed(changes)
        self.echo.configure(self.config.echo_suppression_db)
        self._vad_config = self.config.vad(self._vad_config)
        if self._listener is not None:
            self._listener.vad_config = self.config.vad(self._listener.vad_config)
            self._quick_onsets(self._reply is not None and self._reply.begun)
            self._listener.word_times = self.config.word_times

    def set_instructions(self, instructions: str | None) -> None:
        """The system prompt for the turns to come; a bad one is a `SessionError`."""
        self.conversation.set_system_prompt(check_system_prompt(instructions) or None)

    async def transcribe(self, samples: Int16Array) -> str:
        """A whole utterance at 16 kHz (a manual commit), through the ASR worker's queue."""
        try:
            return await self.engines.asr.transcribe_queued(samples)
        except AsrClosed:
            raise SessionError("shutting_down", "the server is shutting down") from None

    def playback(self, stream_position: int) -> None:
        """The transport played the output stream up to this many samples."""
        self.touch()
        self.ledger.record_played(stream_position)

    async def _stop(self, response_id: str | None) -> None:
        """The client stops the reply in progress (only if it is ``response_id``, if given)."""
        if self._reply is not None and response_id in (None, self._reply.id):
            await self.stop_reply()
            self.machine.to(State.LISTENING)

    def send_error(self, error: SessionError) -> None:
        log.info("session %s: %s: %s", self.id, error.code, error)
        self._watched.event(error.event())

    def watch(self, watcher: Watcher, limit: int) -> Unwatch | None:
        return self._watched.watch(watcher, limit)

    # -- what turn-taking does (`TurnHost`): every change of state is made here --

    @property
    def reply(self) -> Reply | None:
        return self._reply

    def begin_user_turn(self, position: int) -> str:
        item = f"item_{next(self._items)}"
        self.machine.to(State.USER_SPEAKING)
        self.emit(ev.SPEECH_STARTED, item_id=item, audio_start_ms=position // 16)
        return item

    def interrupt(self, reply: ReplyView) -> None:
        reply.pause()  # nothing more leaves from here on
        self.sink.flush()
        self.machine.to(State.INTERRUPTED)

    async def answer(self, text: str, times: TurnTimes) -> None:
        """Reply to a user turn, and to the turns before it not answered yet. A reply
        still in progress ends first (cut as heard): text input and speech come from
        different tasks, and either may have begun one while the other waited."""
        while self._reply is not None:
            await self.stop_reply()
        self._respond(self.unanswered.take(text), times)

    def hold(self, text: str, times: TurnTimes) -> None:
        self._respond(text, times, held=True)

    def say(self, text: str) -> None:
        """The service's own words (`ToolWait`): a reply of their own, not in the conversation."""
        self._respond("", TurnTimes(final=time.monotonic()), said=text)

    def _respond(self, text: str, times: TurnTimes, held: bool = False, said: str | None = None) -> None:
        assert self._reply is None, "a reply is already in progress"
        n = next(self._items)
        tts = self.engines.tts.stream()
        reply = Reply(f"resp_{n}", f"item_{n}", text, times, tts, self._out, self, held, self.id, said)
        self._reply = reply
        self.ledger.start_turn(reply.id)
        if not held:
            self.machine.to(State.RESPONDING)
        reply.emit(ev.RESPONSE_CREATED)
        chat = self.conversation  # (a reply of the service's own words has no LLM to abort)
        words = chat.reply(text, reply.id, *self.tools.bind(reply)) if said is None else saying(said)
        reply.start(words, chat.abort)

    def release(self, reply: ReplyView) -> None:
        assert reply is self._reply, "released a reply that is not the session's"
        self.machine.to(State.RESPONDING)
        self._reply.release()

    async def stop_reply(self) -> None:
        """Whatever reply is in progress ends: cut if it was heard, dropped if held back."""
        reply = self._reply
        if reply is not None and reply.held:
            await self.drop(reply)
        elif reply is not None:
            await self.cut(reply)

    async def drop(self, reply: ReplyView) -> None:
        """The caller went on: the held reply goes, leaving no trace in the conversation."""
        assert isinstance(reply, Reply)
        await reply.stop()
        self.conversation.retract(reply.id)
        if self._reply is reply:
            self._reply = None
            reply.end(None)

    async def cut(self, reply: ReplyView) -> None:
        """Barge-in or cancel: stop everything of the reply, keep what was heard."""
        assert isinstance(reply, Reply)
        await reply.stop(cut=True)
        self._finish(reply, "cancelled")
        self.ledger.discard_unsent(reply.id)
        heard = self.ledger.heard_text(reply.id)
        self.conversation.truncate(reply.id, heard)
        end_ms = self.ledger.audio_end_ms(reply.id)
        self.emit(ev.TRUNCATED, item_id=reply.item_id, content_index=0, audio_end_ms=end_ms, transcript=heard)

    def resume(self) -> None:
        reply = self._reply
        if reply is None:
            self.machine.to(State.LISTENING)
            return
        reply.resume()
        self.machine.to(State.RESPONDING)
        self.emit(ev.RESUMED, response_id=reply.id)

    def settle(self) -> None:
        self.machine.to(State.RESPONDING if self._reply is not None else State.LISTENING)

    def emit(self, type_: str, **data: object) -> None:
        self._watched.event(Event(type_, dict(data)))

    async def prefill(self, words: str) -> None:
        await self.conversation.prefill(words)

    async def turn_score(self, words: str) -> float | None:
        try:
            return await self.conversation.end_of_turn(self.unanswered.with_(words))
        except LlmError:  # the LLM is out: silence alone ends the turn
            return None

    def _quick_onsets(self, on: bool) -> None:
        """While the reply plays, the VAD confirms speech sooner: a barge-in must stop it
        fast, and a false start costs only a pause (the reply resumes)."""
        assert self._listener is not None
        ms = self.config.barge_in_min_speech_ms if on else self._vad_config.min_speech_ms
        self._listener.vad_config = replace(self._listener.vad_config, min_speech_ms=ms)

    def _finish(self, reply: Reply, status: str) -> None:
        """The reply ended (played out, or stopped): tell the client, listen again."""
        if self._reply is not reply:
            return
        self._reply = None
        self._quick_onsets(False)
        if not reply.begun and reply.times.call is not None:  # a call alone: figures with no audio
            reply.report(self.conversation.last)
        reply.end(status)
        if self.state is State.RESPONDING:
            self.machine.to(State.LISTENING)
        self.tool_wait.watch(self.conversation.outstanding())  # results awaited from now

    # -- what its replies need (`ReplyHost`) --

    def began(self, reply: Reply) -> None:
        self._quick_onsets(True)
        reply.report(self.conversation.last)  # this reply's prompt (its first token came before its audio)

    def words_ended(self, reply: Reply) -> None:
        reply.report()

    async def played_out(self, reply: Reply) -> None:
        if self._reply is reply and reply.error is not None:  # failed: keep what was heard
            self.ledger.discard_unsent(reply.id)
            self.conversation.truncate(reply.id, self.ledger.heard_text(reply.id))
            self._finish(reply, "failed")
        elif self._reply is reply:
            self._finish(reply, "completed")
            waiting = self.unanswered or self.tools.waiting  # words heard over it, or results
            if self.unanswered.after_reply and waiting and self.state is State.LISTENING:
                await self.answer("", TurnTimes(final=time.monotonic()))

    def _on_state(self, old: State, new: State) -> None:
        self.emit(ev.STATE, state=new.value, previous=old.value)
        self.tool_wait.poke()
