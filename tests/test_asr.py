"""Streaming Whisper with the bundled tiny.en model, on speech from our own TTS."""

import asyncio

import numpy as np
import pytest

from audio_io.g711 import ulaw_decode, ulaw_encode
from audio_io.pcm import float_to_pcm16
from audio_io.resample import resample
from benchmarks.speech_set import normalize, wer, word_errors
from models.listen import Listener, ListenEventKind

GAP = np.zeros(12000, np.int16)


async def listen(vad_engine, asr_engine, audio: np.ndarray, lockstep: bool = True) -> list:
    """Feed 20 ms chunks; in lockstep, wait for each partial pass (as if compute were free)."""
    listener = Listener(vad_engine, asr_engine)
    events = []
    padded = np.concatenate([GAP, audio, GAP])
    try:
        for i in range(0, padded.size, 320):
            events += await listener.push(padded[i : i + 320])
            if lockstep:
                await listener.asr.idle()
        events += await listener.flush()
    finally:
        listener.close()
    return events


def finals(events: list) -> str:
    return " ".join(e.result.text for e in events if e.kind is ListenEventKind.FINAL)


@pytest.fixture(scope="module")
def streamed(vad_engine, asr_engine, speech_set):
    async def run_all():
        return [await listen(vad_engine, asr_engine, u.audio) for u in speech_set]

    return asyncio.run(run_all())


@pytest.mark.slow
def test_streaming_wer_on_20_varied_sentences(speech_set, streamed):
    pairs = [(u.text, finals(events)) for u, events in zip(speech_set, streamed, strict=True)]
    assert len(pairs) == 20  # wer([]) is 0
    assert wer(pairs) <= 0.10, pairs


@pytest.mark.slow
def test_committed_words_are_never_retracted(streamed):
    checked = 0
    for events in streamed:
        committed: list[str] = []
        for event in events:
            if event.kind is ListenEventKind.SPEECH_STARTED:
                committed = []
            if event.kind in (ListenEventKind.PARTIAL, ListenEventKind.FINAL):
                words = [w.text for w in event.result.committed]
                assert words[: len(committed)] == committed, (committed, words)
                if event.kind is ListenEventKind.PARTIAL:
                    assert event.result.text.startswith(" ".join(committed)[:1])
                    committed = words
                    checked += len(words)
                else:
                    assert normalize(event.result.text)[: len(committed)] == normalize(" ".join(committed))
    assert checked > 50  # the test saw real commits, not empty lists


@pytest.mark.slow
def test_committed_words_carry_ordered_timestamps(streamed):
    checked = pairs = 0
    for events in streamed:
        for event in events:
            if event.kind is ListenEventKind.PARTIAL and event.result.committed:
                times = [(w.start, w.end) for w in event.result.committed]
                assert all(s <= e for s, e in times)
                assert all(a[1] <= b[0] + 800 for a, b in zip(times, times[1:], strict=False))  # ~ordered
                assert times[-1][1] <= event.result.audio_end
                checked += len(times)
                pairs += len(times) - 1
    assert checked > 50 and pairs > 30, (checked, pairs)  # it saw real timestamps, and neighbours


def within_one_word(a: str, b: str) -> bool:
    """At most one word differs, counting a word split in two ("after noon" for
    "afternoon", which Whisper writes either way on windows 90 ms apart) as one."""
    return word_errors(a, b)[0] <= 1 or "".join(normalize(a)) == "".join(normalize(b))


def test_a_split_word_is_one_word_of_difference():
    assert within_one_word("at the office yesterday afternoon.", "at the office yesterday after noon.")
    assert within_one_word("left my umbrella", "left my umbrellas")
    assert not within_one_word("left my umbrella", "left her umbrellas")
    assert not within_one_word("yesterday afternoon", "yes today after noon")


@pytest.mark.slow
def test_streaming_final_is_within_one_word_of_one_shot(asr_engine, speech_set, streamed):
    assert len(speech_set) == 20  # the loop below compares every sentence
    for utterance, events in zip(speech_set, streamed, strict=True):
        one_shot = asr_engine.transcribe(np.concatenate([GAP, utterance.audio, GAP]))
        assert within_one_word(one_shot, finals(events)), (one_shot, finals(events))


