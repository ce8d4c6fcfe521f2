"""Streaming TTS with the bundled piper voice."""

import asyncio
import re

import numpy as np
import pytest

from audio_io.frame import AudioFrame
from models.tts import TtsEngine, WordMark

FIRST = "Sure, I can help with that."
REPLY = f"{FIRST} The weather in Boston tomorrow will be sunny, with a high of seventy degrees."


async def collect(tts_engine: TtsEngine, text: str, step: int = 5) -> tuple[list[WordMark], list[AudioFrame]]:
    stream = tts_engine.stream()

    async def feed() -> None:
        for i in range(0, len(text), step):
            stream.push_text(text[i : i + step])
            await asyncio.sleep(0)
        stream.end_text()

    feeder = asyncio.create_task(feed())
    marks: list[WordMark] = []
    frames: list[AudioFrame] = []
    async for item in stream.frames():
        if isinstance(item, WordMark):
            marks.append(item)
        else:
            frames.append(item)
    await feeder
    return marks, frames


async def test_frames_are_20ms_at_the_voice_rate(tts_engine):
    _, frames = await collect(tts_engine, REPLY)
    assert frames and all(f.sample_rate == 22050 and f.num_samples == 441 for f in frames)
    audio = np.concatenate([f.samples for f in frames])
    assert np.abs(audio).max() > 3000  # speech, not silence


async def test_marks_are_monotonic_and_cover_every_word(tts_engine):
    marks, frames = await collect(tts_engine, REPLY)
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", REPLY)]
    assert [(m.char_start, m.char_end) for m in marks] == words
    total = sum(f.num_samples for f in frames)
    previous_end = 0
    for mark in marks:
        assert previous_end <= mark.sample_start <= mark.sample_end <= total
        previous_end = mark.sample_end


async def test_streamed_deltas_give_the_same_audio_as_one_push(tts_engine):
    """The same phrases, the same audio. Whether a first phrase is decoded in spans or
    whole depends on what else waits for the engine (other turns' first phrases), not on
    the text's deltas, so the samples are compared within the spans' bound, not to the bit
    (to the bit, this test raced the engine before first phrases had their own worker)."""
    _, a = await collect(tts_engine, REPLY, step=3)
    _, b = await collect(tts_engine, REPLY, step=1000)
    ours, theirs = (np.concatenate([f.samples for f in x]).astype(np.int32) for x in (a, b))
    assert ours.size == theirs.size
    assert np.abs(ours - theirs).max() <= 100, "within 0.3% of full scale, as spans are"


async def test_cancel_stops_output_at_once_and_nothing_leaks(tts_engine):
    stream = tts_engine.stream()
    stream.push_text(REPLY * 3)
    stream.end_text()
    frames_after_cancel = 0
    received = 0
    cancelled = False
    async for item in stream.frames():
        if cancelled:
            frames_after_cancel += 1
        if isinstance(item, AudioFrame):
            received += 1
            if received == 5:
                stream.cancel()
                cancelled = True
    assert cancelled and frames_after_cancel == 0
    # the engine dropped the queued phrases: a new stream is served promptly and correctly
    marks, frames = await collect(tts_engine, "Okay.")
    assert len(marks) == 1 and frames


async def test_first_phrases_jump_the_queue(tts_engine):
    sentence = "This is a long sentence that keeps the engine busy. "
    busy = tts_engine.stream()
    busy.push_text(sentence * 6)  # phrases queued: "This is a long", then whole sentences
    quick = tts_engine.stream()
    quick.push_text("Yes. ")
    quick.end_text()
    events: list[tuple[str, int]] = []

    async def watch(name: str, stream) -> None:
        async for item in stream.frames():
            if isinstance(item, WordMark):
                events.append((name, item.char_start))
            elif name == "quick":
                events.append(("quick-audio", 0))
                return

    await asyncio.gather(watch("busy", busy), watch("quick", quick), _cancel_later(busy))
    quick_at = events.index(("quick-audio", 0))
    # before quick's audio, busy got at most its first phrase and the one already in synthesis
    busy_marks_before = [c for name, c in events[:quick_at] if name == "busy"]
    assert busy_marks_before, events  # busy started first: some of it came before quick's audio
    assert max(busy_marks_before) < 2 * len(sentence)


async def test_a_first_phrase_does_not_wait_for_a_later_phrase_in_synthesis(tts_engine):
    """Turns' first phrases have a worker of their own: one submitted while another
    turn's long later phrase is being decoded comes out before it (with one worker for
    both, it waited for that phrase to end)."""
    from models.tts import _Job

    loop = asyncio.get_running_loop()
    later = _Job(" ".join(["and then the story went on and on through the night"] * 3) + ".", False, loop)
    first = _Job("Yes, sure.", True, loop)
    tts_engine.submit(later)
    await asyncio.sleep(0.02)  # the later phrase is in synthesis by then
    tts_engine.submit(first)
    order: list[str] = []

    async def drain(name: str, job: _Job) -> None:
        while (piece := await job.pieces.get()) is not None:
            assert not isinstance(piece, BaseException)
            order.append(name)

    await asyncio.gather(drain("later", later), drain("first", first))
    assert order.count("later") == 1 and order.count("first") >= 2  # decoded whole; in spans
    assert order[0] == "first" and order[-1] == "later", order


