"""`Session`: one conversation, transport-agnostic.

A transport hands the session inbound `AudioFrame`s and control calls, and gives it a
`Sink` for what goes out: audio frames (20 ms, at the voice's rate), events, and a
`flush` that tells the transport to drop the audio it still buffers (barge-in).

    push_audio ─► inbound queue ─► _listen: resample, Listener (VAD + ASR) ─► turn-taking
                                                                                 │
    Sink.audio ◄─ _send ◄─ Pacer ◄─ _synthesize (TTS) ◄─ _generate (LLM) ◄─ Response

Turn-taking (all decided in `_listen`, one place):

- the caller's committed words are prefilled into the LLM's KV while they speak;
- the end of the turn is the VAD's silence (``end_of_turn_ms``) with words from ASR;
- speech that starts while the assistant talks is first checked against the echo of
  what was sent (`EchoGate`): echo is ignored, utterance and all;
- otherwise outbound audio is paused at once (`Pacer.pause`, `Sink.flush`): the
  interruption is *tentative*. (Sooner still: a frame louder than the reply's echo and
  the room could be pauses the reply before the VAD has decided, ~100 ms earlier; if
  the VAD hears no caller within ``QUICK_PAUSE_CONFIRM_S``, the reply goes on.)
  A word other than a backchannel ("uh-huh", "okay", "right") makes it a barge-in:
  the reply's LLM and TTS work is cancelled, the reply is cut to the words the caller
  heard (playout ledger and TTS word marks), in the conversation and in its KV, and
  the utterance becomes the next user turn. An utterance that ends without such a
  word (a cough, a "mm-hmm") resumes the reply where it paused (false-interruption
  resume).

Every task has an owner: the session owns `_listen` and the current `Response`, a
`Response` owns its three tasks; `close` cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from audio_io.frame import AudioFrame
from audio_io.ledger import PlayoutLedger, TextMark
from audio_io.pacer import Pacer
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import Resampler, downmix
from duplex import events as ev
from duplex import metrics
from duplex.echo import EchoGate, band_levels_db, level_db
from duplex.engines import Engines
from duplex.events import Event, SessionError
from duplex.state import State, StateMachine
from duplex.turn import Interruption, Response, TurnTimes, is_backchannel, is_echo_of
from models.conversation import Conversation, check_user_text
from models.listen import Listener, ListenEvent, ListenEventKind
from models.llm import LlmError
from models.tts import WordMark
from models.vad import VadConfig

log = logging.getLogger("duplex.session")

ECHO_CHECK_SAMPLES = RUNTIME_RATE // 2  # speech over the reply is judged on its last 0.5 s
LEVEL_WINDOW = RUNTIME_RATE // 50  # levels are compared over 20 ms
ECHO_PREROLL = RUNTIME_RATE // 10  # ASR starts this far before the caller's voice rose over the echo
ECHO_TEXT_S = 4.0  # words heard over the reply are compared with its last 4 s (`is_echo_of`)
QUICK_PAUSE_FLOOR_DB = -50.0  # a quieter frame never pauses the reply before the VAD decides
QUICK_PAUSE_OVER_ROOM_DB = 15.0  # ... nor one less this much above the quietest of the last 2 s
QUICK_PAUSE_CONFIRM_S = 0.25  # the VAD must confirm the caller's voice this soon, or the reply goes on
QUICK_PAUSE_HOLDOFF_S = 1.0  # after a false alarm, only the VAD pauses the reply for this long
MAX_SYSTEM_PROMPT = 8000  # characters


class Sink(Protocol):
    """What a transport gives the session for its output; calls must not block."""

    def audio(self, frame: AudioFrame, response_id: str) -> None: ...

    def event(self, event: Event) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class SessionConfig:
    input_rate: int = RUNTIME_RATE
    input_channels: int = 1
    system_prompt: str | None = None
    end_of_turn_ms: int = 500  # VAD silence that ends the caller's turn (duplex bench endpoint)
    resume_false_interruptions: bool = True  # speech over the reply with no words resumes it
    echo_suppression_db: float = 12.0
    speculative_replies: bool = True  # begin the reply, silently, at a pause in the caller's voice
    barge_in_min_speech_ms: int = 64  # while the reply plays, speech starts sooner (96 otherwise)
    max_inbound_s: float = 10.0  # audio waiting to be heard; more is dropped, with an error
    playback_acks: bool = False  # the transport reports playback; else sent counts as played
    # pause the reply on a loud frame before the VAD decides: off by default until it is
    # shown not to pause replies on their own echo (a CI run saw it do so once)
    quick_pause: bool = False
    word_times: bool = False  # final transcripts carry word times (~25-65 ms more per turn)
    answer_turns: bool = True  # each finished user turn is answered; false: held for `respond`
    barge_in: bool = True  # the caller's speech cuts the reply; false: it is the next turn
    vad_threshold: float = 0.5  # speech probability that counts as speech
    speech_prefix_ms: int = 30  # audio before the detected start that belongs to the utterance

    # settings a client may change while the session runs (`Session.configure`)
    RUNTIME_KEYS: ClassVar[tuple[str, ...]] = (
        "end_of_turn_ms",
        "resume_false_interruptions",
        "speculative_replies",
        "barge_in_min_speech_ms",
        "echo_suppression_db",
        "word_times",
        "answer_turns",
        "barge_in",
        "vad_threshold",
        "speech_prefix_ms",
    )

    def __post_init__(self) -> None:
        if self.input_rate not in (8000, 16000, 24000, 32000, 44100, 48000):
            raise SessionError("bad_audio_format", f"unsupported input rate {self.input_rate} Hz")
        if self.input_channels not in (1, 2):
            raise SessionError("bad_audio_format", f"unsupported channel count {self.input_channels}")
        if self.system_prompt is not None and (
            not isinstance(self.system_prompt, str) or len(self.system_prompt) > MAX_SYSTEM_PROMPT
        ):
            raise SessionError(
                "bad_config", f"system_prompt must be a string of at most {MAX_SYSTEM_PROMPT} chars"
            )
        for key, low, high in (
            ("end_of_turn_ms", 200, 5000),
            ("barge_in_min_speech_ms", 20, 1000),
            ("speech_prefix_ms", 0, 2000),
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise SessionError("bad_config", f"{key} must be a whole number from {low} to {high}")
        if not isinstance(self.echo_suppression_db, int | float) or not 0 <= self.echo_suppression_db <= 40:
            raise SessionError("bad_config", "echo_suppression_db must be a number from 0 to 40")
        threshold = self.vad_threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not 0.2 <= threshold <= 0.95
        ):
            raise SessionError("bad_config", "vad_threshold must be a number from 0.2 to 0.95")
        for key in (
            "resume_false_interruptions",
            "speculative_replies",
            "playback_acks",
            "quick_pause",
            "word_times",
            "answer_turns",
            "barge_in",
        ):
            if not isinstance(getattr(self, key), bool):
                raise SessionError("bad_config", f"{key} must be true or false")


class Session:
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
        self._vad_config = self._vad_settings(VadConfig())
        self._listener: Listener | None = None
        self._resampler = Resampler(self.config.input_rate, RUNTIME_RATE)
        self._inbound: asyncio.Queue[tuple[AudioFrame, float]] = asyncio.Queue()  # with arrival time
        self._inbound_s = 0.0
        self._listen_task: asyncio.Task[None] | None = None
        self._response: Response | None = None
        self._interruption: Interruption | None = None
        self._echo_utterance = False  # the utterance in progress is the assistant's echo
        self._utterance_start = 0  # stream position of the caller's speech start
        self._arrivals: list[tuple[int, float]] = []  # (16 kHz stream end position, arrival time)
        self._levels: collections.deque[float] = collections.deque(maxlen=100)  # inbound dB, 20 ms each
        self._quick_holdoff = 0.0
        self._items = itertools.count()
        self._times = TurnTimes()
        self._user_item = "item_none"
        self._unanswered: list[str] = []  # user turns not answered yet (`respond`)
        self._after_reply = False  # ... to be answered once the reply playing ends
        self._background: set[asyncio.Task[None]] = set()  # prefills and speculations
        self._input_errors: set[str] = set()
        self.barge_ins = 0
        self.resumes = 0
        self.false_alarms = 0  # quick pauses the VAD did not confirm
        self.last_input = time.monotonic()  # when the transport last sent anything
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
        if self._response is not None:
            await self._stop_work(self._response)
            await self._finish(self._response, "cancelled")
        tasks = [*self._background] + ([self._listen_task] if self._listen_task else [])
        for task in tasks:
            task.cancel()
        await _gather_cancelled(tasks)
        if self._listener is not None:
            self._listener.close()
        self.conversation.close()

    # -- input from the transport --

    def push_audio(self, frame: AudioFrame) -> None:
        """Inbound audio; bad audio is an ``error`` event, and the session goes on."""
        if self.state is State.CLOSED:
            return
        self.last_input = time.monotonic()
        if frame.sample_rate != self.config.input_rate or frame.channels != self.config.input_channels:
            self._error_once(
                SessionError(
                    "bad_audio_format",
                    f"audio at {frame.sample_rate} Hz x{frame.channels}, the session takes "
                    f"{self.config.input_rate} Hz x{self.config.input_channels}",
                )
            )
            return
        if self._inbound_s + frame.duration > self.config.max_inbound_s:
            self._error_once(SessionError("input_overflow", "audio arrives faster than real time; dropped"))
            return
        self._input_errors.clear()  # a good frame: the next bad one is reported again
        self._inbound_s += frame.duration
        self._inbound.put_nowait((frame, time.monotonic()))

    async def push_text(self, text: str) -> None:
        """A user turn as text (instead of speech): the reply in progress, if any, ends."""
        self.last_input = time.monotonic()
        try:
            text = check_user_text(text)
        except LlmError as e:
            self.send_error(SessionError("bad_text", str(e)))
            return
        await self._answer(text, TurnTimes(final=time.monotonic()))

    def add_turn(self, text: str) -> None:
        """A user turn (a Realtime text item, a committed audio buffer) that waits for
        `respond`; a bad one is a `SessionError`."""
        self.last_input = time.monotonic()
        try:
            self._unanswered.append(check_user_text(text))
        except LlmError as e:
            raise SessionError("bad_text", str(e)) from None

    async def respond(self) -> None:
        """Answer the user turns not answered yet: those of `add_turn`, and those heard
        while ``answer_turns`` is off. A reply in progress ends first (cut as heard)."""
        self.last_input = time.monotonic()
        if not self._unanswered:
            raise SessionError("no_input", "there is no new user input to respond to")
        await self._answer("", TurnTimes(final=time.monotonic()))

    def dtmf(self, digit: str) -> None:
        """The caller pressed a key on the phone: told to the client as an event."""
        self.last_input = time.monotonic()
        self._emit(ev.DTMF, digit=digit)

    async def cancel(self) -> None:
        """The client cancels the reply in progress (kept as far as it was heard)."""
        self.last_input = time.monotonic()
        if self._response is not None:
            await self._end_response()
            self.machine.to(State.LISTENING)

    async def _end_response(self) -> None:
        """Whatever reply is in progress ends: cut if it was heard, dropped if held back."""
        response = self._response
        if response is not None and response.held:
            await self._drop(response)
        elif response is not None:
            await self._cut(response)

    async def truncate(self, response_id: str, audio_end_ms: int) -> int:
        """The client played only ``audio_end_ms`` of this reply: it stops here if still
        going, and it is kept, in the history and the KV, as far as that was heard
        (when it is the conversation's last reply). Clamped to the audio sent (clients
        race here); returns the milliseconds kept."""
        self.last_input = time.monotonic()
        if response_id not in self.ledger.turns:
            raise SessionError("unknown_item", f"no reply {response_id!r} in this session")
        if self._response is not None and self._response.id == response_id:
            await self._end_response()
            self.machine.to(State.LISTENING)
        rate = self.ledger.sample_rate
        kept = self.ledger.truncate(response_id, max(0, audio_end_ms) * rate // 1000)
        heard = self.ledger.heard_text(response_id)
        self.conversation.truncate(response_id, heard)
        return kept * 1000 // rate

    def configure(self, changes: dict[str, object]) -> None:
        """Change turn-taking settings while the session runs (`SessionConfig.RUNTIME_KEYS`);
        a bad key or value is a `SessionError`, and nothing changes."""
        unknown = sorted(set(changes) - set(SessionConfig.RUNTIME_KEYS))
        if unknown:
            raise SessionError(
                "bad_config", f"cannot change {unknown} (can: {list(SessionConfig.RUNTIME_KEYS)})"
            )
        self.config = replace(self.config, **changes)  # type: ignore[arg-type]
        self.echo.configure(self.config.echo_suppression_db)
        self._vad_config = self._vad_settings(self._vad_config)
        if self._listener is not None:
            vad = self._listener.vad
            vad.config = self._vad_settings(vad.config)
            self._quick_onsets(self._playing() is not None)
            self._listener.asr.word_times = self.config.word_times

    def _vad_settings(self, vad: VadConfig) -> VadConfig:
        c = self.config
        return replace(
            vad, min_silence_ms=c.end_of_turn_ms, threshold=c.vad_threshold, prefix_pad_ms=c.speech_prefix_ms
        )

    def playback(self, stream_position: int) -> None:
        """The transport played the output stream up to this many samples."""
        self.last_input = time.monotonic()
        self.ledger.record_played(stream_position)

    # -- hearing --

    async def _listen(self) -> None:
        assert self._listener is not None
        while True:
            # arrival times are taken when the transport hands a frame over, not when it
            # is processed here: echo checks and latencies must not drift when this lags
            frame, arrived = await self._inbound.get()
            self._inbound_s = max(0.0, self._inbound_s - frame.duration)
            samples = self._resampler.process(downmix(frame.samples, frame.channels))
            self._arrivals.append((self._listener.position + samples.size, arrived))
            del self._arrivals[: max(0, len(self._arrivals) - 200)]
            self._quick_pause(samples, arrived - ECHO_CHECK_SAMPLES / RUNTIME_RATE)
            self._train_echo(samples, arrived)
            try:
                for event in await self._listener.push(samples):
                    await self._on_listen(event)
                await self._check_interruption()
                held = self._response
                if held is not None and held.held and self._listener.speaking and not self._listener.paused:
                    await self._drop(held)  # the caller went on after the pause
            except LlmError as e:  # this session's turn could not be served; the session goes on
                self.send_error(SessionError("llm_error", str(e)))
            except Exception:  # a bug: this session reports it, every other one carries on
                log.exception("session %s: listening failed", self.id)
                self.send_error(SessionError("internal_error", "the server failed to process this audio"))

    def _train_echo(self, samples: npt.NDArray[np.int16], arrived: float) -> None:
        """Inbound audio at the start of a reply is its echo, measured (`EchoGate.train`)."""
        n = samples.size // LEVEL_WINDOW
        if n and self.echo.measuring(arrived):
            windows = samples[: n * LEVEL_WINDOW].reshape(n, LEVEL_WINDOW)
            self.echo.train(band_levels_db(windows, RUNTIME_RATE), arrived)

    def _quick_pause(self, samples: npt.NDArray[np.int16], since: float) -> None:
        """While the reply plays, a frame louder than its echo and the room could be is
        most likely the caller starting to speak: pause the reply now, ~100 ms before the
        VAD can tell (`_check_echo` then confirms it as an interruption). A sound the VAD
        does not take for the caller within `QUICK_PAUSE_CONFIRM_S` was a false alarm:
        the reply goes on, and for a while only the VAD may pause it."""
        if not (self.config.quick_pause and self.config.barge_in):
            return
        level = level_db(samples)
        self._levels.append(level)
        now = time.monotonic()
        response = self._playing()
        if response is None or self._interruption is not None:
            return
        if response.quick_paused is not None:
            if now - response.quick_paused > QUICK_PAUSE_CONFIRM_S:
                response.quick_paused = None
                self.false_alarms += 1
                metrics.FALSE_ALARMS.inc()
                self._quick_holdoff = now + QUICK_PAUSE_HOLDOFF_S
                response.pacer.resume()
            return
        if response.pacer.paused or now < self._quick_holdoff:
            return
        room = min(self._levels) + QUICK_PAUSE_OVER_ROOM_DB
        if level < max(room, QUICK_PAUSE_FLOOR_DB):
            return
        if not self.echo.is_echo(band_levels_db(samples, RUNTIME_RATE), since, now):
            response.pacer.pause()
            response.quick_paused = now

    def _arrival(self, position: int) -> float:
        """When the audio at this 16 kHz stream position arrived."""
        i = bisect.bisect_left(self._arrivals, position, key=lambda arrival: arrival[0])
        return self._arrivals[i][1] if i < len(self._arrivals) else time.monotonic()

    async def _on_listen(self, event: ListenEvent) -> None:
        kind = event.kind
        if kind is ListenEventKind.SPEECH_STARTED:
            await self._speech_started(event)
        elif self._echo_utterance:
            if kind is ListenEventKind.FINAL:
                self._echo_utterance = False
        elif kind is ListenEventKind.PARTIAL:
            assert event.result is not None
            if self._interruption is not None:
                # judged on words ASR has committed (seen alike by two passes): a partial
                # of a short sound is where Whisper hallucinates ("You", "Thank you.")
                self._interruption.words = " ".join(w.text for w in event.result.committed)
            else:
                self._emit(ev.TRANSCRIPT_DELTA, item_id=self._user_item, delta=event.result.text)
                committed = " ".join(w.text for w in event.result.committed)
                if committed and self._response is None:
                    self._prefill("\n".join([*self._unanswered, committed]))
        elif kind is ListenEventKind.PAUSED:
            c = self.config
            if (
                c.speculative_replies
                and c.answer_turns
                and self._interruption is None
                and self._response is None
            ):
                self._speculate()
        elif kind is ListenEventKind.SPEECH_STOPPED:
            self._times.speech_end = self._arrival(event.position)
            self._times.stopped = event.at
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
        if playing is not None or self.echo.active(self._arrival(event.position)):
            self._echo_utterance = True  # until its level says otherwise (_check_echo)
            await self._check_echo(playing)
            return
        await self._end_response()  # still thinking, nothing heard yet: the caller goes on
        self._times = TurnTimes()
        self._begin_user_turn(event.position)

    def _begin_user_turn(self, position: int) -> None:
        self._user_item = f"item_{next(self._items)}"
        self.machine.to(State.USER_SPEAKING)
        self._emit(ev.SPEECH_STARTED, item_id=self._user_item, audio_start_ms=position // 16)

    async def _check_echo(self, response: Response | None) -> None:
        """Speech over the reply: echo, or the caller? Re-checked as the utterance goes on,
        so a caller whose first syllable was quiet still gets through, and after the reply
        has ended, so a caller who speaks while its echo fades is heard."""
        assert self._listener is not None
        recent = max(self._utterance_start, self._listener.position - ECHO_CHECK_SAMPLES)
        onset = self._first_above_echo(recent)
        if onset is None:
            return
        caller_start = onset - ECHO_PREROLL
        if caller_start > self._utterance_start:  # the VAD's utterance began with echo
            self._utterance_start = caller_start
            self._listener.restart(caller_start)
        self._echo_utterance = False
        if response is None or not self.config.barge_in:
            # no reply playing (it ended, or is still being thought), or one the caller
            # cannot cut: a new turn, answered when the reply has played
            if response is None:
                await self._end_response()
            self._times = TurnTimes()
            self._begin_user_turn(self._utterance_start)
            return
        response.pacer.pause()  # nothing more leaves from here on
        self.sink.flush()
        stopped, response.quick_paused = response.quick_paused or time.monotonic(), None
        metrics.BARGE_IN_STOP.observe(max(0.0, stopped - self._arrival(onset)))
        self._interruption = Interruption(self._utterance_start)
        self._times = TurnTimes()
        self.machine.to(State.INTERRUPTED)

    def _first_above_echo(self, start: int) -> int | None:
        """The stream position of the first 20 ms from ``start`` on that is louder, in
        either band, than the reply's echo could be: than the loudest audio sent from
        0.4 s before ``start`` until now, less the suppression (the test the quick pause
        makes on each frame). A reference per 20 ms window (0.4 s before its own
        arrival), tried, let the reply's echo interrupt it: 10 false interruptions in 16
        barge-ins with echo. None if all of it may be echo."""
        assert self._listener is not None
        audio = self._listener.history_since(start)
        n = audio.size // LEVEL_WINDOW
        if n == 0:
            return None
        windows = band_levels_db(audio[: n * LEVEL_WINDOW].reshape(n, LEVEL_WINDOW), RUNTIME_RATE)
        callers = np.flatnonzero(self.echo.callers(windows, self._arrival(start), time.monotonic()))
        return start + int(callers[0]) * LEVEL_WINDOW if callers.size else None

    def _prefill(self, words: str) -> None:
        """Feed the caller's committed words to the LLM in the background (never blocks
        hearing); calls that pile up coalesce in `Conversation.prefill`."""

        async def run() -> None:
            try:
                await self.conversation.prefill(words)
            except LlmError as e:
                self.send_error(SessionError("llm_error", str(e)))

        self._own(asyncio.create_task(run(), name=f"{self.id}-prefill"))

    def _own(self, task: asyncio.Task[None]) -> None:
        """A background task of the session: kept until done, cancelled by `close`."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _check_interruption(self) -> None:
        """Judge a tentative interruption as soon as its words say it is one."""
        response = self._response
        if self._echo_utterance and self._listener and self._listener.speaking:
            await self._check_echo(self._playing())
        pending = self._interruption
        if pending is not None and response is not None and not is_backchannel(pending.words):
            if self._resume_if_echo(pending, response):
                self._echo_utterance = True  # the rest of this utterance too
            else:
                await self._barge_in(pending)

    def _resume_if_echo(self, pending: Interruption, response: Response) -> bool:
        """If the words of this interruption are the reply's own, come back over the line,
        the reply resumes (True): the gate let a loud echo through."""
        if not self._echoes(pending.words, response):
            return False
        self._interruption = None
        self._resume()
        return True

    def _echoes(self, words: str, response: Response) -> bool:
        """Are these words, heard over the reply, its own last ones come back?"""
        turn = self.ledger.turn(response.id)
        back = int(ECHO_TEXT_S * self.ledger.sample_rate)
        earlier = turn.heard_text(max(0, turn.sent - back))
        if not is_echo_of(words, turn.heard_text(turn.sent)[len(earlier) :]):
            return False
        log.info("session %s: %r over the reply was its echo", self.id, words)
        metrics.ECHOES_HEARD.inc()
        return True

    async def _barge_in(self, pending: Interruption) -> None:
        assert self._response is not None
        self._interruption = None
        self.barge_ins += 1
        metrics.BARGE_INS.inc()
        self._begin_user_turn(pending.position)
        await self._cut(self._response)
        if pending.words:
            self._emit(ev.TRANSCRIPT_DELTA, item_id=self._user_item, delta=pending.words)
        if pending.stopped is not None:  # judged only at its end (words came late): it ended
            self._emit(ev.SPEECH_STOPPED, item_id=self._user_item, audio_end_ms=pending.stopped // 16)

    async def _final(self, text: str, event: ListenEvent) -> None:
        held = self._response
        if held is not None and held.held:
            if text and text == held.user_text:
                self._transcript_done(text, event)
                self._release(held)
                return
            await self._drop(held)
        self._times.final = event.at
        pending = self._interruption
        if pending is not None:
            pending.words = text
            if is_backchannel(text) and (text or self.config.resume_false_interruptions):
                self._interruption = None  # a backchannel, or no words at all: go on
                self._resume()
                return
            if self._response is not None and self._resume_if_echo(pending, self._response):
                return
            await self._barge_in(pending)
        over = self._response if not self.config.barge_in else None  # the reply it came over
        if text and over is not None and self._echoes(text, over):
            text = ""  # the reply's echo, taken for the caller: no turn
        self._transcript_done(text, event)
        if text and (over is not None or not self.config.answer_turns):
            self._unanswered.append(text)
            self._after_reply = self._after_reply or (over is not None and self.config.answer_turns)
        elif text:
            await self._answer(text, self._times)
            return
        self.machine.to(State.RESPONDING if self._response is not None else State.LISTENING)

    def _transcript_done(self, text: str, event: ListenEvent) -> None:
        if not self.config.word_times or event.result is None:
            self._emit(ev.TRANSCRIPT_DONE, item_id=self._user_item, transcript=text)
            return
        ms = 1000 / RUNTIME_RATE
        words = [
            {"text": w.text, "start_ms": round(w.start * ms), "end_ms": round(w.end * ms)}
            for w in event.result.committed
        ]
        self._emit(ev.TRANSCRIPT_DONE, item_id=self._user_item, transcript=text, words=words)

    def _resume(self) -> None:
        response = self._response
        if response is None:
            self.machine.to(State.LISTENING)
            return
        self.resumes += 1
        metrics.RESUMES.inc()
        response.pacer.resume()
        self.machine.to(State.RESPONDING)
        self._emit(ev.RESUMED, response_id=response.id)

    # -- speaking --

    def _quick_onsets(self, on: bool) -> None:
        """While the reply plays, the VAD confirms speech sooner: a barge-in must stop it
        fast, and a false start costs only a pause (the reply resumes)."""
        assert self._listener is not None
        vad = self._listener.vad
        ms = self.config.barge_in_min_speech_ms if on else self._vad_config.min_speech_ms
        vad.config = replace(vad.config, min_speech_ms=ms)

    def _playing(self) -> Response | None:
        """The reply whose audio has begun to go out (not one merely being thought)."""
        response = self._response
        return response if response is not None and response.times.first_sent is not None else None

    async def _answer(self, text: str, times: TurnTimes) -> None:
        """Reply to a user turn, and to the turns before it not answered yet. A reply
        still in progress ends first (cut as heard): text input and speech come from
        different tasks, and either may have begun one while the other waited."""
        while self._response is not None:
            await self._end_response()
        text = "\n".join([*self._unanswered, text]).strip()
        self._unanswered.clear()
        self._after_reply = False
        self._respond(text, times)

    def _respond(self, text: str, times: TurnTimes, held: bool = False) -> None:
        assert self._response is None, "a response is already in progress"
        n = next(self._items)
        response = Response(f"resp_{n}", f"item_{n}", self.engines.tts.stream(), Pacer(), times)
        response.user_text, response.held = text, held
        self._response = response
        self.ledger.start_turn(response.id)
        if held:
            response.pacer.pause()
        else:
            self.machine.to(State.RESPONDING)
        self._emit_for(response, ev.RESPONSE_CREATED)
        response.tasks = [
            asyncio.create_task(self._generate(response, text), name=f"{response.id}-llm"),
            asyncio.create_task(self._synthesize(response), name=f"{response.id}-tts"),
            asyncio.create_task(self._send(response), name=f"{response.id}-send"),
        ]

    def _emit_for(self, response: Response, type_: str, **data: object) -> None:
        """An event of a response: kept back while the response is speculative."""
        event = Event(type_, {"response_id": response.id, "item_id": response.item_id, **data})
        if response.held:
            response.held_events.append(event)
        else:
            self.sink.event(event)

    # -- speculative replies: begun at a pause in the caller's voice --

    def _speculate(self) -> None:
        """The caller paused: start the reply to what they said so far, silently."""
        assert self._listener is not None
        asr = self._listener.asr
        times = self._times

        async def run() -> None:
            text = await asr.speculative()
            times.final = time.monotonic()
            if text and self._response is None and self._listener and self._listener.paused:
                self._respond(text.strip(), times, held=True)

        self._own(asyncio.create_task(run(), name=f"{self.id}-speculate"))

    def _release(self, response: Response) -> None:
        """The turn did end with the words the held reply answers: let it be heard."""
        response.held = False
        self.machine.to(State.RESPONDING)
        for event in response.held_events:
            self.sink.event(event)
        response.held_events.clear()
        response.pacer.resume()

    async def _drop(self, response: Response) -> None:
        """The caller went on: the held reply goes, leaving no trace in the conversation."""
        await self._stop_work(response)
        self.conversation.retract(response.id)
        self._response = None

    async def _generate(self, response: Response, text: str) -> None:
        try:
            async for delta in self.conversation.reply(text, response.id):
                if response.times.first_token is None:
                    response.times.first_token = time.monotonic()
                self.ledger.turn(response.id).add_text(delta)
                if response.tts.push_text(delta) and response.times.first_phrase is None:
                    response.times.first_phrase = time.monotonic()
                self._emit_for(response, ev.TEXT_DELTA, delta=delta)
        except LlmError as e:
            self.send_error(SessionError("llm_error", str(e)))
        finally:
            if response.tts.end_text() and response.times.first_phrase is None:
                response.times.first_phrase = time.monotonic()

    async def _synthesize(self, response: Response) -> None:
        turn = self.ledger.turn(response.id)
        async for item in response.tts.frames():
            if isinstance(item, WordMark):
                turn.add_mark(TextMark(item.char_start, item.char_end, item.sample_start, item.sample_end))
                continue
            if response.times.first_audio is None:
                response.times.first_audio = time.monotonic()
            self.ledger.record_generated(response.id, item.num_samples)
            response.pacer.put(item)
        response.synthesized = True
        self.ledger.finish_turn(response.id)
        if response.pacer.queued_frames == 0:
            response.pacer.close()

    async def _send(self, response: Response) -> None:
        async for frame in response.pacer.frames():
            now = time.monotonic()
            if response.times.first_sent is None:
                response.times.first_sent = now
                self._quick_onsets(True)
                breakdown = response.times.breakdown_ms()
                metrics.observe_turn(breakdown)
                log.info("session %s: %s began", self.id, response.id, extra={"fields": breakdown})
                self._emit(ev.METRICS, response_id=response.id, **breakdown)
            position = self.ledger.record_sent(response.id, frame.num_samples)
            if not self.config.playback_acks:
                self.ledger.record_played(position)
            self.echo.record_sent(frame.samples, frame.sample_rate, now)
            self.sink.audio(frame, response.id)
            if response.synthesized and response.pacer.queued_frames == 0:
                break
        if response.synthesized and self._response is response:
            await self._finish(response, "completed")
            if self._after_reply and self._unanswered and self.state is State.LISTENING:
                await self._answer("", TurnTimes(final=time.monotonic()))  # words heard over it

    async def _finish(self, response: Response, status: str) -> None:
        """The reply ended (played out, or cut): tell the client, listen again."""
        if self._response is not response:
            return
        self._response = None
        self._quick_onsets(False)
        self._emit_for(response, ev.RESPONSE_DONE, status=status)
        if self.state is State.RESPONDING:
            self.machine.to(State.LISTENING)

    async def _cut(self, response: Response) -> None:
        """Barge-in or cancel: stop everything of the reply, keep what was heard."""
        response.pacer.clear()
        response.tts.cancel()
        await self._stop_work(response)
        await self._finish(response, "cancelled")
        self.ledger.discard_unsent(response.id)
        heard = self.ledger.heard_text(response.id)
        self.conversation.truncate(response.id, heard)
        self._emit(
            ev.TRUNCATED,
            item_id=response.item_id,
            content_index=0,
            audio_end_ms=self.ledger.audio_end_ms(response.id),
            transcript=heard,
        )

    async def _stop_work(self, response: Response) -> None:
        """Cancel the reply's LLM, TTS and send tasks (at once: none of them runs again)
        and wait for them to end."""
        for task in response.tasks:
            task.cancel()
        await self.conversation.abort()
        await _gather_cancelled(response.tasks)

    # -- output to the transport --

    def _emit(self, type_: str, **data: object) -> None:
        self.sink.event(Event(type_, dict(data)))

    def _error_once(self, error: SessionError) -> None:
        """Report a bad-input condition once, not once per frame, until good input returns."""
        if error.code not in self._input_errors:
            self._input_errors.add(error.code)
            self.send_error(error)

    def send_error(self, error: SessionError) -> None:
        log.info("session %s: %s: %s", self.id, error.code, error)
        self.sink.event(error.event())

    def _on_state(self, old: State, new: State) -> None:
        self._emit(ev.STATE, state=new.value, previous=old.value)


async def _gather_cancelled(tasks: list[asyncio.Task[None]]) -> None:
    """Await tasks that were cancelled; any other failure is logged, not raised."""
    results: list[object] = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            log.error("response task failed", exc_info=result)