@pytest.mark.slow
def test_partials_come_at_least_every_500ms_of_speech(streamed, speech_set):
    longest = max(range(len(speech_set)), key=lambda i: speech_set[i].audio.size)
    ends = [e.result.audio_end for e in streamed[longest] if e.kind is ListenEventKind.PARTIAL]
    assert len(ends) >= 3
    assert max(np.diff(ends)) <= 8000 + 320  # 500 ms of audio (+ one chunk)


@pytest.mark.slow
async def test_telephone_audio_still_transcribes(asr_engine, speech_set):
    pairs = []
    for u in speech_set:
        phone = ulaw_decode(ulaw_encode(resample(u.audio, 16000, 8000)))  # G.711 at 8 kHz
        pairs.append((u.text, asr_engine.transcribe(resample(phone, 8000, 16000))))
    assert len(pairs) == 20  # wer([]) is 0
    assert wer(pairs) <= 0.15, pairs


async def test_final_for_a_pause_is_ready_at_the_end_of_speech(vad_engine, asr_engine, speech_set):
    # real-time paced: the final pass starts at the pause and is done by the end event
    events = await listen(vad_engine, asr_engine, speech_set[0].audio, lockstep=False)
    stopped = next(e for e in events if e.kind is ListenEventKind.SPEECH_STOPPED)
    final = next(e for e in events if e.kind is ListenEventKind.FINAL)
    assert word_errors(speech_set[0].text, final.result.text)[0] <= 1
    assert final.position == stopped.position


@pytest.mark.parametrize("restarted", [False, True])
async def test_an_ignored_utterance_runs_no_pass_unless_restarted(
    vad_engine, asr_engine, speech_set, restarted
):
    """An utterance the session takes for the assistant's echo (`Listener.ignore`) runs no
    pass, partial or final, and its final is empty; restarted where the caller's voice
    begins (`Listener.restart`), it is transcribed from there."""
    utterance = speech_set[0]
    listener = Listener(vad_engine, asr_engine)
    audio = np.concatenate([GAP, utterance.audio, GAP])
    events: list = []
    passes = None  # the engine's, once the utterance was ignored
    try:
        for i in range(0, audio.size, 320):
            pushed = await listener.push(audio[i : i + 320])
            events += pushed
            for start in (e for e in pushed if e.kind is ListenEventKind.SPEECH_STARTED):
                listener.ignore()
                assert listener.ignoring
                passes = asr_engine.passes
                if restarted:
                    listener.restart(start.position - listener.preroll)
            await listener.asr.idle()  # lockstep: each pass done before the next audio
        events += await listener.flush()
    finally:
        listener.close()
    assert passes is not None  # the VAD heard the utterance begin
    assert [e.kind for e in events].count(ListenEventKind.FINAL) == 1
    partials = [e for e in events if e.kind is ListenEventKind.PARTIAL]
    if restarted:
        assert not listener.ignoring and partials
        assert word_errors(utterance.text, finals(events))[0] <= 1, finals(events)
    else:
        assert finals(events) == "" and not partials
        assert asr_engine.passes == passes


async def test_bad_audio_gives_a_clear_result_or_error(asr_engine, vad_engine):
    assert asr_engine.transcribe(np.zeros(0, np.int16)) == ""
    assert asr_engine.transcribe(np.zeros(48000, np.int16)) == ""
    noise = np.where(np.random.default_rng(0).standard_normal(48000) > 0, 32767, -32768).astype(np.int16)
    assert isinstance(asr_engine.transcribe(noise), str)
    with pytest.raises(ValueError, match="NaN"):
        float_to_pcm16(np.array([0.1, np.nan, 0.2]))
    stream = asr_engine.stream()
    stream.begin(0)
    with pytest.raises(TypeError, match="int16"):
        stream.push(np.zeros(320, np.float32))
    assert (await stream.finish(0)).text == ""  # an empty utterance
    assert asr_engine.alive and vad_engine.alive


