"""Reply: its state table (every pair of states), what the client is told and when, and
its work end to end with a scripted LLM and TTS (no models)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any, cast

import numpy as np
import pytest

from audio_io.frame import AudioFrame
from audio_io.ledger import PlayoutLedger
from duplex import events as ev
from duplex.echo import EchoGate
from duplex.events import Event, SessionError
from duplex.reply import Outlet, Reply, ReplyState
from duplex.turn import TurnTimes
from models.tts import TtsStream, WordMark

R = ReplyState
RATE = 16000
FRAME = RATE // 50
# Written out here, not read from the module: the test is the second copy of the table.
ALLOWED: dict[ReplyState, set[ReplyState]] = {
    R.HELD: {R.PLAYING, R.DROPPED, R.DONE},
    R.PLAYING: {R.PAUSED, R.DONE, R.CUT},
    R.PAUSED: {R.PLAYING, R.DONE, R.CUT},
    R.DONE: set(),
    R.CUT: set(),
    R.DROPPED: set(),
}
ROUTE: dict[ReplyState, tuple[bool, list[ReplyState]]] = {  # (held at first, moves)
    R.HELD: (True, []),
    R.PLAYING: (False, []),
    R.PAUSED: (False, [R.PAUSED]),
    R.DONE: (False, [R.DONE]),
    R.CUT: (False, [R.CUT]),
    R.DROPPED: (True, [R.DROPPED]),
}


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def audio(self, frame: AudioFrame, response_id: str) -> None:
        self.calls.append(("audio", frame.num_samples))

    def event(self, event: Event) -> None:
        self.calls.append(("event", event.type))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    def sent(self) -> int:
        return sum(n for kind, n in self.calls if kind == "audio" and isinstance(n, int))

    def end_reply(self, response_id: str, completed: bool) -> None:
        self.calls.append(("end_reply", (response_id, completed)))


class Host:
    def __init__(self) -> None:
        self.errors: list[SessionError] = []
        self.begun: list[str] = []
        self.finished = asyncio.Event()

    def send_error(self, error: SessionError) -> None:
        self.errors.append(error)

    def began(self, reply: Reply) -> None:
        self.begun.append(reply.id)

    def words_ended(self, reply: Reply) -> None:
        pass

    async def played_out(self, reply: Reply) -> None:
        self.finished.set()


class Tts:
    """A TtsStream double: each phrase pushed becomes one word mark and ``frames`` frames."""

    def __init__(self, frames: int = 2) -> None:
        self.text = ""
        self.frames_per_phrase = frames
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.cancelled = False

    def push_text(self, delta: str) -> list[str]:
        start = len(self.text)
        self.text += delta
        self.queue.put_nowait(f"{start}:{len(self.text)}")
        return [delta]

    def end_text(self) -> list[str]:
        self.queue.put_nowait(None)
        return []

    def cancel(self) -> None:
        self.cancelled = True

    async def frames(self) -> AsyncIterator[AudioFrame | WordMark]:
        position = 0
        while (span := await self.queue.get()) is not None:
            start, end = (int(x) for x in span.split(":"))
            n = self.frames_per_phrase * FRAME
            yield WordMark(start, end, position, position + n)
            for _ in range(self.frames_per_phrase):
                yield AudioFrame(np.full(FRAME, 1000, np.int16), RATE)
            position += n


def make(held: bool = False, tts: Tts | None = None) -> tuple[Reply, Sink, Host, PlayoutLedger]:
    sink, host, ledger = Sink(), Host(), PlayoutLedger(RATE)
    out = Outlet(sink, ledger, EchoGate(), None, played_when_sent=True)
    reply = Reply("resp_1", "item_1", "hi", TurnTimes(), cast(TtsStream, tts or Tts()), out, host, held)
    ledger.start_turn(reply.id)
    return reply, sink, host, ledger


def reply_in(state: ReplyState) -> Reply:
    held, moves = ROUTE[state]
    reply = make(held)[0]
    for move in moves:
        reply.to(move)
    assert reply.state is state
    return reply


@pytest.mark.parametrize(("old", "new"), list(itertools.product(ReplyState, ReplyState)))
def test_every_transition_of_the_table_and_no_other(old: ReplyState, new: ReplyState) -> None:
    reply = reply_in(old)
    if new is old:
        assert reply.to(new) is False  # no change
    elif new in ALLOWED[old]:
        assert reply.to(new) is True and reply.state is new
    else:
        with pytest.raises(AssertionError, match=f"reply resp_1 {old.value} -> {new.value}"):
            reply.to(new)
        assert reply.state is old


def test_a_held_replys_events_wait_for_its_release_in_order() -> None:
    reply, sink, _, _ = make(held=True)
    assert reply.held and reply.pacer.paused
    reply.emit(ev.RESPONSE_CREATED)
    reply.emit(ev.TEXT_DELTA, delta="Hi")
    assert sink.calls == []
    reply.release()
    assert reply.state is R.PLAYING and not reply.pacer.paused and not reply.held_events
    assert sink.calls == [("event", ev.RESPONSE_CREATED), ("event", ev.TEXT_DELTA)]


def test_the_transport_hears_of_the_end_just_before_response_done() -> None:
    reply, sink, _, _ = make()
    reply.end("completed")
    assert reply.state is R.DONE
    assert sink.calls == [("end_reply", ("resp_1", True)), ("event", ev.RESPONSE_DONE)]
    reply, sink, _, _ = make()
    reply.to(R.PAUSED)
    reply.end("cancelled")
    assert reply.state is R.CUT
    assert sink.calls == [("end_reply", ("resp_1", False)), ("event", ev.RESPONSE_DONE)]


def test_a_held_reply_that_ends_tells_nothing_unless_released() -> None:
    reply, sink, _, _ = make(held=True)
    reply.end("cancelled")  # the session closed before it was confirmed
    assert reply.state is R.DROPPED and sink.calls == []
    reply, sink, _, _ = make(held=True)
    reply.end(None)  # the caller went on
    assert reply.state is R.DROPPED and sink.calls == []
    reply, sink, _, _ = make(held=True)
    reply.end("completed")  # it had nothing to say
    reply.emit(ev.TEXT_DELTA, delta="late")
    assert reply.state is R.DONE and sink.calls == []
    # a held reply whose response.done was kept back tells the transport when released
    reply, sink, _, _ = make(held=True)
    reply.emit(ev.RESPONSE_CREATED)
    reply.emit(ev.RESPONSE_DONE, status="completed")
    reply.release()
    assert sink.calls == [
        ("event", ev.RESPONSE_CREATED),
        ("end_reply", ("resp_1", True)),
        ("event", ev.RESPONSE_DONE),
    ]


def test_pause_and_resume_act_only_where_they_mean_something() -> None:
    reply = make()[0]
    reply.pause()
    assert reply.state is R.PAUSED and reply.pacer.paused
    reply.pause()  # already paused
    assert reply.state is R.PAUSED
    reply.resume()
    assert reply.state is R.PLAYING and not reply.pacer.paused
    reply.resume()  # already playing
    assert reply.state is R.PLAYING
    held = make(held=True)[0]
    held.pause()
    held.resume()  # a held reply is released, never resumed
    assert held.state is R.HELD and held.pacer.paused


async def words(*deltas: str) -> AsyncIterator[str]:
    for delta in deltas:
        yield delta


async def test_a_reply_is_generated_spoken_sent_and_booked() -> None:
    reply, sink, host, ledger = make()
    aborted: list[bool] = []

    async def abort() -> None:
        aborted.append(True)

    reply.start(words("Hello", " there."), abort)
    async with asyncio.timeout(5):
        await host.finished.wait()
    audio = [n for kind, n in sink.calls if kind == "audio"]
    assert audio == [FRAME] * 4 and host.begun == ["resp_1"]
    assert [n for kind, n in sink.calls if kind == "event"] == [ev.TEXT_DELTA, ev.TEXT_DELTA]
    turn = ledger.turn("resp_1")
    assert turn.text == "Hello there." and turn.complete
    assert turn.generated == turn.sent == turn.played == 4 * FRAME  # sent counts as played
    assert turn.heard_text() == "Hello there."
    t = reply.times
    assert t.first_token and t.first_phrase and t.first_audio and t.first_sent
    assert t.first_token <= t.first_phrase <= t.first_audio <= t.first_sent
    await reply.stop()
    assert reply.stopped and aborted == [True]
    assert all(task.done() for task in reply.tasks)


async def test_stop_cancels_every_task_at_once_and_a_cut_drops_the_queued_audio() -> None:
    tts = Tts(frames=50)  # a second of audio per phrase
    reply, sink, host, ledger = make(tts=tts)
    never = asyncio.Event()

    async def slow_words() -> AsyncIterator[str]:
        yield "A long story."
        await never.wait()  # the LLM is still thinking
        yield "never"

    async def abort() -> None:
        pass

    reply.start(slow_words(), abort)
    while not any(kind == "audio" for kind, _ in sink.calls):  # noqa: ASYNC110 (nothing to await)
        await asyncio.sleep(0.005)
    await reply.stop(cut=True)
    assert tts.cancelled and reply.pacer.queued_frames == 0 and reply.stopped
    assert all(task.done() for task in reply.tasks)
    sent = sink.sent()
    await asyncio.sleep(0.06)
    assert sink.sent() == sent  # nothing more left
    assert not host.finished.is_set() and not host.errors
    assert ledger.turn("resp_1").sent == sent < ledger.turn("resp_1").generated


async def test_a_reply_cut_while_its_first_phrase_is_synthesized_was_heard_as_nothing(tts_engine) -> None:
    """With the real TTS stream: a cut while the first phrase is still being synthesized
    leaves the turn incomplete, so the ledger says nothing was heard (a cancelled
    stream had counted as one that synthesized all its text, and the cut kept the words
    generated so far, "The answer to the", as heard: the bench's inexact truncations)."""
    tts = tts_engine.stream()
    reply, sink, _, ledger = make(tts=cast(Any, tts))
    reply.start(words("The answer to the question is simple, and here it is."), _nothing)
    turn = ledger.turn("resp_1")
    while not turn.text:  # noqa: ASYNC110 (nothing to await)
        await asyncio.sleep(0.001)
    assert not sink.sent()  # its first phrase is still being synthesized
    await reply.stop(cut=True)
    ledger.discard_unsent("resp_1")
    assert not turn.complete and ledger.heard_text("resp_1") == ""


async def _nothing() -> None:
    pass
