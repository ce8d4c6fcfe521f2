"""`Session`: one conversation, transport-agnostic: the controller of its turns.

A transport drives it through `SessionPort` and gives it a `Sink` for what goes out
(both in duplex/port.py): audio frames (20 ms, at the voice's rate), events,
`flush` to drop the audio the transport still buffers (barge-in), and `end_reply` just
before each reply's ``response.done``.

    push_audio ─► Inbound (checks, queue, 16 kHz) ─► _listen: Listener (VAD + ASR) ─► turn-taking
                                                                                     │
    Sink.audio ◄─ Reply: _send ◄─ Pacer ◄─ _synthesize (TTS) ◄─ _generate (LLM) ◄────┘

Turn-taking is decided in `_listen`, one place: the session gathers each decision's
inputs (levels, words, times, settings) and acts on the verdict of a pure function of
`duplex.turn_policy` (which tells the rules: echo, tentative interruptions, barge-in,
false-interruption resume). The caller's committed words are prefilled into the LLM's
KV while they speak; a barge-in cuts the reply, in the conversation and in its KV, to
the words the caller heard (playout ledger and TTS word marks).

Every task has an owner: the session owns `_listen`, its prefills and speculations, and
the current `Reply`, which owns its three tasks (`Reply.stop`); `close` cancels and
awaits them all.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import replace

from audio_io.frame import AudioFrame, Int16Array
from audio_io.ledger import PlayoutLedger
from audio_io.pcm import RUNTIME_RATE
from duplex import events as ev
from duplex import metrics
from duplex import turn_policy as policy
from duplex.echo import EchoGate
from duplex.echo_canceller import EchoCanceller
from duplex.engines import Engines
from duplex.events import Event, SessionError
from duplex.inbound import ECHO_CHECK_SAMPLES, Inbound
from duplex.reply import Outlet, Reply, ReplyState, gather_cancelled, llm_failure
from duplex.session_config import SessionConfig, check_system_prompt
from duplex.state import State, StateMachine
from duplex.port import SessionPort, Sink, Voice
from duplex.turn import Interruption, TurnTimes, word_times_ms
from models.asr_types import AsrClosed
from models.conversation import MAX_USER_CHARS, Conversation, TurnStats, check_user_text
from models.listen import Listener, ListenEvent, ListenEventKind
from models.llm import LlmError
from models.llm_types import LlmUnavailable
from models.vad import VadConfig

log = logging.getLogger("duplex.session")

ECHO_PREROLL = RUNTIME_RATE // 10  # ASR starts this far before the caller's voice rose over the echo
ECHO_TEXT_S = 4.0  # words heard over the reply are compared with its last 4 s (`is_echo_of`)


class Session(SessionPort):
    _ids = itertools.count()

    def __init__(self, engines: Engines, sink: Sink, config: SessionConfig | None = None) -> None:
        self.engines = engines
        self.sink = sink
        self.config = config or SessionConfig()
        self.id = f"sess_{next(self._ids)}"
        self.machine = StateMachine(self._on_state)
        self.conversation = Conversation(engines.llm, self.config.system_prompt)
        self.ledger = PlayoutLedger(engines.tts.sample_rate)
        self.echo = EchoGate(self.config.echo_suppression_db)
        canceller = EchoCanceller() if self.config.echo_cancellation else None
        self._out = Outlet(
            sink, self.ledger, self.echo, canceller, played_when_sent=not self.config.playback_acks
        )
        self._vad_config = self.config.vad(VadConfig())
        self._listener: Listener | None = None
        self._inbound = Inbound(self.config, self.echo, canceller)
        self._listen_task: asyncio.Task[None] | None = None
        self._reply: Reply | None = None
        # a reply whose first audio left before its prompt's figures were known (`_report`)
        self._unreported: tuple[Reply, dict[str, float], TurnStats] | None = None
        self._interruption: Interruption | None = None
        self._score: tuple[int, float] | None = None  # (the VAD's pause, P(the turn is over) there)
        self._pause_words: tuple[int, str] | None = None  # (the VAD's pause, the words before it)
        self._judging_ms = 0.0  # how long the LLM's judgements of this caller's pauses take (`_prepare`)
        self._echo_utterance = False  # the utterance in progress is the assistant's echo
        self._utterance_start = 0  # stream position of the caller's speech start
        self._quick_holdoff = 0.0
        self._items = itertools.count()
        self._times = TurnTimes()
        self._user_item = "item_none"
        self._unanswered: list[str] = []  # user turns not answered yet (`respond`)
        self._after_reply = False  # ... to be answered once the reply playing ends
        self._background: set[asyncio.Task[None]] = set()  # prefills and speculations
        self.barge_ins = 0
        self.resumes = 0
        self.false_alarms = 0  # quick pauses the VAD did not confirm
        # when speech over a reply paused it (each then a barge-in, a resume or a false
        # alarm): the bench tells the caller's pauses from the echo's
        self.pauses: collections.deque[float] = collections.deque(maxlen=1000)
        self.last_input = time.monotonic()  # when the transport last sent anything (`touch`)
        self.closed = asyncio.Event()  # set by `close`, for the transport to end its side

    # -- lifecycle --

    @property
    def state(self) -> State:
        return self.machine.state

    async def start(self) -> None:
        self._listener = Listener(self.engines.vad, self.engines.asr, self._vad_config)
        self._listener.asr.word_times = self.config.word_times
        self._listen_task = asyncio.create_task(self._listen(), name=f"{self.id}-listen")
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
        tasks = [*self._background] + ([self._listen_task] if self._listen_task else [])
        for task in tasks:
            task.cancel()
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
        await self._answer(text, TurnTimes(final=time.monotonic()))

    def add_turn(self, text: str) -> None:
        """A user turn (a Realtime text item, a committed audio buffer) that waits for
        `respond`; a bad one is a `SessionError`."""
        self.touch()
        try:
            text = check_user_text(text)
        except LlmError as e:
            raise SessionError("bad_text", str(e)) from None
        waiting = sum(len(t) + 1 for t in self._unanswered)
        if waiting + len(text) > MAX_USER_CHARS:  # they are answered as one turn
            raise SessionError(
                "too_much_input",
                f"{waiting} characters of user turns wait for a reply; one takes {MAX_USER_CHARS} at most",
            )
        self._unanswered.append(text)

    async def respond(self) -> None:
        """Answer the user turns not answered yet: those of `add_turn`, and those heard
        while ``answer_turns`` is off. A reply in progress ends first (cut as heard)."""
        self.touch()
        if not self._unanswered:
            raise SessionError("no_input", "there is no new user input to respond to")
        await self._answer("", TurnTimes(final=time.monotonic()))

    def dtmf(self, digit: str) -> None:
        """The caller pressed a key on the phone: told to the client as an event, in the
        Realtime API's shape (the key, and the Unix time it came in whole seconds)."""
        self.touch()
        self._emit(ev.DTMF, event=digit, received_at=int(time.time()))

    async def cancel(self) -> None:
        """The client cancels the reply in progress (kept as far as it was heard)."""
        self.touch()
        if self._reply is not None:
            await self._stop_reply()
            self.machine.to(State.LISTENING)

    async def truncate(self, response_id: str, audio_end_ms: int) -> int:
        """The client played only ``audio_end_ms`` of this reply: it stops here if still
        going, and it is kept, in the history and the KV, as far as that was heard
        (when it is the conversation's last reply). Clamped to the audio sent (clients
        race here); returns the milliseconds kept."""
        self.touch()
        if response_id not in self.ledger.turns:
            raise SessionError("unknown_item", f"no reply {response_id!r} in this session")
        if self._reply is not None and self._reply.id == response_id:
            await self._stop_reply()
            self.machine.to(State.LISTENING)
        rate = self.ledger.sample_rate
        kept = self.ledger.truncate(response_id, max(0, audio_end_ms) * rate // 1000)
        self.conversation.truncate(response_id, self.ledger.heard_text(response_id))
        return kept * 1000 // rate

    async def forget(
        self, response_id: str | None, user_text: str | None = None, reply: bool = False
    ) -> None:
        """A client deleted an item: one of its user messages (``user_text``, as given:
        in the turn the reply ``response_id`` answered, or still waiting for an answer
        if None) or the reply ``response_id`` itself. It leaves the history, and the KV
        follows at the next turn. The reply it belongs to stops first if still going."""
        self.touch()
        if response_id is None:
            if user_text in self._unanswered:
                self._unanswered.remove(user_text)
            return
        if self._reply is not None and self._reply.id == response_id:
            await self._stop_reply()
            self.machine.to(State.LISTENING)
        self.conversation.forget(response_id, user_text, reply)

    def configure(self, changes: dict[str, object]) -> None:
        """Change turn-taking settings while the session runs (`SessionConfig.RUNTIME_KEYS`);
        a bad key or value is a `SessionError`, and nothing changes."""
        self.config = self.config.changed(changes)
        self.echo.configure(self.config.echo_suppression_db)
        self._vad_config = self.config.vad(self._vad_config)
        if self._listener is not None:
            vad = self._listener.vad
            vad.config = self.config.vad(vad.config)
            self._quick_onsets(self._playing() is not None)
            self._listener.asr.word_times = self.config.word_times

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

    def send_error(self, error: SessionError) -> None:
        log.info("session %s: %s: %s", self.id, error.code, error)
        self.sink.event(error.event())

    # -- hearing --

    async def _listen(self) -> None:
        assert self._listener is not None
        while True:
            samples, residual, arrived = await self._inbound.next(self._listener.position)
            self._quick_pause(residual, arrived - ECHO_CHECK_SAMPLES / RUNTIME_RATE)
            try:
                for event in await self._listener.push(samples):
                    await self._on_listen(event)
                if self._turn_over():
                    for event in await self._listener.end_turn():
                        await self._on_listen(event)
                await self._check_interruption()
                held = self._reply
                if held is not None and held.held and self._listener.speaking and not self._listener.paused:
                    await self._drop(held)  # the caller went on after the pause
            except LlmError as e:  # this session's turn could not be served; the session goes on
                self.send_error(llm_failure(e))
            except Exception:  # a bug: this session reports it, every other one carries on
                log.exception("session %s: listening failed", self.id)
                self.send_error(SessionError("internal_error", "the server failed to process this audio"))

    def _quick_pause(self, residual: Int16Array, since: float) -> None:
        """While the reply plays, a loud frame pauses it before the VAD can tell
        (`turn_policy.quick_pause`), unless it may be the reply's echo; `_check_echo` then
        confirms it as an interruption, or it was a false alarm and the reply goes on."""
        if not (self.config.quick_pause and self.config.barge_in):
            return
        level, room = self._inbound.level(residual)
        now = time.monotonic()
        reply = self._playing()
        if reply is None or self._interruption is not None:
            return
        paused = reply.state is ReplyState.PAUSED
        verdict = policy.quick_pause(level, room, reply.quick_paused, paused, self._quick_holdoff, now)
        if verdict is policy.QuickPause.FALSE_ALARM:
            reply.quick_paused = None
            self.false_alarms += 1
            log.debug("session %s: the VAD heard no caller after a quick pause", self.id)
            metrics.FALSE_ALARMS.inc()
            self._quick_holdoff = now + policy.QUICK_PAUSE_HOLDOFF_S
            reply.resume()
        elif verdict is policy.QuickPause.LOUD and not self._inbound.may_be_echo(since, now):
            reply.pause()
            reply.quick_paused = now
            self.pauses.append(now)

    async def _on_listen(self, event: ListenEvent) -> None:
        kind = event.kind
        if kind is ListenEventKind.SPEECH_STARTED:
            await self._speech_started(event)
        elif self._echo_utterance:
            if kind is ListenEventKind.FINAL:
                self._echo_utterance = False
                heard = event.result.text if event.result is not None else ""
                log.debug("session %s: %r over the reply was never louder than its echo", self.id, heard)
        elif kind is ListenEventKind.PARTIAL:
            assert event.result is not None
            if self._interruption is not None:
                # judged on words ASR has committed (seen alike by two passes): a partial
                # of a short sound is where Whisper hallucinates ("You", "Thank you.")
                self._interruption.words = " ".join(w.text for w in event.result.committed)
            else:
                self._emit(ev.TRANSCRIPT_DELTA, item_id=self._user_item, delta=event.result.text)
                committed = " ".join(w.text for w in event.result.committed)
                if committed and self._reply is None and not (self._listener and self._listener.paused):
                    self._prefill("\n".join([*self._unanswered, committed]))
        elif kind is ListenEventKind.PAUSED:
            self._paused()
        elif kind is ListenEventKind.SPEECH_STOPPED:
            self._times.speech_end = self._inbound.arrival(event.position)
            self._times.stopped = event.at
            self._times.silence_ms = event.silence_ms
            if self._interruption is None:
                self._emit(ev.SPEECH_STOPPED, item_id=self._user_item, audio_end_ms=event.position // 16)
            else:  # told if it turns out to be a barge-in (`_barge_in`)
                self._interruption.stopped = event.position
        elif kind is ListenEventKind.FINAL:
            assert event.result is not None
            await self._final(event.result.text.strip(), event)

    async def _speech_started(self, event: ListenEvent) -> None:
        self._utterance_start = event.position
        playing = self._playing()
        # judged at the arrival of the utterance's start, not now: hearing may lag behind
        # (a loaded machine), and the echo of a reply's last words must still count as echo
        if playing is not None or self.echo.active(self._inbound.arrival(event.position)):
            self._echo_utterance = True  # until its level says otherwise (_check_echo)
            await self._check_echo(playing)
            if self._echo_utterance and self._listener is not None:
                self._listener.ignore()  # transcribed from where the caller's voice rises, if it does
            return
        await self._stop_reply()  # still thinking, nothing heard yet: the caller goes on
        self._times = TurnTimes()
        self._begin_user_turn(event.position)

    def _begin_user_turn(self, position: int) -> None:
        self._user_item = f"item_{next(self._items)}"
        self.machine.to(State.USER_SPEAKING)
        self._emit(ev.SPEECH_STARTED, item_id=self._user_item, audio_start_ms=position // 16)

    async def _check_echo(self, reply: Reply | None) -> None:
        """Speech over the reply: echo, or the caller? Re-checked as the utterance goes on,
        so a caller whose first syllable was quiet still gets through, and after the reply
        has ended, so a caller who speaks while its echo fades is heard."""
        assert self._listener is not None
        recent = max(self._utterance_start, self._listener.position - ECHO_CHECK_SAMPLES)
        onset = self._inbound.first_above_echo(recent)
        over = policy.speech_over_reply(onset is not None, reply is not None, self.config.barge_in)
        if onset is None or over is policy.Over.ECHO:
            return
        caller_start = onset - ECHO_PREROLL
        if caller_start > self._utterance_start:  # the VAD's utterance began with echo
            late_ms = (caller_start - self._utterance_start) // 16
            log.debug("session %s: the caller's voice rose over the echo %d ms in", self.id, late_ms)
            self._utterance_start = caller_start
            self._listener.restart(caller_start)
        elif self._listener.ignoring:  # its start was taken for echo, and not transcribed
            self._listener.restart(self._utterance_start - self._listener.preroll)
        self._echo_utterance = False
        if reply is None or over is policy.Over.TURN:
            # no reply playing (it ended, or is still being thought), or one the caller
            # may not cut: a new turn, answered when the reply has played
            if reply is None:
                await self._stop_reply()
            self._times = TurnTimes()
            self._begin_user_turn(self._utterance_start)
            return
        reply.pause()  # nothing more leaves from here on
        self.sink.flush()
        quick, reply.quick_paused = reply.quick_paused, None
        stopped = quick or time.monotonic()
        if quick is None:  # else the quick pause recorded it
            self.pauses.append(stopped)
        metrics.BARGE_IN_STOP.observe(max(0.0, stopped - self._inbound.arrival(onset)))
        self._interruption = Interruption(self._utterance_start)
        self._times = TurnTimes()
        self.machine.to(State.INTERRUPTED)

    def _prefill(self, words: str) -> None:
        """Feed the caller's committed words to the LLM in the background (never blocks
        hearing); calls that pile up coalesce in `Conversation.prefill`."""

        async def run() -> None:
            try:
                await self.conversation.prefill(words)
            except LlmUnavailable:  # said once, by the turn's reply, not at every word
                log.debug("session %s: no prefill while the LLM is out", self.id)
            except LlmError as e:
                self.send_error(llm_failure(e))

        self._own(asyncio.create_task(run(), name=f"{self.id}-prefill"))

    def _own(self, task: asyncio.Task[None]) -> None:
        """A background task of the session: kept until done, cancelled by `close`."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _check_interruption(self) -> None:
        """Judge a tentative interruption as soon as its words say it is one: the words
        ASR committed while the caller speaks, all of them once a pause has them (under
        load, a short line has none committed by then); a barge-in in a pause prepares
        the turn there, as any pause does."""
        reply = self._reply
        if self._echo_utterance and self._listener and self._listener.speaking:
            await self._check_echo(self._playing())
        pending = self._interruption
        if pending is None or reply is None:
            return
        heard = self._words_in_pause()
        if heard is not None:  # all of them, not only those two partial passes agreed on
            pending.words = heard[1]
        if await self._judge(pending, reply, ended=False) and heard is not None:
            prepare = self._prepare(*heard, self._times)
            self._own(asyncio.create_task(prepare, name=f"{self.id}-paused"))

    async def _judge(self, pending: Interruption, reply: Reply | None, ended: bool) -> bool:
        """Act on the verdict on an interruption's words (`turn_policy.judge_interruption`):
        True if it was a barge-in."""
        resume = self.config.resume_false_interruptions
        verdict = policy.judge_interruption(pending.words, _said_lately(reply), ended, resume)
        if verdict is not policy.Verdict.WAIT:
            words, end = pending.words, "ended" if ended else "so far"
            log.debug("session %s: interruption %r (%s): %s", self.id, words, end, verdict.value)
        if verdict is policy.Verdict.BARGE_IN:
            await self._barge_in(pending)
        elif verdict is not policy.Verdict.WAIT:  # a backchannel, no words, or the reply's echo
            if verdict is policy.Verdict.ECHO:
                self._echo_heard(pending.words)
            self._interruption = None
            self._resume()
            self._echo_utterance = verdict is policy.Verdict.ECHO and not ended  # the rest of it too
        return verdict is policy.Verdict.BARGE_IN

    def _echo_heard(self, words: str) -> None:
        log.info("session %s: %r over the reply was its echo", self.id, words)
        metrics.ECHOES_HEARD.inc()

    async def _barge_in(self, pending: Interruption) -> None:
        assert self._reply is not None
        self._interruption = None
        self.barge_ins += 1
        metrics.BARGE_INS.inc()
        self._begin_user_turn(pending.position)
        await self._cut(self._reply)
        if pending.words:
            self._emit(ev.TRANSCRIPT_DELTA, item_id=self._user_item, delta=pending.words)
        if pending.stopped is not None:  # judged only at its end (words came late): it ended
            self._emit(ev.SPEECH_STOPPED, item_id=self._user_item, audio_end_ms=pending.stopped // 16)

    async def _final(self, text: str, event: ListenEvent) -> None:
        held = self._reply
        if held is not None and held.held:
            if text and text == held.user_text and not held.stopped:
                self._transcript_done(text, event)
                self.machine.to(State.RESPONDING)
                held.release()  # the turn ended with the words it answers
                return
            await self._drop(held)
        self._times.final = event.at
        pending = self._interruption
        if pending is not None:
            pending.words = text
            if not await self._judge(pending, self._reply, ended=True):
                return  # the reply goes on
        over = self._reply if not self.config.barge_in else None  # the reply it came over
        turn = policy.finished_turn(text, _said_lately(over), self.config.answer_turns)
        if turn is policy.Turn.ECHO:
            self._echo_heard(text)
            text = ""  # the reply's echo, taken for the caller: no turn
        self._transcript_done(text, event)
        if turn in (policy.Turn.HOLD, policy.Turn.AFTER_REPLY):
            self._unanswered.append(text)
            while sum(len(t) + 1 for t in self._unanswered) > MAX_USER_CHARS and len(self._unanswered) > 1:
                self._unanswered.pop(0)  # answered as one turn, which has room for the newest
            self._after_reply = self._after_reply or turn is policy.Turn.AFTER_REPLY
        elif turn is policy.Turn.ANSWER:
            await self._answer(text, self._times)
            return
        self.machine.to(State.RESPONDING if self._reply is not None else State.LISTENING)

    def _transcript_done(self, text: str, event: ListenEvent) -> None:
        usage = {"type": "duration", "seconds": self._heard_s(event)}
        if not self.config.word_times or event.result is None:
            self._emit(ev.TRANSCRIPT_DONE, item_id=self._user_item, transcript=text, usage=usage)
        else:
            words = word_times_ms(event.result.committed)
            self._emit(ev.TRANSCRIPT_DONE, item_id=self._user_item, transcript=text, usage=usage, words=words)

    def _heard_s(self, event: ListenEvent) -> float:
        """Seconds of audio the final pass transcribed: from the utterance's start (less
        the listener's preroll) to the end of what it saw."""
        assert self._listener is not None
        end = event.result.audio_end if event.result is not None else event.position
        start = max(0, self._utterance_start - self._listener.preroll)
        return round(max(0, end - start) / RUNTIME_RATE, 3)

    def _resume(self) -> None:
        reply = self._reply
        if reply is None:
            self.machine.to(State.LISTENING)
            return
        self.resumes += 1
        metrics.RESUMES.inc()
        reply.resume()
        self.machine.to(State.RESPONDING)
        self._emit(ev.RESUMED, response_id=reply.id)

    # -- speaking --

    def _quick_onsets(self, on: bool) -> None:
        """While the reply plays, the VAD confirms speech sooner: a barge-in must stop it
        fast, and a false start costs only a pause (the reply resumes)."""
        assert self._listener is not None
        vad = self._listener.vad
        ms = self.config.barge_in_min_speech_ms if on else self._vad_config.min_speech_ms
        vad.config = replace(vad.config, min_speech_ms=ms)

    def _playing(self) -> Reply | None:
        """The reply whose audio has begun to go out (not one merely being thought)."""
        reply = self._reply
        return reply if reply is not None and reply.times.first_sent is not None else None

    async def _answer(self, text: str, times: TurnTimes) -> None:
        """Reply to a user turn, and to the turns before it not answered yet. A reply
        still in progress ends first (cut as heard): text input and speech come from
        different tasks, and either may have begun one while the other waited."""
        while self._reply is not None:
            await self._stop_reply()
        text = "\n".join([*self._unanswered, text]).strip()
        self._unanswered.clear()
        self._after_reply = False
        self._respond(text, times)

    def _respond(self, text: str, times: TurnTimes, held: bool = False) -> None:
        assert self._reply is None, "a reply is already in progress"
        n = next(self._items)
        tts = self.engines.tts.stream()
        reply = Reply(f"resp_{n}", f"item_{n}", text, times, tts, self._out, self, held)
        self._reply = reply
        self.ledger.start_turn(reply.id)
        if not held:
            self.machine.to(State.RESPONDING)
        reply.emit(ev.RESPONSE_CREATED)
        reply.start(self.conversation.reply(text, reply.id), self.conversation.abort)

    def _paused(self) -> None:
        """The caller paused: their words so far are transcribed at once (the pass that
        will be the final if the turn ends here). Over a reply whose interruption is still
        being judged, those words judge it (`_check_interruption`); else `_prepare` acts on
        them."""
        assert self._listener is not None
        listener, times, pause = self._listener, self._times, self._listener.vad.pause
        if pause is None:
            return
        times.end_of_turn_score = times.scored = None  # an earlier pause's, which the caller talked through

        async def run() -> None:
            text = await listener.asr.speculative()
            times.final = time.monotonic()
            if not text or listener.vad.pause != pause:
                return  # nothing heard, or the caller went on
            self._pause_words = (pause, text.strip())
            if self._interruption is None:
                await self._prepare(*self._pause_words, times)

        self._own(asyncio.create_task(run(), name=f"{self.id}-paused"))

    def _words_in_pause(self) -> tuple[int, str] | None:
        """The pause the caller is in and all the words of the utterance before it, once
        its speculative final has them; None before, or outside a pause."""
        listener, heard = self._listener, self._pause_words
        if listener is None or heard is None or not listener.paused or listener.vad.pause != heard[0]:
            return None
        return heard

    async def _prepare(self, pause: int, text: str, times: TurnTimes) -> None:
        """In a pause after ``text``: the LLM says how likely the turn is over after them
        (`_turn_over` acts on it), and the reply to them begins, silently
        (held), to be released if the turn ends with these words.

        A judgement that would come only after the silence has ended the turn anyway
        (the ASR's final came late in the pause: a slow machine, or a loaded one) is
        not asked for, and the reply begins at once: it would have waited for nothing.
        """
        assert self._listener is not None
        c, listener = self.config, self._listener
        interrupting, replying = self._interruption is not None, self._reply is not None
        speculate = policy.should_speculate(c.speculative_replies, c.answer_turns, interrupting, replying)
        judge = c.end_of_turn_by_meaning and not interrupting and not replying
        if judge and not policy.judgement_in_time(listener.silence_ms, self._judging_ms, c.end_of_turn_ms):
            judge = False
            self._judging_ms = policy.judging_ms(self._judging_ms, None, c.end_of_turn_ms)
            log.debug("session %s: this pause is judged by silence alone (its final came late)", self.id)
        if judge:
            asked = time.monotonic()
            p = await self._turn_score(text)
            took_ms = (time.monotonic() - asked) * 1000
            self._judging_ms = policy.judging_ms(self._judging_ms, took_ms, c.end_of_turn_ms)
            if p is not None and listener.vad.pause == pause:
                self._score, times.end_of_turn_score = (pause, p), p
                times.scored = time.monotonic()
                if (needed := c.silence_to_end(p)) > listener.vad.config.min_silence_ms:
                    listener.vad.hold_pause(pause, needed)  # unfinished words: the VAD waits longer
        if speculate and self._reply is None and listener.paused and listener.vad.pause == pause:
            self._respond(text, times, held=True)

    async def _turn_score(self, words: str) -> float | None:
        try:
            return await self.conversation.end_of_turn("\n".join([*self._unanswered, words]))
        except LlmError:  # the LLM is out: silence alone ends the turn
            return None

    def _turn_over(self) -> bool:
        """In a pause long enough to end the caller's turn sooner than the VAD will, by
        the rules for the words before it (`SessionConfig.silence_to_end`: words judged
        a finished turn)? Words over a reply, or its echo, and words not judged yet wait
        for the VAD (``end_of_turn_ms``; longer after unfinished words, `_prepare`)."""
        listener, score = self._listener, self._score
        if listener is None or score is None or not listener.paused or listener.vad.pause != score[0]:
            return False
        if self._interruption is not None or self._echo_utterance:
            return False
        needed = self.config.silence_to_end(score[1])
        return needed < listener.vad.config.min_silence_ms and listener.silence_ms >= needed

    async def _stop_reply(self) -> None:
        """Whatever reply is in progress ends: cut if it was heard, dropped if held back."""
        reply = self._reply
        if reply is not None and reply.held:
            await self._drop(reply)
        elif reply is not None:
            await self._cut(reply)

    async def _drop(self, reply: Reply) -> None:
        """The caller went on: the held reply goes, leaving no trace in the conversation."""
        await reply.stop()
        self.conversation.retract(reply.id)
        if self._reply is reply:
            self._reply = None
            reply.end(None)

    async def _cut(self, reply: Reply) -> None:
        """Barge-in or cancel: stop everything of the reply, keep what was heard."""
        await reply.stop(cut=True)
        self._finish(reply, "cancelled")
        self.ledger.discard_unsent(reply.id)
        heard = self.ledger.heard_text(reply.id)
        self.conversation.truncate(reply.id, heard)
        end_ms = self.ledger.audio_end_ms(reply.id)
        self._emit(
            ev.TRUNCATED, item_id=reply.item_id, content_index=0, audio_end_ms=end_ms, transcript=heard
        )

    def _finish(self, reply: Reply, status: str) -> None:
        """The reply ended (played out, or stopped): tell the client, listen again."""
        if self._reply is not reply:
            return
        self._reply = None
        self._quick_onsets(False)
        reply.end(status)
        if self.state is State.RESPONDING:
            self.machine.to(State.LISTENING)

    # -- what its replies need (`ReplyHost`) --

    def began(self, reply: Reply) -> None:
        self._quick_onsets(True)
        stats = self.conversation.last  # this reply's prompt (its first token came before its audio)
        self._unreported = (reply, reply.times.breakdown_ms(), stats)
        if stats.settled or reply.words_ended:
            self._report(reply)

    def words_ended(self, reply: Reply) -> None:
        self._report(reply)

    def _report(self, reply: Reply) -> None:
        """The reply's metrics, once its first audio left and its prompt's figures are
        the LLM's own (a remote LLM says what its cache held with the request's last
        words; a reply stopped before them reports the estimate `TurnStats` kept)."""
        if self._unreported is None or self._unreported[0] is not reply:
            return
        _, breakdown, stats = self._unreported
        self._unreported = None
        tokens: dict[str, float] = {"prompt_tokens": stats.prompt_tokens}
        tokens["cached_tokens"] = stats.cached_tokens
        if reply.times.end_of_turn_score is not None:
            tokens["end_of_turn_score"] = round(reply.times.end_of_turn_score, 4)
        metrics.observe_turn(breakdown, stats.prompt_tokens, stats.cached_tokens)
        log.info("session %s: %s began", self.id, reply.id, extra={"fields": breakdown | tokens})
        self._emit(ev.METRICS, response_id=reply.id, **breakdown, **tokens)

    async def played_out(self, reply: Reply) -> None:
        if self._reply is reply and reply.error is not None:  # failed: keep what was heard
            self.ledger.discard_unsent(reply.id)
            self.conversation.truncate(reply.id, self.ledger.heard_text(reply.id))
            self._finish(reply, "failed")
        elif self._reply is reply:
            self._finish(reply, "completed")
            if self._after_reply and self._unanswered and self.state is State.LISTENING:
                await self._answer("", TurnTimes(final=time.monotonic()))  # words heard over it

    # -- output to the transport --

    def _emit(self, type_: str, **data: object) -> None:
        self.sink.event(Event(type_, dict(data)))

    def _on_state(self, old: State, new: State) -> None:
        self._emit(ev.STATE, state=new.value, previous=old.value)


def _said_lately(reply: Reply | None) -> str | None:
    """What the reply's echo would say now (None: there is no reply)."""
    return reply.said_lately(ECHO_TEXT_S) if reply is not None else None