async def _cancel_later(stream) -> None:
    await asyncio.sleep(2.0)
    stream.cancel()


async def test_empty_and_odd_text(tts_engine):
    """Empty text (or only whitespace) says nothing: no marks, no frames. Odd text (only
    punctuation; accents, an emoji and markup) is spoken all the same: 20 ms frames at the
    voice rate with sound in them, and a mark for each of its words. The engine lives on."""
    for text in ("", "   "):
        assert await collect(tts_engine, text) == ([], []), repr(text)
    for text in ("... !!! ???", "Zażółć gęślą jaźń 🙂 <script>alert(1)</script>"):
        marks, frames = await collect(tts_engine, text)
        assert frames, f"no audio for {text!r}"  # `all` below would hold for none
        assert all(isinstance(f, AudioFrame) for f in frames)
        assert all(f.sample_rate == tts_engine.sample_rate for f in frames)
        assert all(f.num_samples == tts_engine.frame_samples for f in frames)
        assert np.abs(np.concatenate([f.samples for f in frames])).max() > 3000, text  # not silence
        words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        assert [(m.char_start, m.char_end) for m in marks] == words, text
    assert tts_engine.alive


async def test_push_after_end_is_a_bug(tts_engine):
    stream = tts_engine.stream()
    stream.end_text()
    with pytest.raises(AssertionError, match="after end_text"):
        stream.push_text("more")


def test_the_voice_sounds_as_piper_loads_it(tts_engine):
    """The engine runs the voice in two parts, a first phrase's decoder in spans with
    context around each (`models.voice_parts`): the samples are those of piper's own
    loader, which runs the graph whole, at the engine's gain."""
    from piper import PiperVoice

    from models.bundled import BUNDLED
    from models.tts import FIRST_FRAMES

    assert tts_engine.parts is not None, "the bundled voice splits"
    piper = PiperVoice.load(str(BUNDLED["voice"].locate()))
    compared = 0
    for text in (FIRST, REPLY):
        pieces = list(tts_engine.pieces(text, FIRST_FRAMES))
        assert len(pieces) >= 2  # the first sentence in spans
        ours = np.concatenate([p.audio for p in pieces]).astype(np.int32)
        raw = np.concatenate([c.audio_float_array for c in piper.synthesize(text, tts_engine._syn_config)])
        theirs = tts_engine._pcm(raw).astype(np.int32)
        assert ours.size == theirs.size
        assert np.abs(ours - theirs).max() <= 100, "within 0.3% of full scale (0.16% measured)"
        compared += 1
    assert compared == 2


def test_a_first_phrase_comes_in_pieces_with_its_words_first(tts_engine):
    from models.tts import FIRST_FRAMES

    text = "The capital of France is Paris."
    pieces = list(tts_engine.pieces(text, FIRST_FRAMES))
    hop = tts_engine.voice.config.hop_length
    assert pieces[0].audio.size == FIRST_FRAMES * hop  # 186 ms, decoded alone
    assert [p.words is not None for p in pieces] == [True] + [False] * (len(pieces) - 1)
    words = pieces[0].words
    assert [text[c0:c1] for c0, c1, _, _ in words] == text.split()
    total = sum(p.audio.size for p in pieces)
    ends = [0] + [s1 for _, _, _, s1 in words]
    starts = [s0 for _, _, s0, _ in words]
    assert all(a <= b for a, b in zip(ends, starts, strict=False)), words  # in order, apart
    assert all(s0 < s1 for _, _, s0, s1 in words), words
    assert ends[-1] <= total
    # the words' places are the phonemes' frames: "Paris." ends in the phrase's last 250 ms
    assert total - ends[-1] < tts_engine.sample_rate // 4
    # later phrases are decoded whole
    assert len(list(tts_engine.pieces(text))) == 1


def test_a_cut_phrase_stops_decoding(tts_engine):
    import threading

    from models.tts import FIRST_FRAMES

    stop = threading.Event()
    pieces = tts_engine.pieces("The capital of France is Paris.", FIRST_FRAMES, stop)
    first = next(pieces)
    assert first.audio.size and first.words
    stop.set()
    assert list(pieces) == []  # nothing more is decoded


def test_words_espeak_reads_otherwise_are_estimated(tts_engine):
    """ "42" is two words to espeak: the phrase's words are estimated over its phonemes."""
    text = "Call 42 now."
    words = tts_engine.synthesize(text).words
    assert [text[c0:c1] for c0, c1, _, _ in words] == ["Call", "42", "now."]
    assert [w[3] for w in words[:-1]] == [w[2] for w in words[1:]]  # estimates tile the span


def test_a_voice_that_does_not_split_runs_whole():
    from models.bundled import BUNDLED
    from models.tts import FIRST_FRAMES

    engine = TtsEngine(BUNDLED["voice"].locate(), deterministic=True, split=False)
    try:
        assert engine.parts is None
        pieces = list(engine.pieces(FIRST, FIRST_FRAMES))
        assert len(pieces) == 1 and pieces[0].words is not None
        assert [FIRST[c0:c1] for c0, c1, _, _ in pieces[0].words] == FIRST.split()
    finally:
        engine.close()