@pytest.mark.slow
async def test_a_garbage_session_does_not_disturb_another(vad_engine, asr_engine, speech_set):
    async def garbage() -> None:
        listener = Listener(vad_engine, asr_engine)
        rng = np.random.default_rng(1)
        clipped = np.where(rng.standard_normal(16000 * 10) > 0, 32767, -32768).astype(np.int16)
        await listener.push(clipped)  # ten seconds in one burst
        for bad in (np.zeros(320, np.float32), np.full(320, np.nan, np.float64)):
            with pytest.raises(TypeError):
                await listener.push(bad)  # type: ignore[arg-type]
        for _ in range(0, 16000 * 3, 320):
            await listener.push(rng.integers(-32768, 32767, 320).astype(np.int16))
        await listener.flush()
        listener.close()

    good, _ = await asyncio.gather(
        listen(vad_engine, asr_engine, speech_set[0].audio, lockstep=False), garbage()
    )
    assert word_errors(speech_set[0].text, finals(good))[0] <= 1
    assert asr_engine.alive and vad_engine.alive


@pytest.mark.slow
async def test_overload_thins_partials_but_keeps_every_final(vad_engine, asr_engine, speech_set):
    # Eight callers at once, fed as fast as the loop allows: far more than real time.
    utterances = [speech_set[i] for i in (0, 4, 6, 8, 9, 12, 13, 16)]
    passes_before = asr_engine.passes
    runs = await asyncio.gather(
        *(listen(vad_engine, asr_engine, u.audio, lockstep=False) for u in utterances)
    )
    for utterance, events in zip(utterances, runs, strict=True):
        assert [e.kind for e in events].count(ListenEventKind.FINAL) == 1
        assert word_errors(utterance.text, finals(events))[0] <= 2, finals(events)
    audio_s = sum(u.audio.size for u in utterances) / 16000
    partials = sum(1 for events in runs for e in events if e.kind is ListenEventKind.PARTIAL)
    assert partials < audio_s * 2 * 0.5  # fewer than half of the every-500-ms partials
    assert asr_engine.passes - passes_before >= len(utterances)


async def test_a_queued_transcription_equals_the_one_shot_one(asr_engine, speech_set):
    """`transcribe_queued` (a Realtime manual commit) runs the same passes as `transcribe`,
    on the worker queue: the same text, for one window and for several (35 s of speech
    with gaps: cut at committed words, as the one-shot transcription cuts)."""
    utterances = list(speech_set)[:8]
    assert len(utterances) == 8
    for u in utterances[:3]:
        assert await asr_engine.transcribe_queued(u.audio) == asr_engine.transcribe(u.audio)
    long = np.concatenate([np.concatenate([u.audio, GAP]) for u in utterances] * 2)
    assert long.size > 30 * 16000
    queued = await asr_engine.transcribe_queued(long)
    assert queued == asr_engine.transcribe(long)
    assert wer([(" ".join(u.text for u in utterances * 2), queued)]) <= 0.3


async def test_closing_the_engine_fails_the_passes_it_will_not_finish_at_once():
    """A transcription of noise in progress and another queued behind it when the engine
    closes (server shutdown): both awaiting callers get an error at once, not after the
    passes (seconds of decoding noise on a slow machine)."""
    from models.asr import AsrEngine
    from models.asr_types import AsrClosed
    from models.bundled import BUNDLED

    engine = AsrEngine(BUNDLED["asr"].locate())
    noise = (np.random.default_rng(0).standard_normal(29 * 16000) * 3000).astype(np.int16)
    running = asyncio.ensure_future(engine.transcribe_queued(noise))
    queued = asyncio.ensure_future(engine.transcribe_queued(noise))
    for _ in range(500):  # until the first pass has begun
        if engine._running:
            break
        await asyncio.sleep(0.01)
    assert engine._running and engine.busy_s == 0, "the first pass did not begin, or already ended"
    await asyncio.to_thread(engine.close, 0.05)
    done, _ = await asyncio.wait([running, queued], timeout=0.5)
    assert done == {running, queued}, "a caller still waits on the closed engine"
    for task in done:
        with pytest.raises(AsrClosed):
            task.result()


