"""The duplex runtime with the real models, driven by the virtual caller in real time."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from audio_io.pcm import RUNTIME_RATE
from benchmarks.caller import Silence, Speak, Step, UntilHeard, UntilReplyDone, VirtualCaller
from duplex import events as ev
from duplex.events import SessionError
from duplex.session import Session
from duplex.session_config import SessionConfig
from duplex.state import State
from duplex.turn_policy import QUICK_PAUSE_CONFIRM_S, is_backchannel
from models.asr_stream import AsrStream
from models.kv_stream import KvStream
from models.listen import Listener
from tests.conftest import speech

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


async def converse(engines, timeline, caller: VirtualCaller | None = None, **config):
    caller = caller or VirtualCaller()
    session = Session(engines, caller, SessionConfig(**config))
    await session.start()
    try:
        await caller.play(session, timeline)
    finally:
        await session.close()
    return session, caller


async def test_backchannels_are_recognized():
    assert is_backchannel("Uh-huh.") and is_backchannel("okay, yeah") and is_backchannel("")
    assert is_backchannel("Thank you.") and is_backchannel("Then, then, then, then,")
    assert not is_backchannel("Okay, stop.") and not is_backchannel("Wait")


# the caller speaks, is heard, and the reply begins to play (deltas of a kind collapsed)
A_TURN = [
    ev.SPEECH_STARTED,
    ev.TRANSCRIPT_DELTA,
    ev.SPEECH_STOPPED,
    ev.TRANSCRIPT_DONE,
    ev.RESPONSE_CREATED,
    ev.AUDIO_DELTA,
]


async def test_a_held_reply_dropped_before_its_first_token_leaves_no_trace(engines, tts_engine, monkeypatch):
    """The caller pauses (a reply begins, silently), then goes on: the reply is dropped
    while it waits for its first token, and the conversation holds the one whole turn."""
    held: list[list[int]] = []
    dropped = asyncio.Event()
    real_run = KvStream.run

    async def run(stream, chunk, max_tokens, ignore_eos=False, logprobs_of=None, constraint=None):
        if max_tokens > 1 and not dropped.is_set():  # a reply (prefills take one token)
            held.append(chunk)
            try:
                await asyncio.Event().wait()  # its first token never comes
            except asyncio.CancelledError:
                dropped.set()
                raise
        async for delta in real_run(stream, chunk, max_tokens, ignore_eos, logprobs_of, constraint):
            yield delta

    monkeypatch.setattr(KvStream, "run", run)
    first = speech(tts_engine, "What is the capital city")
    rest = speech(tts_engine, "of France?")
    # a pause long enough to begin a held reply, short of the end of the turn
    session, caller = await converse(
        engines,
        [Silence(0.3), Speak(first), Silence(1.0), Speak(rest), UntilReplyDone(timeout=30, after=0.3)],
        end_of_turn_ms=2000,
        complete_turn_threshold=1.0,  # "What is the capital city?" could be a whole question
    )
    assert held and dropped.is_set()  # a held reply was dropped before its first token
    assert len(caller.of_type(ev.RESPONSE_CREATED)) == 1  # and nobody heard of it
    reply = "".join(e.data["delta"] for e in caller.of_type(ev.TEXT_DELTA))
    messages = session.conversation.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    (heard,) = caller.of_type(ev.TRANSCRIPT_DONE)  # the whole turn, once: not its first words too
    assert messages[1]["content"] == heard.data["transcript"] and "capital" in heard.data["transcript"]
    assert reply and messages[2]["content"] == reply


async def test_a_normal_turn_in_order(engines, tts_engine):
    question = speech(tts_engine, "Hello there. What is the capital city of France?")
    session, caller = await converse(
        engines, [Silence(0.3), Speak(question), UntilReplyDone(timeout=30, after=0.3)]
    )
    assert caller.sequence() == [*A_TURN, ev.RESPONSE_DONE]
    states = [e.data["state"] for e in caller.of_type(ev.STATE)]
    assert states == ["listening", "user_speaking", "responding", "listening", "closed"]
    (done,) = caller.of_type(ev.RESPONSE_DONE)
    assert done.data["status"] == "completed"
    assert caller.ended == [(done.data["response_id"], True)]  # the transport was told, once
    assert "capital" in caller.of_type(ev.TRANSCRIPT_DONE)[0].data["transcript"].lower()
    reply = "".join(e.data["delta"] for e in caller.of_type(ev.TEXT_DELTA))
    assert "Paris" in reply
    assert session.conversation.messages()[2]["content"] == reply
    (metrics,) = caller.of_type(ev.METRICS)
    assert {"endpoint_ms", "asr_final_ms", "llm_first_token_ms", "voice_to_voice_ms"} <= metrics.data.keys()
    # every generated sample of the reply reached the caller
    turn = session.ledger.turn(done.data["response_id"])
    assert sum(f.samples for f in caller.frames) == turn.sent == turn.generated


async def test_barge_in_cuts_the_reply_to_what_was_heard(engines, tts_engine):
    ask = speech(tts_engine, "Please tell me a long story about a brave little dragon.")
    stop = speech(tts_engine, "Stop please. What is two plus two?")
    session, caller = await converse(
        engines,
        [Silence(0.3), Speak(ask), UntilHeard(1.5), Speak(stop), UntilReplyDone(timeout=30, after=0.3)],
    )
    assert (
        caller.sequence()
        == [
            *A_TURN,
            ev.SPEECH_STARTED,  # the barge-in
            ev.RESPONSE_DONE,  # the first reply, cancelled
            ev.TRUNCATED,
            *A_TURN[1:],  # the interrupting words, heard as the next turn
            ev.RESPONSE_DONE,
        ]
    )
    first, second = caller.of_type(ev.RESPONSE_DONE)
    assert first.data["status"] == "cancelled" and second.data["status"] == "completed"
    cut_id = first.data["response_id"]
    assert caller.ended == [(cut_id, False), (second.data["response_id"], True)]
    # nothing of the cut reply left after the flush that paused it
    assert caller.flushes
    assert all(f.at <= caller.flushes[0] for f in caller.frames if f.response_id == cut_id)
    # the truncated text is exactly the words whose audio (half of each) was played
    played = sum(f.samples for f in caller.frames if f.response_id == cut_id)
    turn = session.ledger.turn(cut_id)
    heard_marks = [
        m for m in turn.marks if m.sample_start + -(-(m.sample_end - m.sample_start) // 2) <= played
    ]
    expected = turn.text[: heard_marks[-1].char_end] if heard_marks else ""
    (truncated,) = caller.of_type(ev.TRUNCATED)
    assert truncated.data["transcript"] == expected
    assert truncated.data["audio_end_ms"] == played * 1000 // tts_engine.sample_rate
    assert 1.0 < played / tts_engine.sample_rate < 2.5  # cut near where the caller spoke
    assert len(expected) < len(turn.text)
    # the conversation (and so the next prompt) holds the heard text only
    messages = session.conversation.messages()
    assert messages[2]["content"] == expected
    assert "stop" in messages[3]["content"].lower() and "plus" in messages[3]["content"].lower()
    assert session.turns.barge_ins == 1


def echo_heard(monkeypatch) -> list[bool]:
    """Each `Listener.ignore` call (the session took an utterance for the reply's echo):
    was the VAD in an utterance? True ones show the echo reached the VAD as speech."""
    ignored: list[bool] = []
    real_ignore = Listener.ignore

    def ignore(listener):
        ignored.append(listener.speaking)
        real_ignore(listener)

    monkeypatch.setattr(Listener, "ignore", ignore)
    return ignored


async def test_the_assistants_own_echo_does_not_interrupt_it(engines, tts_engine, monkeypatch):
    heard = echo_heard(monkeypatch)
    caller = VirtualCaller(echo_db=-20, echo_delay_s=0.15)
    ask = speech(tts_engine, "Please tell me a short story about a cat.")
    session, caller = await converse(
        engines, [Silence(0.3), Speak(ask), UntilReplyDone(timeout=40, after=0.5)], caller
    )
    (done,) = caller.of_type(ev.RESPONSE_DONE)
    assert done.data["status"] == "completed"
    assert session.turns.barge_ins == session.turns.resumes == session.turns.false_alarms == 0
    assert not caller.flushes
    assert any(heard)  # the echo did reach the VAD as speech, and was judged the echo


async def test_the_echo_is_not_transcribed_and_a_caller_over_it_is(engines, tts_engine, monkeypatch):
    """Speech the VAD hears over the reply that is no louder than the reply's echo runs no
    ASR pass (the ASR worker is the callers'); a caller who talks over the echo is heard,
    and transcribed from where their voice rises over it."""
    submitted: list[float] = []  # when each ASR pass was asked for
    real_submit = AsrStream._submit

    def submit(stream, position, final):
        submitted.append(time.monotonic())
        return real_submit(stream, position, final)

    monkeypatch.setattr(AsrStream, "_submit", submit)
    ignored = echo_heard(monkeypatch)
    ask = speech(tts_engine, "Please tell me a long story about a brave little dragon.")
    stop = speech(tts_engine, "Stop please. What is two plus two?")
    session, caller = await converse(
        engines,
        [Silence(0.3), Speak(ask), UntilHeard(2.5), Speak(stop), UntilReplyDone(timeout=30, after=0.3)],
        VirtualCaller(echo_db=-20, echo_delay_s=0.15),
    )
    assert any(ignored)  # the VAD heard the echo as speech, and the session left it untranscribed
    first, _ = caller.of_type(ev.RESPONSE_DONE)
    assert first.data["status"] == "cancelled" and session.turns.barge_ins == 1
    played_from = caller.first_frame(first.data["response_id"])
    assert played_from is not None and session.turns.pauses
    # from its echo's first VAD utterance until the caller's voice rose over it
    over_echo = [t for t in submitted if played_from + 0.4 < t < session.turns.pauses[0]]
    assert session.turns.pauses[0] - played_from > 2.0 and over_echo == []
    heard = session.conversation.messages()[3]["content"].lower()
    assert "stop" in heard and "plus" in heard


async def test_a_backchannel_does_not_interrupt(engines, tts_engine):
    ask = speech(tts_engine, "Please tell me a long story about a brave little dragon.")
    session, caller = await converse(
        engines,
        [
            Silence(0.3),
            Speak(ask),
            UntilHeard(1.0),
            Speak(speech(tts_engine, "Uh-huh.")),
            UntilReplyDone(timeout=40, after=0.3),
        ],
    )
    heard = [e.data for e in caller.events if "transcription" in e.type and e.data["item_id"] != "item_0"]
    assert len(caller.of_type(ev.RESPONSE_DONE)) == 1, heard
    (done,) = caller.of_type(ev.RESPONSE_DONE)
    assert done.data["status"] == "completed"
    assert session.turns.barge_ins == 0 and session.turns.resumes == 1
    assert not caller.of_type(ev.TRUNCATED)


async def test_bad_audio_is_an_error_and_the_session_goes_on(engines, tts_engine):
    from audio_io.frame import AudioFrame

    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig())
    await session.start()
    try:
        session.push_audio(AudioFrame(np.zeros(441, np.int16), 22050))  # the wrong rate
        for _ in range(600):  # 12 s at once: more than the 10 s it may queue
            session.push_audio(AudioFrame(np.zeros(320, np.int16), RUNTIME_RATE))
        codes = [e.data["error"]["code"] for e in caller.of_type(ev.ERROR)]
        assert codes[0] == "bad_audio_format" and "input_overflow" in codes
        question = speech(tts_engine, "What is the capital city of France?")
        await caller.play(session, [Silence(0.2), Speak(question), UntilReplyDone(timeout=30)])
        assert "Paris" in "".join(e.data["delta"] for e in caller.of_type(ev.TEXT_DELTA))
    finally:
        await session.close()
    assert session.state is State.CLOSED


async def test_a_disconnect_mid_reply_leaves_no_task_behind(engines, tts_engine):
    before = asyncio.all_tasks()
    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig())
    await session.start()
    ask = speech(tts_engine, "Please tell me a long story about a brave little dragon.")
    await caller.play(session, [Silence(0.3), Speak(ask), UntilHeard(0.5)])
    assert session.state is State.RESPONDING
    await session.close()
    await session.close()  # idempotent
    await asyncio.sleep(0.05)
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()
    # the engines serve the next session as before
    _, caller = await converse(
        engines,
        [Silence(0.2), Speak(speech(tts_engine, "What is the capital city of France?")), UntilReplyDone()],
    )
    assert "Paris" in "".join(e.data["delta"] for e in caller.of_type(ev.TEXT_DELTA))


async def test_speech_without_words_over_the_reply_resumes_it(engines, tts_engine):
    ask = speech(tts_engine, "Please tell me a long story about a brave little dragon.")
    session, caller = await converse(
        engines,
        [Silence(0.3), Speak(ask), UntilHeard(1.0), Speak(speech(tts_engine, "Ahh.")), Silence(3.0)],
    )
    assert session.turns.resumes == 1 and session.turns.barge_ins == 0
    (resumed,) = caller.of_type(ev.RESUMED)
    rid = resumed.data["response_id"]
    # paused at once, then the same reply went on where it stopped
    assert caller.flushes and any(f.at > resumed.at for f in caller.frames if f.response_id == rid)
    assert not any(caller.flushes[0] < f.at < resumed.at for f in caller.frames)
    assert not caller.of_type(ev.TRUNCATED) and not caller.of_type(ev.TRANSCRIPT_DONE)[1:]


async def test_a_click_over_the_reply_pauses_it_only_briefly(engines, tts_engine):
    rng = np.random.default_rng(1)
    click = (rng.standard_normal(int(0.03 * RUNTIME_RATE)) * 8000).astype(np.int16)  # 30 ms at -12 dBFS
    ask = speech(tts_engine, "Please tell me a long story about a brave little dragon.")
    session, caller = await converse(
        engines, [Silence(0.3), Speak(ask), UntilHeard(1.0), Speak(click), Silence(2.0)], quick_pause=True
    )
    # paused on the loud frame, before the VAD could judge it; the VAD heard no voice,
    # so the reply went on by itself: no interruption, nothing flushed or cut
    assert session.turns.false_alarms == 1
    assert session.turns.barge_ins == session.turns.resumes == 0
    assert not caller.flushes and not caller.of_type(ev.TRUNCATED) and not caller.of_type(ev.RESUMED)
    click_at = caller.voice_spans[-1][0]
    times = np.array([f.at for f in caller.frames])
    gaps = np.diff(times)
    k = int(np.argmax(gaps))
    assert times[k] > click_at - 0.1  # the pause came with the click
    assert QUICK_PAUSE_CONFIRM_S - 0.03 < gaps[k] < 1.0
    assert times[-1] > times[k + 1]  # and the reply carried on


async def test_echo_never_interrupts_over_20_replies(engines, tts_engine, monkeypatch):
    heard = echo_heard(monkeypatch)
    questions = [
        speech(tts_engine, q) for q in ("Name a color.", "Name a fruit.", "Name an animal.", "Say hi.")
    ]
    delays = (0.04, 0.1, 0.17, 0.25)
    caller = VirtualCaller(echo_db=-20)
    session = Session(engines, caller, SessionConfig())
    await session.start()
    try:
        for n in range(20):  # the echo's delay changes with each reply
            caller.echo_delay_s = delays[n % 4]
            await caller.play(session, [Speak(questions[n % 4]), UntilReplyDone(timeout=30, after=0.4)])
    finally:
        await session.close()
    done = caller.of_type(ev.RESPONSE_DONE)
    assert len(done) == 20 and all(d.data["status"] == "completed" for d in done)
    turns = session.turns
    assert turns.barge_ins == turns.resumes == turns.false_alarms == 0 and not caller.flushes
    assert sum(heard) >= 5  # the echo reached the VAD as speech over several replies, and was judged so


async def test_a_caller_silent_for_60_s_then_talking_for_60_s(engines, speech_set):
    # one long utterance: sentences joined by 200 ms gaps, shorter than the end of turn
    gap = np.zeros(int(0.2 * RUNTIME_RATE), np.int16)
    talk: list[np.ndarray] = []
    sentences = iter(speech_set * 5)
    while sum(a.size for a in talk) < 60 * RUNTIME_RATE:
        sentence = next(sentences)
        talk += [sentence.audio[sentence.voiced[0] : sentence.voiced[1]], gap]
    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig())
    await session.start()
    try:
        await caller.play(session, [Silence(60)])
        assert [e.type for e in caller.events if e.type != ev.STATE] == []  # nothing to say to silence
        assert session.state is State.LISTENING
        await caller.play(session, [Speak(np.concatenate(talk)), UntilReplyDone(timeout=60)])
    finally:
        await session.close()
    assert len(caller.of_type(ev.SPEECH_STARTED)) == 1  # one turn, however long
    (final,) = caller.of_type(ev.TRANSCRIPT_DONE)
    assert len(final.data["transcript"].split()) > 100
    assert [d.data["status"] for d in caller.of_type(ev.RESPONSE_DONE)] == ["completed"]


async def test_a_session_fed_garbage_does_not_disturb_another(engines, tts_engine):
    from audio_io.frame import AudioFrame

    before = asyncio.all_tasks()
    rng = np.random.default_rng(0)
    bad_caller, good_caller = VirtualCaller(), VirtualCaller()
    bad = Session(engines, bad_caller, SessionConfig())
    await bad.start()

    async def garbage() -> None:
        for i in range(150):  # 3 s of abuse at the pace of real audio
            if i % 3 == 0:
                noise = rng.integers(-32768, 32767, 320, dtype=np.int16)  # full-scale noise
                bad.push_audio(AudioFrame(noise, RUNTIME_RATE))
            elif i % 3 == 1:
                bad.push_audio(AudioFrame(np.full(441, 32767, np.int16), 44100))  # wrong rate
            else:
                bad.push_audio(AudioFrame(np.zeros(16000 * 12, np.int16), RUNTIME_RATE))  # 12 s at once
            await asyncio.sleep(0.02)
        await bad.close()

    question = speech(tts_engine, "What is the capital city of France?")
    (_, good_caller), _ = await asyncio.gather(
        converse(engines, [Silence(0.3), Speak(question), UntilReplyDone(timeout=30)], good_caller), garbage()
    )
    assert "Paris" in "".join(e.data["delta"] for e in good_caller.of_type(ev.TEXT_DELTA))
    assert not good_caller.of_type(ev.ERROR)
    codes = {e.data["error"]["code"] for e in bad_caller.of_type(ev.ERROR)}
    assert codes == {"bad_audio_format", "input_overflow"}
    await asyncio.sleep(0.05)
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


async def test_text_turns_that_race_each_other_are_answered_in_turn(engines):
    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig())
    await session.start()
    try:
        # two clients' tasks at once: each waits for the other's reply to end
        await asyncio.gather(session.push_text("Tell me a story."), session.push_text("Say hi."))
        for _ in range(1500):
            if len(caller.of_type(ev.RESPONSE_DONE)) == 2:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(SessionError):
            session.configure({"system_prompt": "new"})
        with pytest.raises(SessionError):
            session.configure({"end_of_turn_ms": 50})
        session.configure({"end_of_turn_ms": 800, "speculative_replies": False})
        assert session.config.end_of_turn_ms == 800
        assert session._listener is not None and session._listener.vad.config.min_silence_ms == 800
    finally:
        await session.close()
    statuses = [e.data["status"] for e in caller.of_type(ev.RESPONSE_DONE)]
    assert statuses == ["cancelled", "completed"]
    assert not caller.of_type(ev.ERROR)


async def until_events(caller: VirtualCaller, kind: str, count: int, within: float = 40.0) -> None:
    async with asyncio.timeout(within):
        while len(caller.of_type(kind)) < count:  # noqa: ASYNC110 (the caller records; nothing to await)
            await asyncio.sleep(0.02)


async def test_with_barge_in_off_the_reply_plays_on_and_words_over_it_are_answered_after(engines, tts_engine):
    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig(barge_in=False))
    await session.start()
    ask = speech(tts_engine, "Please tell me a short story about a cat.")
    over = speech(tts_engine, "What is two plus two?")
    try:
        timeline: list[Step] = [
            Silence(0.3),
            Speak(ask),
            UntilHeard(1.0),
            Speak(over),
            Silence(1.5),
            UntilReplyDone(40),
        ]
        await caller.play(session, timeline)
        await until_events(caller, ev.RESPONSE_DONE, 2)
    finally:
        await session.close()
    first, second = caller.of_type(ev.RESPONSE_DONE)
    assert first.data["status"] == second.data["status"] == "completed"
    assert not caller.flushes and session.turns.barge_ins == 0 and not caller.of_type(ev.TRUNCATED)
    asked, heard_over = caller.of_type(ev.TRANSCRIPT_DONE)
    assert "plus" in heard_over.data["transcript"].lower()
    assert heard_over.at < first.at  # heard while the reply played ...
    assert caller.of_type(ev.RESPONSE_CREATED)[1].at >= first.at  # ... answered once it ended
    messages = session.conversation.messages()
    assert messages[2]["content"] == session.ledger.turn(first.data["response_id"]).text  # all of it
    assert "plus" in messages[3]["content"].lower()


async def test_with_answer_turns_off_a_turn_waits_until_respond(engines, tts_engine):
    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig(answer_turns=False))
    await session.start()
    question = speech(tts_engine, "What is the capital city of France?")
    try:
        await caller.play(session, [Silence(0.3), Speak(question), Silence(1.5)])
        assert caller.of_type(ev.TRANSCRIPT_DONE) and not caller.of_type(ev.RESPONSE_CREATED)
        assert session.state is State.LISTENING
        with pytest.raises(SessionError) as bad:
            session.add_turn("   ")
        assert bad.value.code == "bad_text"
        session.add_turn("Answer in one word.")
        await session.respond()
        await until_events(caller, ev.RESPONSE_DONE, 1)
        with pytest.raises(SessionError) as nothing:
            await session.respond()  # everything was answered
        assert nothing.value.code == "no_input"
    finally:
        await session.close()
    user = session.conversation.messages()[1]["content"]
    assert "capital" in user.lower() and user.endswith("Answer in one word.")
    assert "Paris" in session.conversation.messages()[2]["content"]


async def test_user_turns_waiting_for_a_reply_are_bounded_by_what_one_reply_takes(engines):
    from models.conversation import MAX_USER_CHARS

    session = Session(engines, VirtualCaller(), SessionConfig())
    await session.start()
    try:
        line = "word " * 199  # 995 characters
        taken = 0
        with pytest.raises(SessionError) as info:
            for _ in range(1000):  # a client that adds items and never asks for a reply
                session.add_turn(line)
                taken += 1
        assert info.value.code == "too_much_input"
        assert taken == MAX_USER_CHARS // 996 and sum(map(len, session.unanswered)) <= MAX_USER_CHARS
        session.add_turn("Hi.")  # a short one still fits
    finally:
        await session.close()
