"""`WhisperDecoder` against CTranslate2's own decoder, on the bundled tiny.en and our TTS's speech."""

import numpy as np
import pytest

from models.asr_types import SAMPLE_RATE

pytestmark = pytest.mark.background  # no pace: beside the paced tests in make test (tests/lanes.py)


@pytest.fixture(scope="module")
def reference(asr_engine):
    """CTranslate2's Whisper on the same weights, computing in float32 as ours does."""
    from faster_whisper import WhisperModel

    from models.bundled import BUNDLED

    return WhisperModel(str(BUNDLED["asr"].locate()), compute_type="float32", cpu_threads=1)


def encoded(asr_engine, audio: np.ndarray) -> np.ndarray:
    pcm = audio.astype(np.float32) / 32768 if audio.dtype == np.int16 else audio
    return asr_engine.encode_audio(pcm)[0]


def theirs(asr_engine, reference, states: np.ndarray, prompt: list[int], max_length: int):
    (result,) = reference.model.generate(
        asr_engine.completed(states), [prompt], beam_size=1, max_length=max_length, return_no_speech_prob=True
    )
    return [t for t in result.sequences_ids[0] if t < asr_engine.tokenizer.eot], result.no_speech_prob


def limit(prompt: list[int], audio: np.ndarray) -> int:
    return len(prompt) + int(8 * audio.size / SAMPLE_RATE) + 16


def test_it_decodes_what_ctranslate2_decodes(asr_engine, reference, speech_set):
    """The same tokens and no-speech probability (asked only without a forced prefix),
    with and without previous text and a forced prefix, one window at a time and all
    together."""
    tokenizer = asr_engine.tokenizer
    previous = tokenizer.encode(" We spoke about the weather earlier.")
    cases = []
    for i, utterance in enumerate(list(speech_set)[:8]):
        states = encoded(asr_engine, utterance.audio)
        prompt = asr_engine.prompt(previous if i % 2 else [])
        plain, _ = theirs(asr_engine, reference, states, prompt, limit(prompt, utterance.audio))
        prompt += plain[: i % 4]  # a committed prefix of 0-3 tokens
        cases.append((states, prompt, limit(prompt, utterance.audio)))
    expected = [theirs(asr_engine, reference, *case) for case in cases]
    alone = [asr_engine.decoder.generate([case])[0] for case in cases]
    together = asr_engine.decoder.generate(cases)
    assert len(expected) == 8 and all(tokens for tokens, _ in expected)
    for i, ((tokens, no_speech), one, batched) in enumerate(zip(expected, alone, together, strict=True)):
        assert one.tokens == tokens, (tokenizer.decode(one.tokens), tokenizer.decode(tokens))
        assert batched.tokens == tokens
        if i % 4:  # a forced prefix: words were heard, and no one asks if it was silence
            assert one.no_speech_prob is None and batched.no_speech_prob is None
        else:
            assert one.no_speech_prob == pytest.approx(no_speech, abs=2e-3)
            assert batched.no_speech_prob == pytest.approx(no_speech, abs=2e-3)


def test_it_stops_where_ctranslate2_stops(asr_engine, reference, speech_set):
    """``max_length`` counts as CTranslate2 counts it (the prompt, then half of it at most
    for new tokens), so a short limit cuts the text at the same token."""
    audio = max(speech_set, key=lambda u: u.audio.size).audio
    states = encoded(asr_engine, audio)
    prompt = asr_engine.prompt([])
    for max_length in (6, 9, 14):
        tokens, _ = theirs(asr_engine, reference, states, prompt, max_length)
        assert asr_engine.decoder.generate([(states, prompt, max_length)])[0].tokens == tokens
        assert len(tokens) < len(theirs(asr_engine, reference, states, prompt, 60)[0])


def test_silence_is_no_speech_as_ctranslate2_says(asr_engine, reference):
    noise = np.random.default_rng(7).normal(0, 30, SAMPLE_RATE * 2).astype(np.int16)
    states = encoded(asr_engine, noise)
    prompt = asr_engine.prompt([])
    _, no_speech = theirs(asr_engine, reference, states, prompt, 40)
    ours = asr_engine.decoder.generate([(states, prompt, 40)])[0]
    assert ours.no_speech_prob == pytest.approx(no_speech, abs=2e-3)
    assert ours.no_speech_prob > 0.6  # the pass's threshold: this is dropped as silence