async def test_passes_waiting_together_are_decoded_together_with_the_same_words(asr_engine, speech_set):
    """Finals of several streams waiting at once share the decoder's steps (one batch,
    `MAX_BATCH` at most), and each gets the words it would have got alone."""
    from models.asr_queue import MAX_BATCH

    utterances = list(speech_set)[:6]
    alone = [asr_engine.transcribe(u.audio) for u in utterances]
    passes, batches = asr_engine.passes, asr_engine.batches
    together = await asyncio.gather(*(asr_engine.transcribe_queued(u.audio) for u in utterances))
    assert together == alone
    assert asr_engine.passes - passes == len(utterances)
    assert asr_engine.batches - batches < len(utterances)  # some were decoded together
    assert asr_engine.batches - batches >= -(-len(utterances) // MAX_BATCH)


def test_windows_with_different_prompts_decode_together_as_alone(asr_engine, speech_set):
    """Windows with and without previous text, or with a committed prefix, in one call:
    each gets the words it gets alone."""
    from models.asr_types import Window as _Window

    tokens = asr_engine.tokenizer.encode(" Earlier words were said here.")
    audio = [u.audio.astype(np.float32) / 32768 for u in list(speech_set)[:4]]
    windows = [
        _Window(audio[0], 0, [], []),
        _Window(audio[1], 0, [], tokens),
        _Window(audio[2], 0, asr_engine.tokenizer.encode(" Could you")[:1], []),
        _Window(audio[3], 0, [], tokens[:3]),
        _Window(np.zeros(800, np.float32), 0, [], []),  # too short to transcribe
    ]
    alone = [asr_engine.transcribe_batch([w])[0].text for w in windows]
    assert [h.text for h in asr_engine.transcribe_batch(windows)] == alone
    assert all(alone[:4]) and alone[4] == ""


async def test_a_partial_pass_running_at_the_end_of_speech_never_follows_the_final(asr_engine, speech_set):
    """The final supersedes a partial pass still running when the utterance ends: its
    result must not arrive after the final (the session would send the caller's line
    again, as a transcript delta after the transcript was done)."""
    from models.asr_stream import AsrStream

    audio = speech_set[0].audio
    asr = AsrStream(asr_engine, partial_interval=audio.size)
    asr.begin(0)
    asr.push(audio)  # a partial pass starts on the whole utterance
    assert asr._partial is not None
    await asyncio.sleep(0.02)  # the worker has taken it up
    final = await asr.finish(audio.size)
    await asyncio.sleep(0.5)  # anything the partial pass would still deliver
    assert final.text and asr.results.empty()


async def test_a_partial_pass_that_heard_past_the_last_word_serves_as_the_final(asr_engine, speech_set):
    """At a pause, the partial pass in flight is the final when its audio goes `COVER`
    past the words: one pass instead of two, the same words as a final pass of its own.
    One that stops short of that does not serve."""
    from models.asr_stream import COVER, AsrStream

    audio = np.concatenate([speech_set[0].audio, np.zeros(4000, np.int16)])
    voiced_until = speech_set[0].audio.size
    alone = asr_engine.transcribe(audio)
    for heard, serves in ((voiced_until + COVER, True), (voiced_until + COVER - 320, False)):
        asr = AsrStream(asr_engine, partial_interval=heard)
        asr.begin(0)
        passes = asr_engine.passes
        asr.push(audio[:heard])  # a partial pass starts on what was heard so far
        assert asr._partial is not None
        await asyncio.sleep(0.02)  # the worker has taken it up
        reused = asr_engine.finals_from_partials
        asr.pause(heard + 1600, voiced_until)
        assert await asr.speculative() == alone
        final = await asr.finish(heard + 1600)
        assert final.text == alone
        assert asr_engine.finals_from_partials - reused == int(serves)
        while asr_engine._running:  # noqa: ASYNC110 (a superseded partial stops at its next step)
            await asyncio.sleep(0.01)
        assert asr_engine.passes - passes == (1 if serves else 2)


async def test_no_partial_pass_starts_in_a_pause_and_one_due_starts_when_the_voice_resumes(
    asr_engine, speech_set
):
    """In an announced pause the speculative final has the words: a partial pass due
    then would hear silence and take a core from the reply being prepared. It waits,
    and starts at the first audio after the voice resumes."""
    from models.asr_stream import AsrStream

    audio = speech_set[0].audio
    asr = AsrStream(asr_engine, partial_interval=8000)
    asr.begin(0)
    asr.push(audio[:16000], partial=False)  # a second of it, all in a pause
    assert asr._partial is None
    asr.push(audio[16000:16320])  # the voice resumes
    assert asr._partial is not None and asr._partial.end == 16320
    asr.cancel()


async def test_no_partial_pass_starts_once_the_voice_has_stopped(vad_engine, asr_engine, speech_set):
    """A listener starts no partial pass once the VAD hears silence, before the pause is
    announced too: one started there covers too little past the words to be the final,
    and the final waited behind it. Partial passes run while the voice goes on."""
    listener = Listener(vad_engine, asr_engine, partial_interval_ms=200)
    audio = np.concatenate([speech_set[0].audio, np.zeros(16000, np.int16)])
    during_voice = in_silence = 0
    try:
        for i in range(0, audio.size, 320):
            silent = listener.speaking and listener.vad.pause is not None
            await listener.push(audio[i : i + 320])
            started = listener.asr._partial is not None  # none was pending: the last push waited for it
            during_voice += started and not silent
            in_silence += started and silent
            await listener.asr.idle()  # lockstep: each pass done before the next audio
    finally:
        listener.close()
    assert during_voice >= 3  # ~2 s of voice, a pass every 200 ms of it
    assert in_silence == 0


def long_audio(speech_set) -> np.ndarray:
    """Over 10 s of speech as the worker takes it (float): dozens of decoding steps."""
    audio = np.concatenate([u.audio for u in list(speech_set)[:5]]).astype(np.float32) / 32768
    assert audio.size > 10 * 16000
    return audio


async def begun(engine, job) -> None:
    """Submit a pass and wait until the worker runs it."""
    engine.submit(job)
    for _ in range(500):
        if job in engine._running:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the pass did not begin")


@pytest.mark.parametrize("taken_as_final", [False, True])
async def test_a_final_runs_between_the_steps_of_a_partial_pass(asr_engine, speech_set, taken_as_final):
    """A final queued while a long partial pass decodes runs at the partial's next step
    and is delivered first; both get the words they get alone. A partial that a pause
    took as its final (`AsrStream.pause`) is that final, and lets none run ahead."""
    from models.asr_queue import Job as _Job
    from models.asr_types import Window as _Window

    long = long_audio(speech_set)
    short = speech_set[6].audio
    partial_alone = asr_engine.transcribe_batch([_Window(long, 0, [], [])])[0].text
    final_alone = asr_engine.transcribe(short)
    partial = _Job(long, 0, [], False, asyncio.get_running_loop())
    partial.taken_as_final = taken_as_final
    ahead = asr_engine.finals_ahead
    await begun(asr_engine, partial)
    final = asyncio.ensure_future(asr_engine.transcribe_queued(short))
    order: list[str] = []
    partial.future.add_done_callback(lambda _: order.append("partial"))
    final.add_done_callback(lambda _: order.append("final"))
    assert await final == final_alone and (await partial.future).text == partial_alone
    assert order == (["partial", "final"] if taken_as_final else ["final", "partial"])
    assert asr_engine.finals_ahead - ahead == int(not taken_as_final)


async def test_a_pass_cancelled_while_it_runs_stops_at_its_next_step(asr_engine, speech_set):
    """A partial pass whose stream no longer wants it (its final superseded it) stops
    between two decoding steps instead of decoding on for nobody: its future is
    cancelled (delivered, it would have a result), and nothing is logged."""
    from models.asr_queue import Job as _Job

    partial = _Job(long_audio(speech_set), 0, [], False, asyncio.get_running_loop())
    await begun(asr_engine, partial)
    partial.cancelled = True
    await asyncio.wait([partial.future], timeout=30)
    assert partial.future.cancelled()
