"""Turn-taking (`duplex.turn_taking`) driven by scripted listener events, with no model
and no real-time audio: a scripted `Hearing` (what the VAD and ASR would report), scripted
`Ears` (what the echo gate would measure), a clock the test moves, and a host that records
what the session is told to do. Each test pins, in milliseconds, a behaviour the
real-model tests (test_session.py, test_end_of_turn.py) show end to end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest

from duplex import events as ev
from duplex import turn_taking
from duplex.events import SessionError
from duplex.reply import ReplyState
from duplex.session_config import SessionConfig
from duplex.turn import TurnTimes, UnansweredTurns
from duplex.turn_policy import QUICK_PAUSE_CONFIRM_S
from duplex.turn_taking import TurnTaking
from models.asr_types import AsrResult, AsrWord
from models.listen import ListenEvent, ListenEventKind
from models.llm_types import LlmUnavailable

FRAME = np.zeros(320, np.int16)  # 20 ms at 16 kHz
MS = 16  # samples


def result(text: str, end: int, committed: str | None = None, final: bool = False) -> AsrResult:
    words = (committed if committed is not None else text).split()
    marks = tuple(AsrWord(w, i * 100, i * 100 + 90) for i, w in enumerate(words))
    return AsrResult(text, marks, final, end, 1.0)


def started(at: int) -> ListenEvent:
    return ListenEvent(ListenEventKind.SPEECH_STARTED, at)


def partial(text: str, at: int, committed: str | None = None) -> ListenEvent:
    return ListenEvent(ListenEventKind.PARTIAL, at, result(text, at, committed))


def paused(at: int) -> ListenEvent:
    return ListenEvent(ListenEventKind.PAUSED, at)


def stopped(at: int) -> list[ListenEvent]:
    return [ListenEvent(ListenEventKind.SPEECH_STOPPED, at, silence_ms=800.0)]


def final(text: str, at: int) -> ListenEvent:
    return ListenEvent(ListenEventKind.FINAL, at, result(text, at, final=True))


class Clock:
    """`time` for the room: monotonic() is what the test says."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class Hearing:
    """A `Listener` that reports what the test scripts, and keeps its state as one would."""

    def __init__(self) -> None:
        self.speaking = False
        self.ignoring = False
        self.preroll = 300 * MS
        self.position = 0
        self.pause: int | None = None
        self.min_silence_ms = SessionConfig().end_of_turn_ms  # the VAD's, as the session sets it
        self.script: list[list[ListenEvent]] = []  # what each push reports
        self.words: str | None = None  # the speculative final's
        self.final_words = ""  # the final's, when a turn is judged over in a pause
        self.ignored = 0
        self.restarts: list[int] = []
        self.held: list[tuple[int, int]] = []

    @property
    def paused(self) -> bool:
        return self.speaking and self.pause is not None

    @property
    def silence_ms(self) -> float:
        return (self.position - self.pause) / MS if self.paused and self.pause is not None else 0.0

    async def push(self, samples: np.ndarray) -> list[ListenEvent]:
        events = self.script.pop(0) if self.script else []
        # what was heard reaches at least as far as what it reports
        self.position = max([self.position + samples.size, *(e.position for e in events)])
        for event in events:
            if event.kind is ListenEventKind.SPEECH_STARTED:
                self.speaking, self.ignoring, self.pause = True, False, None
            elif event.kind is ListenEventKind.PAUSED:
                self.pause = event.position
            elif event.kind is ListenEventKind.PARTIAL:
                self.pause = None  # the voice went on
            elif event.kind is ListenEventKind.SPEECH_STOPPED:
                self.speaking, self.pause = False, None
        return events

    async def end_turn(self) -> list[ListenEvent]:
        if not self.paused or self.pause is None:
            return []
        at, self.speaking, self.pause = self.pause, False, None
        return [*stopped(at), final(self.final_words, at)]

    def restart(self, position: int) -> None:
        self.restarts.append(position)
        self.ignoring = False

    def ignore(self) -> None:
        if self.speaking:
            self.ignored += 1
            self.ignoring = True

    def hold_pause(self, pause: int, silence_ms: int) -> None:
        self.held.append((pause, silence_ms))

    async def speculative(self) -> str | None:
        return self.words