def test_impossible_windows_are_refused(asr_engine):
    prompt = asr_engine.prompt([])
    too_long = np.zeros((1501, asr_engine.decoder.width), np.float32)
    with pytest.raises(ValueError, match="encoder positions"):
        asr_engine.decoder.generate([(too_long, prompt, 40)])
    with pytest.raises(ValueError, match="no step"):
        asr_engine.decoder.generate([(too_long[:10], prompt, 1)])
    with pytest.raises(ValueError, match="no step"):  # past Whisper's 448 positions
        asr_engine.decoder.generate([(too_long[:10], prompt + [220] * 446, 1000)])


def test_weights_of_any_conversion_read_as_float32():
    """float16 as shipped, and what `ct2-transformers-converter --quantization` writes:
    bfloat16, and int8 with a scale per row (round(w * 127 / max|row|))."""
    from models.whisper_decoder import as_float32

    w = np.random.default_rng(3).normal(0, 0.05, (6, 8)).astype(np.float32)
    scale = (127 / np.abs(w).max(axis=1)).astype(np.float32)
    weights = {
        "half": w.astype(np.float16),
        "bf16": (w.view(np.uint32) >> 16).astype(np.uint16),
        "q": np.rint(w * scale[:, None]).astype(np.int8),
        "q_scale": scale,
    }
    assert np.allclose(as_float32(weights, "half"), w, atol=1e-4)
    assert np.allclose(as_float32(weights, "bf16"), w, rtol=1e-2, atol=1e-6)
    assert np.allclose(as_float32(weights, "q"), w, atol=float((0.5 / scale).max()) + 1e-7)
    assert as_float32(weights, "q").dtype == np.float32


def test_a_few_rows_are_multiplied_row_by_row_with_the_same_result():
    from models.whisper_decoder import ROW_BY_ROW, _product

    rng = np.random.default_rng(3)
    w = rng.standard_normal((384, 1152)).astype(np.float32)
    sizes = range(1, ROW_BY_ROW + 3)
    for m in sizes:
        x = rng.standard_normal((m, 384)).astype(np.float32)
        out = _product(x, w)
        assert out.shape == (m, 1152) and out.dtype == np.float32
        np.testing.assert_allclose(out, x @ w, rtol=1e-5, atol=1e-4)
    assert len(sizes) > ROW_BY_ROW  # both ways were taken


def test_a_draft_changes_the_steps_taken_not_the_text(asr_engine, speech_set, monkeypatch):
    """A draft (the last pass's words) goes through with the prompt and is kept only
    where greedy decoding picks its tokens: right, wrong, cut short, too long or
    nonsense, the tokens are those decoded without one, alone and in a batch; a right
    draft leaves no step to take."""
    decoder = asr_engine.decoder
    steps = []
    forward = decoder._forward

    def counted(x, rows, prompt_rows):
        if not prompt_rows:
            steps.append(len(rows))
        return forward(x, rows, prompt_rows)

    monkeypatch.setattr(decoder, "_forward", counted)
    cases, plains = [], []
    for utterance in list(speech_set)[:4]:
        states = encoded(asr_engine, utterance.audio)
        prompt = asr_engine.prompt([])
        case = (states, prompt, limit(prompt, utterance.audio))
        steps.clear()
        plain = decoder.generate([case])[0].tokens
        assert len(steps) == len(plain)  # one step a token after the first, and one for the end
        cases.append(case)
        plains.append(plain)  # no prefix: the whole result is what a draft guesses
    assert len(cases) == 4 and all(plains)
    wrong = asr_engine.tokenizer.encode(" Completely different words here")
    for case, plain in zip(cases, plains, strict=True):
        steps.clear()
        assert decoder.generate([case], [plain])[0].tokens == plain
        assert steps == []  # every token, and the end, checked in the prompt's pass
        others: list[list[int]] = [plain[:3] + wrong, wrong, plain[:-1], plain + wrong, []]
        for draft in others:
            assert decoder.generate([case], [draft])[0].tokens == plain
    drafts = [plains[0], plains[1][:2] + wrong, wrong, []]
    assert [d.tokens for d in decoder.generate(cases, drafts)] == plains
