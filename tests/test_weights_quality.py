"""The service's LLM weights (as `auto` runs them on this CPU) against the same model in bf16:
greedy replies to 12 fixed prompts, without speech in the loop."""

import pytest

from benchmarks.quality import PROMPTS, agreement, greedy_replies, looks_english

pytestmark = pytest.mark.background  # no pace: beside the paced tests in make test (tests/lanes.py)


def test_the_english_check_tells_english_from_other_text():
    assert looks_english("The capital of France is Paris.")
    assert looks_english("Bees make honey and wax in their hives.")
    assert not looks_english("")
    assert not looks_english("L'Étoile, la Marseillaise, le drapeau de la République.")
    assert not looks_english("日本の首都は東京です。")
    assert not looks_english("complex complex complex complex")


def test_agreement_counts_exact_and_opening_matches():
    result = agreement(
        ["The sky is blue.", "Paris is the capital.", "", "I do not know."],
        ["The sky is blue.", "Paris is the capital of France.", "Yes.", "Mon Dieu"],
    )
    assert (result.exact, result.same_opening, result.non_empty, result.english) == (1, 2, 3, 3)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_replies_agree_with_bf16_and_are_english(llm_engine):
    from models.cache import default_cache_dir
    from models.llm import LlmConfig, LlmEngine
    from models.prepare import ModelChoice, prepare

    replies = await greedy_replies(llm_engine)
    (full,) = prepare([ModelChoice("llm", None, "none")], default_cache_dir(), progress=False)
    config = llm_engine.config
    reference = LlmEngine(
        LlmConfig(
            model=full.path,
            dtype="bfloat16",
            max_model_len=config.max_model_len,
            max_tokens=config.max_tokens,
            enforce_eager=True,  # a reference: not worth a compile of its own (minutes on 2 cores)
        )
    )
    await reference.start()
    try:
        expected = await greedy_replies(reference)
    finally:
        reference.shutdown()
    result = agreement(replies, expected)
    print(result, *zip(PROMPTS, replies, expected, strict=True), sep="\n")
    assert result.non_empty == result.english == len(PROMPTS), replies
    assert "Paris" in replies[0]
    assert result.same_opening >= len(PROMPTS) // 2, (replies, expected)