class Ears:
    """What the inbound side would measure: scripted."""

    def __init__(self) -> None:
        self.echo = False  # audio arriving now may hold the reply's echo
        self.caller_from: int | None = None  # where speech louder than any echo begins
        self.level_db = -70.0
        self.loud_may_be_echo = False

    async def next(self, position: int) -> tuple[np.ndarray, np.ndarray, float]:
        raise AssertionError("the tests call hear() themselves")

    def arrival(self, position: int) -> float:
        return position / 16000

    def echoing(self, at: float) -> bool:
        return self.echo

    def level(self, samples: np.ndarray) -> tuple[float, float]:
        return self.level_db, -70.0

    def may_be_echo(self, since: float, now: float) -> bool:
        return self.loud_may_be_echo

    def first_above_echo(self, start: int) -> int | None:
        return None if self.caller_from is None else max(start, self.caller_from)


@dataclass
class Reply:
    """A `ReplyView`: the reply's state, as the session's `Reply` keeps it."""

    id: str
    user_text: str
    state: ReplyState = ReplyState.PLAYING
    said: str = ""  # its words sent lately
    stopped: bool = False
    quick_paused: float | None = None
    times: TurnTimes = field(default_factory=TurnTimes)

    @property
    def held(self) -> bool:
        return self.state is ReplyState.HELD

    @property
    def begun(self) -> bool:
        return self.times.first_sent is not None

    def pause(self) -> None:
        if self.state is ReplyState.PLAYING:
            self.state = ReplyState.PAUSED

    def resume(self) -> None:
        if self.state is ReplyState.PAUSED:
            self.state = ReplyState.PLAYING

    def said_lately(self, seconds: float) -> str:
        return self.said


class Host:
    """A `TurnHost` that records what it is told to do, in order."""

    def __init__(self, **config: object) -> None:
        self.id = "sess_t"
        self.config = SessionConfig(**config)  # type: ignore[arg-type]
        self.unanswered = UnansweredTurns()
        self.reply: Reply | None = None
        self.did: list[tuple[str, object]] = []
        self.events: list[tuple[str, dict[str, object]]] = []
        self.errors: list[SessionError] = []
        self.prefilled: list[str] = []
        self.scored: list[str] = []
        self.score: float | None = None
        self._items = 0

    def playing(self, said: str = "Once upon a time there was a brave little dragon") -> Reply:
        """A reply whose audio is going out."""
        self.reply = Reply("resp_9", "What is a story?", said=said, times=TurnTimes(first_sent=1.0))
        return self.reply

    def begin_user_turn(self, position: int) -> str:
        self._items += 1
        self.did.append(("begin", position))
        return f"item_{self._items}"

    def interrupt(self, reply: Reply) -> None:
        reply.pause()
        self.did.append(("interrupt", reply.id))

    async def answer(self, text: str, times: TurnTimes) -> None:
        self.did.append(("answer", self.unanswered.take(text)))
        self.reply = Reply("resp_a", text)

    def hold(self, text: str, times: TurnTimes) -> None:
        self.did.append(("hold", text))
        self.reply = Reply("resp_h", text, ReplyState.HELD)

    def release(self, reply: Reply) -> None:
        self.did.append(("release", reply.user_text))
        reply.state = ReplyState.PLAYING

    async def stop_reply(self) -> None:
        if self.reply is not None:
            await (self.drop(self.reply) if self.reply.held else self.cut(self.reply))

    async def cut(self, reply: Reply) -> None:
        self.did.append(("cut", reply.id))
        reply.state, reply.stopped, self.reply = ReplyState.CUT, True, None

    async def drop(self, reply: Reply) -> None:
        self.did.append(("drop", reply.user_text))
        reply.state, reply.stopped, self.reply = ReplyState.DROPPED, True, None

    def resume(self) -> None:
        self.did.append(("resume", None))
        if self.reply is not None:
            self.reply.resume()

    def settle(self) -> None:
        self.did.append(("settle", None))

    def emit(self, type_: str, **data: object) -> None:
        self.events.append((type_, data))

    def send_error(self, error: SessionError) -> None:
        self.errors.append(error)

    async def prefill(self, words: str) -> None:
        self.prefilled.append(words)

    async def turn_score(self, words: str) -> float | None:
        self.scored.append(words)
        return self.score

    def told(self) -> list[str]:
        return [type_ for type_, _ in self.events]


