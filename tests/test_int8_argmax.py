"""`Int8Argmax`: the float32 argmax, found reading int8 weights; on made-up matrices with
near ties and on Whisper's own vocabulary projection."""

import numpy as np

from models.int8_argmax import Int8Argmax


def float32_argmax(weights: np.ndarray, x: np.ndarray, banned: np.ndarray) -> np.ndarray:
    logits = x @ weights.T
    logits[:, banned] = -np.inf
    return logits.argmax(-1)


def test_it_picks_the_float32_argmax_with_banned_rows_left_out():
    rng = np.random.default_rng(7)
    weights = (rng.standard_normal((5000, 64)) * rng.uniform(0.01, 1, (5000, 1))).astype(np.float32)
    weights[17] = 0  # a row of zeros (its scale must not divide by zero)
    argmax = Int8Argmax(weights)
    banned = np.array([3, 99, 4000])
    for rows in (1, 3):
        for _ in range(50):
            x = (rng.standard_normal((rows, 64)) * rng.uniform(0.1, 10)).astype(np.float32)
            assert (argmax.argmax(x, banned) == float32_argmax(weights, x, banned)).all()
    assert argmax.candidates < 0.05 * 100 * 5000  # a screen: few rows were computed in float32


def test_near_ties_are_decided_in_float32():
    """Rows that int8 cannot tell apart (they round to the same int8 row), and one row
    best for x that the others are made to win when banned."""
    rng = np.random.default_rng(8)
    base = rng.standard_normal(32).astype(np.float32)
    weights = rng.standard_normal((300, 32)).astype(np.float32) * 0.1
    for i, eps in enumerate((0.0, 1e-4, 2e-4, 3e-4)):  # 10-13: base, nudged a little further along x
        weights[10 + i] = base + eps * base
    argmax = Int8Argmax(weights)
    x = base[None] * 3
    none = np.array([], np.int64)
    assert argmax.argmax(x, none)[0] == float32_argmax(weights, x, none)[0] == 13
    assert argmax.argmax(x, np.array([13]))[0] == 12
    assert argmax.argmax(x, np.array([12, 13]))[0] == 11
    equal = weights.copy()
    equal[11] = equal[10]  # an exact tie: the lower index, as numpy's argmax
    assert Int8Argmax(equal).argmax(x, np.array([12, 13]))[0] == 10


def test_whisper_steps_pick_what_float32_picks(asr_engine, speech_set):
    """In the decoder's own steps on real speech (Whisper's suppressed tokens left out,
    more of them at the first step), each token is the float32 logits' argmax; and
    with the steps' hidden states disturbed, still."""
    decoder = asr_engine.decoder
    vocabulary = decoder.vocabulary
    steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    screened = vocabulary.argmax

    def recorded(x: np.ndarray, banned: np.ndarray) -> np.ndarray:
        best = screened(x, banned)
        steps.append((x.copy(), banned, best))
        return best

    vocabulary.argmax = recorded
    try:
        for utterance in list(speech_set)[:4]:
            encoded = asr_engine.encode_audio(utterance.audio.astype(np.float32) / 32768)[0]
            prompt = asr_engine.prompt([])
            decoder.generate([(encoded, prompt, len(prompt) + 40)])
    finally:
        del vocabulary.argmax
    assert len(steps) > 20 and any(len(b) > len(decoder.suppress) for _, b, _ in steps)
    rng = np.random.default_rng(9)
    before = vocabulary.candidates
    for x, banned, best in steps:
        assert (best == float32_argmax(vocabulary.weights, x, banned)).all()
        noisy = x + rng.standard_normal(x.shape).astype(np.float32) * 0.3
        assert (vocabulary.argmax(noisy, banned) == float32_argmax(vocabulary.weights, noisy, banned)).all()
    assert vocabulary.candidates - before < 0.01 * len(steps) * vocabulary.weights.shape[0]
