"""`TurnTaking`: who speaks when, for one session. It hears the caller (the hearing loop),
tells the caller from the reply's echo, judges interruptions, turns finals into user
turns, ends a turn by the meaning of its words, and prepares the reply in a pause.

    Inbound (`Ears`) ─► Listener (`Hearing`: VAD + ASR) ─► listen events ─► TurnTaking
                                                                               │ verdicts of
                                                                               │ duplex.turn_policy
                                   Session (`TurnHost`) ◄── begin a user turn, interrupt, answer,
                                   every state change       hold, release, stop, cut, drop, resume

It decides and keeps the bookkeeping of the turn in progress (the interruption being
judged, the pause's words and score, whether the utterance is the echo); every decision
is a pure function of `duplex.turn_policy`, and every change of the session's state is
the host's (`TurnHost`, which `Session` implements). It sees the reply only through
`ReplyView` (the four protocols are in `duplex.turn_ports`). So the whole room runs on
scripted listener events, with no model (tests/test_turn_taking.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Coroutine

from audio_io.frame import Int16Array
from audio_io.pcm import RUNTIME_RATE
from duplex import events as ev
from duplex import metrics
from duplex import turn_policy as policy
from duplex.events import SessionError
from duplex.inbound import ECHO_CHECK_SAMPLES
from duplex.reply import ReplyState, llm_failure
from duplex.turn import Interruption, TurnTimes, word_times_ms
from duplex.turn_ports import Ears, Hearing, ReplyView, TurnHost
from models.listen import ListenEvent, ListenEventKind
from models.llm import LlmError
from models.llm_types import LlmUnavailable

log = logging.getLogger("duplex.turn_taking")

ECHO_PREROLL = RUNTIME_RATE // 10  # ASR starts this far before the caller's voice rose over the echo
ECHO_TEXT_S = 4.0  # words heard over the reply are compared with its last 4 s (`is_echo_of`)


class TurnTaking:
    def __init__(self, host: TurnHost, hearing: Hearing, ears: Ears) -> None:
        self.host = host
        self.hearing = hearing
        self.ears = ears
        self.interruption: Interruption | None = None
        self.echo_utterance = False  # the utterance in progress is the assistant's echo
        self.times = TurnTimes()
        self.user_item = "item_none"
        self._utterance_start = 0  # stream position of the caller's speech start
        self._score: tuple[int, float] | None = None  # (the VAD's pause, P(the turn is over) there)
        self._pause_words: tuple[int, str] | None = None  # (the VAD's pause, the words before it)
        self._judging_ms = 0.0  # how long the LLM's judgements of this caller's pauses take
        self._quick_holdoff = 0.0
        self.tasks: set[asyncio.Task[None]] = set()  # prefills, judgements and speculations
        self.barge_ins = 0
        self.resumes = 0
        self.false_alarms = 0  # quick pauses the VAD did not confirm
        # when speech over a reply paused it (each then a barge-in, a resume or a false
        # alarm): the bench tells the caller's pauses from the echo's
        self.pauses: collections.deque[float] = collections.deque(maxlen=1000)

    async def run(self) -> None:
        """The hearing loop: every inbound frame, in order, until cancelled."""
        while True:
            samples, residual, arrived = await self.ears.next(self.hearing.position)
            await self.hear(samples, residual, arrived)

    async def hear(self, samples: Int16Array, residual: Int16Array, arrived: float) -> None:
        """One inbound frame (16 kHz), what the echo canceller left of it, when it arrived."""
        self._quick_pause(residual, arrived - ECHO_CHECK_SAMPLES / RUNTIME_RATE)
        try:
            for event in await self.hearing.push(samples):
                await self._on_listen(event)
            if self._turn_over():
                for event in await self.hearing.end_turn():
                    await self._on_listen(event)
            await self._check_interruption()
            held = self.host.reply
            if held is not None and held.held and self.hearing.speaking and not self.hearing.paused:
                await self.host.drop(held)  # the caller went on after the pause
        except LlmError as e:  # this session's turn could not be served; the session goes on
            self.host.send_error(llm_failure(e))
        except Exception:  # a bug: this session reports it, every other one carries on
            log.exception("session %s: listening failed", self.host.id)
            self.host.send_error(SessionError("internal_error", "the server failed to process this audio"))

    def _own(self, work: Coroutine[object, object, None], name: str) -> None:
        """A task of this room (kept until done; `Session.close` cancels them)."""
        task = asyncio.create_task(work, name=f"{self.host.id}-{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _prefill(self, words: str) -> None:
        """The caller's committed words go to the LLM in the background (never blocking
        hearing); calls that pile up coalesce in `Conversation.prefill`."""
        try:
            await self.host.prefill(words)
        except LlmUnavailable:  # said once, by the turn's reply, not at every word
            log.debug("session %s: no prefill while the LLM is out", self.host.id)
        except LlmError as e:
            self.host.send_error(llm_failure(e))

    def _playing(self) -> ReplyView | None:
        """The reply whose audio has begun to go out (not one merely being thought)."""
        reply = self.host.reply
        return reply if reply is not None and reply.begun else None

    def _quick_pause(self, residual: Int16Array, since: float) -> None:
        """While the reply plays, a loud frame pauses it before the VAD can tell
        (`turn_policy.quick_pause`), unless it may be the reply's echo; `_check_echo` then
        confirms it as an interruption, or it was a false alarm and the reply goes on."""
        config = self.host.config
        if not (config.quick_pause and config.barge_in):
            return
        level, room = self.ears.level(residual)
        now = time.monotonic()
        reply = self._playing()
        if reply is None or self.interruption is not None:
            return
        paused = reply.state is ReplyState.PAUSED
        verdict = policy.quick_pause(level, room, reply.quick_paused, paused, self._quick_holdoff, now)
        if verdict is policy.QuickPause.FALSE_ALARM:
            reply.quick_paused = None
            self.false_alarms += 1
            log.debug("session %s: the VAD heard no caller after a quick pause", self.host.id)
            metrics.FALSE_ALARMS.inc()
            self._quick_holdoff = now + policy.QUICK_PAUSE_HOLDOFF_S
            reply.resume()
        elif verdict is policy.QuickPause.LOUD and not self.ears.may_be_echo(since, now):
            reply.pause()
            reply.quick_paused = now
            self.pauses.append(now)

    async def _on_listen(self, event: ListenEvent) -> None:
        kind = event.kind
        if kind is ListenEventKind.SPEECH_STARTED:
            await self._speech_started(event)
        elif self.echo_utterance:
            if kind is ListenEventKind.FINAL:
                self.echo_utterance = False
                heard = event.result.text if event.result is not None else ""
                log.debug("session %s: %r over the reply was never louder than its echo", self.host.id, heard)
        elif kind is ListenEventKind.PARTIAL:
            assert event.result is not None
            committed = " ".join(w.text for w in event.result.committed)
            if self.interruption is not None:
                # judged on words ASR has committed (seen alike by two passes): a partial
                # of a short sound is where Whisper hallucinates ("You", "Thank you.")
                self.interruption.words = committed
            else:
                self.host.emit(ev.TRANSCRIPT_DELTA, item_id=self.user_item, delta=event.result.text)
                if committed and self.host.reply is None and not self.hearing.paused:
                    self._own(self._prefill(self.host.unanswered.with_(committed)), "prefill")
        elif kind is ListenEventKind.PAUSED:
            self._paused()
        elif kind is ListenEventKind.SPEECH_STOPPED:
            self.times.speech_end = self.ears.arrival(event.position)
            self.times.stopped = event.at
            self.times.silence_ms = event.silence_ms
            if self.interruption is None:
                self.host.emit(ev.SPEECH_STOPPED, item_id=self.user_item, audio_end_ms=event.position // 16)
            else:  # told if it turns out to be a barge-in (`_barge_in`)
                self.interruption.stopped = event.position
        elif kind is ListenEventKind.FINAL:
            assert event.result is not None
            await self._final(event.result.text.strip(), event)

    def _begin_user_turn(self, position: int) -> None:
        self.times = TurnTimes()
        self.user_item = self.host.begin_user_turn(position)

    async def _speech_started(self, event: ListenEvent) -> None:
        self._utterance_start = event.position
        playing = self._playing()
        # judged at the arrival of the utterance's start, not now: hearing may lag behind
        # (a loaded machine), and the echo of a reply's last words must still count as echo
        if playing is not None or self.ears.echoing(self.ears.arrival(event.position)):
            self.echo_utterance = True  # until its level says otherwise (_check_echo)
            await self._check_echo(playing)
            if self.echo_utterance:
                self.hearing.ignore()  # transcribed from where the caller's voice rises, if it does
            return
        await self.host.stop_reply()  # still thinking, nothing heard yet: the caller goes on
        self._begin_user_turn(event.position)

    async def _check_echo(self, reply: ReplyView | None) -> None:
        """Speech over the reply: echo, or the caller? Re-checked as the utterance goes on,
        so a caller whose first syllable was quiet still gets through, and after the reply
        has ended, so a caller who speaks while its echo fades is heard."""
        hearing = self.hearing
        recent = max(self._utterance_start, hearing.position - ECHO_CHECK_SAMPLES)
        onset = self.ears.first_above_echo(recent)
        over = policy.speech_over_reply(onset is not None, reply is not None, self.host.config.barge_in)
        if onset is None or over is policy.Over.ECHO:
            return
        caller_start = onset - ECHO_PREROLL
        restart = policy.restart_at(caller_start, self._utterance_start, hearing.ignoring, hearing.preroll)
        if caller_start > self._utterance_start:  # the VAD's utterance began with echo
            late_ms = (caller_start - self._utterance_start) // 16
            log.debug("session %s: the caller's voice rose over the echo %d ms in", self.host.id, late_ms)
            self._utterance_start = caller_start
        if restart is not None:
            hearing.restart(restart)
        self.echo_utterance = False
        if reply is None or over is policy.Over.TURN:
            # no reply playing (it ended, or is still being thought), or one the caller
            # may not cut: a new turn, answered when the reply has played
            if reply is None:
                await self.host.stop_reply()
            self._begin_user_turn(self._utterance_start)
            return
        self.host.interrupt(reply)  # nothing more leaves from here on
        quick, reply.quick_paused = reply.quick_paused, None
        stopped = quick or time.monotonic()
        if quick is None:  # else the quick pause recorded it
            self.pauses.append(stopped)
        metrics.BARGE_IN_STOP.observe(max(0.0, stopped - self.ears.arrival(onset)))
        self.interruption = Interruption(self._utterance_start)
        self.times = TurnTimes()

    async def _check_interruption(self) -> None:
        """Judge a tentative interruption as soon as its words say it is one: the words
        ASR committed while the caller speaks, all of them once a pause has them (under
        load, a short line has none committed by then); a barge-in in a pause prepares
        the turn there, as any pause does."""
        if self.echo_utterance and self.hearing.speaking:
            await self._check_echo(self._playing())
        pending, reply = self.interruption, self.host.reply
        if pending is None or reply is None:
            return
        heard = self._words_in_pause()
        if heard is not None:  # all of them, not only those two partial passes agreed on
            pending.words = heard[1]
        if await self._judge(pending, reply, ended=False) and heard is not None:
            self._own(self._prepare(*heard, self.times), "paused")

    async def _judge(self, pending: Interruption, reply: ReplyView | None, ended: bool) -> bool:
        """Act on the verdict on an interruption's words (`turn_policy.judge_interruption`):
        True if it was a barge-in."""
        resume = self.host.config.resume_false_interruptions
        verdict = policy.judge_interruption(pending.words, _said_lately(reply), ended, resume)
        if verdict is not policy.Verdict.WAIT:
            words, end = pending.words, "ended" if ended else "so far"
            log.debug("session %s: interruption %r (%s): %s", self.host.id, words, end, verdict.value)
        if verdict is policy.Verdict.BARGE_IN:
            await self._barge_in(pending)
        elif verdict is not policy.Verdict.WAIT:  # a backchannel, no words, or the reply's echo
            if verdict is policy.Verdict.ECHO:
                self._echo_heard(pending.words)
            self.interruption = None
            if self.host.reply is not None:
                self.resumes += 1
                metrics.RESUMES.inc()
            self.host.resume()
            self.echo_utterance = verdict is policy.Verdict.ECHO and not ended  # the rest of it too
        return verdict is policy.Verdict.BARGE_IN

    def _echo_heard(self, words: str) -> None:
        log.info("session %s: %r over the reply was its echo", self.host.id, words)
        metrics.ECHOES_HEARD.inc()

    async def _barge_in(self, pending: Interruption) -> None:
        reply = self.host.reply
        assert reply is not None, "a barge-in with no reply to cut"
        self.interruption = None
        self.barge_ins += 1
        metrics.BARGE_INS.inc()
        self.user_item = self.host.begin_user_turn(pending.position)
        await self.host.cut(reply)
        if pending.words:
            self.host.emit(ev.TRANSCRIPT_DELTA, item_id=self.user_item, delta=pending.words)
        if pending.stopped is not None:  # judged only at its end (words came late): it ended
            self.host.emit(ev.SPEECH_STOPPED, item_id=self.user_item, audio_end_ms=pending.stopped // 16)

    async def _final(self, text: str, event: ListenEvent) -> None:
        host, held = self.host, self.host.reply
        if held is not None and held.held:
            if text and text == held.user_text and not held.stopped:
                self._transcript_done(text, event)
                host.release(held)  # the turn ended with the words it answers
                return
            await host.drop(held)
        self.times.final = event.at
        pending = self.interruption
        if pending is not None:
            pending.words = text
            if not await self._judge(pending, host.reply, ended=True):
                return  # the reply goes on
        over = host.reply if not host.config.barge_in else None  # the reply it came over
        turn = policy.finished_turn(text, _said_lately(over), host.config.answer_turns)
        if turn is policy.Turn.ECHO:
            self._echo_heard(text)
            text = ""  # the reply's echo, taken for the caller: no turn
        self._transcript_done(text, event)
        if turn in (policy.Turn.HOLD, policy.Turn.AFTER_REPLY):
            host.unanswered.keep(text, after_reply=turn is policy.Turn.AFTER_REPLY)
        elif turn is policy.Turn.ANSWER:
            await host.answer(text, self.times)
            return
        host.settle()

    def _transcript_done(self, text: str, event: ListenEvent) -> None:
        usage = {"type": "duration", "seconds": self._heard_s(event)}
        done: dict[str, object] = {"item_id": self.user_item, "transcript": text, "usage": usage}
        if self.host.config.word_times and event.result is not None:
            done["words"] = word_times_ms(event.result.committed)
        self.host.emit(ev.TRANSCRIPT_DONE, **done)

    def _heard_s(self, event: ListenEvent) -> float:
        """Seconds of audio the final pass transcribed: from the utterance's start (less
        the listener's preroll) to the end of what it saw."""
        end = event.result.audio_end if event.result is not None else event.position
        start = max(0, self._utterance_start - self.hearing.preroll)
        return round(max(0, end - start) / RUNTIME_RATE, 3)

    def _paused(self) -> None:
        """The caller paused: their words so far are transcribed at once (the pass that
        will be the final if the turn ends here). Over a reply whose interruption is still
        being judged, those words judge it (`_check_interruption`); else `_prepare` acts on
        them."""
        hearing, times, pause = self.hearing, self.times, self.hearing.pause
        if pause is None:
            return
        times.end_of_turn_score = times.scored = None  # an earlier pause's, which the caller talked through

        async def run() -> None:
            text = await hearing.speculative()
            times.final = time.monotonic()
            if not text or hearing.pause != pause:
                return  # nothing heard, or the caller went on
            self._pause_words = (pause, text.strip())
            if self.interruption is None:
                await self._prepare(*self._pause_words, times)

        self._own(run(), "paused")

    def _words_in_pause(self) -> tuple[int, str] | None:
        """The pause the caller is in and all the words of the utterance before it, once
        its speculative final has them; None before, or outside a pause."""
        heard, hearing = self._pause_words, self.hearing
        return heard if heard and policy.in_pause(hearing.paused, hearing.pause, heard[0]) else None

    async def _prepare(self, pause: int, text: str, times: TurnTimes) -> None:
        """In a pause after ``text``: the LLM says how likely the turn is over after them
        (`_turn_over` acts on it), and the reply to them begins, silently
        (held), to be released if the turn ends with these words.

        A judgement that would come only after the silence has ended the turn anyway
        (the ASR's final came late in the pause: a slow machine, or a loaded one) is
        not asked for, and the reply begins at once: it would have waited for nothing.
        """
        c, hearing, host = self.host.config, self.hearing, self.host
        interrupting, replying = self.interruption is not None, host.reply is not None
        speculate = policy.should_speculate(c.speculative_replies, c.answer_turns, interrupting, replying)
        judge = c.end_of_turn_by_meaning and not interrupting and not replying
        if judge and not policy.judgement_in_time(hearing.silence_ms, self._judging_ms, c.end_of_turn_ms):
            judge = False
            self._judging_ms = policy.judging_ms(self._judging_ms, None, c.end_of_turn_ms)
            log.debug("session %s: this pause is judged by silence alone (its final came late)", host.id)
        if judge:
            asked = time.monotonic()
            p = await host.turn_score(text)
            took_ms = (time.monotonic() - asked) * 1000
            self._judging_ms = policy.judging_ms(self._judging_ms, took_ms, c.end_of_turn_ms)
            if p is not None and hearing.pause == pause:
                self._score, times.end_of_turn_score = (pause, p), p
                times.scored = time.monotonic()
                if (needed := c.silence_to_end(p)) > hearing.min_silence_ms:
                    hearing.hold_pause(pause, needed)  # unfinished words: the VAD waits longer
        if speculate and host.reply is None and policy.in_pause(hearing.paused, hearing.pause, pause):
            host.hold(text, times)

    def _turn_over(self) -> bool:
        """In a pause long enough to end the caller's turn sooner than the VAD will, by
        the rules for the words before it (`SessionConfig.silence_to_end`: words judged
        a finished turn)? Words over a reply, or its echo, and words not judged yet wait
        for the VAD (``end_of_turn_ms``; longer after unfinished words, `_prepare`)."""
        hearing, score = self.hearing, self._score
        if score is None or not policy.in_pause(hearing.paused, hearing.pause, score[0]):
            return False
        needed = self.host.config.silence_to_end(score[1])
        judging_echo = self.interruption is not None or self.echo_utterance
        return policy.turn_over(needed, hearing.min_silence_ms, hearing.silence_ms, judging_echo)


def _said_lately(reply: ReplyView | None) -> str | None:
    """What the reply's echo would say now (None: there is no reply)."""
    return reply.said_lately(ECHO_TEXT_S) if reply is not None else None