class Room:
    """A `TurnTaking` over the doubles, stepped one 20 ms frame at a time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **config: object) -> None:
        self.clock = Clock()
        monkeypatch.setattr(turn_taking, "time", self.clock)
        self.host, self.hearing, self.ears = Host(**config), Hearing(), Ears()
        self.turns = TurnTaking(self.host, self.hearing, self.ears)  # type: ignore[arg-type]

    async def step(self, *events: ListenEvent | list[ListenEvent], frames: int = 1) -> None:
        """One frame that brings ``events`` (a list: several at once), then ``frames`` - 1
        quiet ones; the room's tasks (judgements in pauses) run to their end."""
        flat: list[ListenEvent] = []
        for event in events:
            flat.extend(event if isinstance(event, list) else [event])
        self.hearing.script.append(flat)
        for _ in range(frames):
            self.clock.now += 0.02
            await self.turns.hear(FRAME, FRAME, self.clock.now)
            while self.turns.tasks:
                await asyncio.gather(*self.turns.tasks)

    async def say(self, text: str, start: int = 0) -> int:
        """The caller says ``text`` (its words committed as they come); returns where it ends."""
        await self.step(started(start))
        end = start + 200 * MS
        await self.step(partial(text, end))
        return end


async def test_a_turn_is_answered_and_its_words_are_prefilled_as_they_come(monkeypatch):
    room = Room(monkeypatch)
    end = await room.say("What is the capital of France?")
    await room.step(stopped(end), final("What is the capital of France?", end))
    assert room.host.did == [("begin", 0), ("answer", "What is the capital of France?")]
    # (the session tells SPEECH_STARTED as it begins the user turn)
    assert room.host.told() == [ev.TRANSCRIPT_DELTA, ev.SPEECH_STOPPED, ev.TRANSCRIPT_DONE]
    assert room.host.prefilled == ["What is the capital of France?"]
    (done,) = [data for type_, data in room.host.events if type_ == ev.TRANSCRIPT_DONE]
    assert done["item_id"] == "item_1" and done["transcript"] == "What is the capital of France?"
    assert "words" not in done


async def test_word_times_go_with_the_transcript_when_asked_for(monkeypatch):
    room = Room(monkeypatch, word_times=True)
    end = await room.say("Hello there")
    await room.step(stopped(end), final("Hello there", end))
    (done,) = [data for type_, data in room.host.events if type_ == ev.TRANSCRIPT_DONE]
    assert done["words"] == [
        {"text": "Hello", "start_ms": 0, "end_ms": 6},
        {"text": "there", "start_ms": 6, "end_ms": 12},
    ]


async def test_a_barge_in_cuts_the_reply_and_its_words_are_the_next_turn(monkeypatch):
    room = Room(monkeypatch)
    room.host.playing()
    room.ears.echo, room.ears.caller_from = True, 8000
    await room.step(started(8000))
    assert room.host.did == [("interrupt", "resp_9")] and room.turns.interruption is not None
    assert room.turns.pauses  # when the reply paused
    await room.step(partial("Stop please.", 12000))
    assert room.host.did[1:] == [("begin", 8000), ("cut", "resp_9")]
    assert room.turns.barge_ins == 1 and room.turns.interruption is None
    await room.step(stopped(20000), final("Stop please. What is two plus two?", 20000))
    assert room.host.did[3:] == [("answer", "Stop please. What is two plus two?")]
    # the interrupting words are told as the new turn's, once the barge-in is known
    assert (ev.TRANSCRIPT_DELTA, {"item_id": "item_1", "delta": "Stop please."}) in room.host.events


async def test_a_backchannel_over_the_reply_waits_then_resumes_it(monkeypatch):
    room = Room(monkeypatch)
    reply = room.host.playing()
    room.ears.caller_from = 8000
    await room.step(started(8000))
    await room.step(partial("Uh-huh.", 10000))
    assert reply.state is ReplyState.PAUSED and room.turns.interruption is not None  # judged at its end
    await room.step(stopped(11000), final("Uh-huh.", 11000))
    assert room.host.did == [("interrupt", "resp_9"), ("resume", None)]
    assert reply.state is ReplyState.PLAYING and room.turns.resumes == 1 and room.turns.barge_ins == 0


@pytest.mark.parametrize("resume", [True, False])
async def test_speech_without_words_over_the_reply_resumes_it_unless_told_otherwise(monkeypatch, resume):
    room = Room(monkeypatch, resume_false_interruptions=resume)
    room.host.playing()
    room.ears.caller_from = 8000
    await room.step(started(8000))
    await room.step(stopped(9000), final("", 9000))
    after = [("resume", None)] if resume else [("begin", 8000), ("cut", "resp_9"), ("settle", None)]
    assert room.host.did == [("interrupt", "resp_9"), *after]


async def test_the_replys_echo_is_ignored_and_not_transcribed(monkeypatch):
    room = Room(monkeypatch)
    reply = room.host.playing()
    room.ears.echo = True  # nothing louder than the echo: caller_from stays None
    await room.step(started(8000))
    assert room.turns.echo_utterance and room.hearing.ignored == 1
    await room.step(partial("a brave little dragon", 10000), frames=5)
    await room.step(stopped(12000), final("", 12000))
    assert room.host.did == [] and reply.state is ReplyState.PLAYING
    assert room.turns.barge_ins == room.turns.resumes == room.turns.false_alarms == 0
    assert ev.TRANSCRIPT_DONE not in room.host.told() and not room.turns.echo_utterance


async def test_a_caller_rising_over_the_echo_is_transcribed_from_where_they_begin(monkeypatch):
    room = Room(monkeypatch)
    room.host.playing()
    room.ears.echo = True
    await room.step(started(8000), frames=26)
    assert room.hearing.ignoring and room.host.did == []
    room.ears.caller_from = 16000  # the caller's voice rises over the echo, half a second in
    await room.step()
    start = 16000 - turn_taking.ECHO_PREROLL
    assert room.hearing.restarts == [start] and not room.turns.echo_utterance
    assert room.host.did == [("interrupt", "resp_9")] and room.turns.interruption is not None
    assert room.turns.interruption.position == start


async def test_a_caller_whose_start_was_taken_for_echo_is_transcribed_from_their_start(monkeypatch):
    room = Room(monkeypatch)
    room.host.playing()
    room.ears.echo = True
    await room.step(started(8000))
    room.ears.caller_from = 8000  # the same place: the utterance was the caller's all along
    await room.step()
    assert room.hearing.restarts == [8000 - room.hearing.preroll]


async def test_the_replys_own_words_come_back_loud_are_its_echo(monkeypatch):
    room = Room(monkeypatch)
    reply = room.host.playing(said="Once upon a time there was a brave little dragon")
    room.ears.caller_from = 8000
    await room.step(started(8000))
    await room.step(partial("a brave", 9000))  # two words: too few to tell
    assert room.turns.interruption is not None
    await room.step(partial("a brave little dragon", 10000))
    assert room.host.did == [("interrupt", "resp_9"), ("resume", None)] and reply.state is ReplyState.PLAYING
    assert room.turns.echo_utterance  # the rest of it is echo too
    await room.step(stopped(12000), final("a brave little dragon", 12000))
    assert room.host.did[2:] == []


async def test_a_loud_frame_pauses_the_reply_and_the_vad_not_confirming_resumes_it(monkeypatch):
    room = Room(monkeypatch, quick_pause=True)
    reply = room.host.playing()
    room.ears.level_db = -20.0
    await room.step()
    assert reply.state is ReplyState.PAUSED and reply.quick_paused is not None and len(room.turns.pauses) == 1
    room.ears.level_db = -70.0
    frames = int(QUICK_PAUSE_CONFIRM_S / 0.02) + 2
    await room.step(frames=frames)
    assert reply.state is ReplyState.PLAYING and reply.quick_paused is None
    assert room.turns.false_alarms == 1 and room.host.did == []
    room.ears.level_db = -20.0
    await room.step()  # held off for a while after a false alarm
    assert reply.state is ReplyState.PLAYING


async def test_a_loud_frame_that_may_be_echo_pauses_nothing(monkeypatch):
    room = Room(monkeypatch, quick_pause=True)
    reply = room.host.playing()
    room.ears.level_db, room.ears.loud_may_be_echo = -20.0, True
    await room.step(frames=3)
    assert reply.state is ReplyState.PLAYING and not room.turns.pauses


async def test_a_quick_pause_confirmed_by_the_vad_is_the_interruptions_stop(monkeypatch):
    room = Room(monkeypatch, quick_pause=True)
    reply = room.host.playing()
    room.ears.level_db = -20.0
    await room.step()
    paused_at = reply.quick_paused
    room.ears.caller_from = 8000
    await room.step(started(8000))
    assert room.host.did == [("interrupt", "resp_9")] and reply.quick_paused is None
    assert list(room.turns.pauses) == [paused_at]  # counted once, at the quick pause


async def pause_after(room: Room, words: str, score: float | None) -> int:
    """The caller says ``words`` and pauses; the LLM gives them ``score``."""
    room.host.score, room.hearing.words, room.hearing.final_words = score, words, words
    end = await room.say(words)
    await room.step(paused(end))
    return end


async def test_a_turn_judged_over_ends_at_a_short_pause_with_its_held_reply_released(monkeypatch):
    room = Room(monkeypatch)
    end = await pause_after(room, "What is the capital of France?", 0.95)
    assert room.host.scored == ["What is the capital of France?"]
    assert room.host.did == [("begin", 0), ("hold", "What is the capital of France?")]
    certain = room.host.config.certain_turn_ms
    await room.step(frames=certain // 20 - 2)
    assert room.hearing.speaking  # not yet
    await room.step(frames=3)
    assert room.host.did[2:] == [("release", "What is the capital of France?")]
    assert room.host.reply is not None and room.host.reply.state is ReplyState.PLAYING
    assert room.turns.times.end_of_turn_score == 0.95 and end == 200 * MS


async def test_unfinished_words_make_the_vad_wait_longer(monkeypatch):
    room = Room(monkeypatch)
    end = await pause_after(room, "What I really want to know is", 0.001)
    assert room.hearing.held == [(end, room.host.config.unfinished_turn_ms)]
    await room.step(frames=30)  # 600 ms: longer than any judged end, the VAD decides
    assert room.hearing.speaking and ("release", "What I really want to know is") not in room.host.did


async def test_a_held_reply_is_dropped_when_the_caller_goes_on(monkeypatch):
    room = Room(monkeypatch)
    end = await pause_after(room, "What is the capital city", 0.5)
    assert room.host.did[-1] == ("hold", "What is the capital city")
    await room.step(partial("What is the capital city of France?", end + 8000))
    assert room.host.did[-1] == ("drop", "What is the capital city")
    await room.step(stopped(end + 9000), final("What is the capital city of France?", end + 9000))
    assert room.host.did[-1] == ("answer", "What is the capital city of France?")
    assert room.host.told().count(ev.TRANSCRIPT_DONE) == 1  # the whole turn, once


async def test_a_final_other_than_the_held_replys_words_drops_it(monkeypatch):
    room = Room(monkeypatch, end_of_turn_by_meaning=False)
    end = await pause_after(room, "What is the capital", None)
    await room.step(stopped(end), final("What is the capital of France?", end))
    assert room.host.did[1:] == [
        ("hold", "What is the capital"),
        ("drop", "What is the capital"),
        ("answer", "What is the capital of France?"),
    ]
    assert room.host.scored == []  # judged by silence alone


async def test_a_pause_whose_words_came_late_is_not_judged(monkeypatch):
    room = Room(monkeypatch)
    room.host.score, room.hearing.words = 0.99, "Tell me a story"
    end = await room.say("Tell me a story")
    room.hearing.pause = end  # the pause began long before its words were ready
    room.hearing.position = end + room.host.config.end_of_turn_ms * MS  # its silence has run out
    await room.step(paused(end))
    assert room.host.scored == [] and room.host.did[-1] == ("hold", "Tell me a story")


async def test_the_llm_out_means_silence_alone_ends_the_turn(monkeypatch):
    room = Room(monkeypatch)
    await pause_after(room, "What is the capital of France?", None)  # the LLM could not say
    await room.step(frames=20)
    assert room.hearing.speaking and room.turns.times.end_of_turn_score is None


async def test_with_barge_in_off_words_over_the_reply_wait_for_it_to_end(monkeypatch):
    room = Room(monkeypatch, barge_in=False)
    reply = room.host.playing()
    room.ears.caller_from = 8000
    await room.step(started(8000))
    await room.step(stopped(12000), final("And what about Spain?", 12000))
    assert room.host.did == [("begin", 8000), ("settle", None)] and reply.state is ReplyState.PLAYING
    assert list(room.host.unanswered) == ["And what about Spain?"] and room.host.unanswered.after_reply


async def test_with_barge_in_off_the_replys_echo_taken_for_the_caller_is_no_turn(monkeypatch):
    room = Room(monkeypatch, barge_in=False)
    room.host.playing(said="Once upon a time there was a brave little dragon")
    room.ears.caller_from = 8000
    await room.step(started(8000))
    await room.step(stopped(12000), final("there was a brave little dragon", 12000))
    assert not list(room.host.unanswered)
    (done,) = [data for type_, data in room.host.events if type_ == ev.TRANSCRIPT_DONE]
    assert done["transcript"] == ""


async def test_with_answer_turns_off_turns_wait_for_respond(monkeypatch):
    room = Room(monkeypatch, answer_turns=False)
    end = await room.say("First question.")
    await room.step(stopped(end), final("First question.", end))
    end = await room.say("Second question.", start=end + 8000)
    await room.step(stopped(end), final("Second question.", end))
    assert [d for d in room.host.did if d[0] == "answer"] == [] and not room.host.unanswered.after_reply
    assert list(room.host.unanswered) == ["First question.", "Second question."]
    assert room.host.prefilled[-1] == "First question.\nSecond question."  # the LLM reads them as one


async def test_a_listening_failure_is_told_and_the_room_goes_on(monkeypatch):
    room = Room(monkeypatch)

    async def broken(samples: np.ndarray) -> list[ListenEvent]:
        raise RuntimeError("a bug")

    real = room.hearing.push
    room.hearing.push = broken  # type: ignore[method-assign]
    await room.step()
    assert [e.code for e in room.host.errors] == ["internal_error"]
    room.hearing.push = real  # type: ignore[method-assign]
    room.hearing.script.clear()
    end = await room.say("Hello")
    await room.step(stopped(end), final("Hello", end))
    assert room.host.did[-1] == ("answer", "Hello")


async def test_a_prefill_while_the_llm_is_out_is_not_an_error(monkeypatch):
    room = Room(monkeypatch)

    async def out(words: str) -> None:
        raise LlmUnavailable("the LLM is out")

    room.host.prefill = out  # type: ignore[method-assign]
    await room.say("Hello")
    assert room.host.errors == []


def test_unanswered_turns_hold_what_one_turn_may():
    turns = UnansweredTurns(limit=20)
    turns.add("0123456789")
    with pytest.raises(SessionError) as refused:
        turns.add("0123456789")  # 11 + 10 > 20
    assert refused.value.code == "too_much_input" and list(turns) == ["0123456789"]
    turns.keep("abcdefghij", after_reply=True)  # heard: the oldest goes to make room
    assert list(turns) == ["abcdefghij"] and turns.after_reply
    turns.keep("x" * 30)  # the newest always stays
    assert list(turns) == ["x" * 30]
    turns.remove("not there")
    assert turns.take("and this") == "x" * 30 + "\nand this" and not list(turns) and not turns.after_reply
