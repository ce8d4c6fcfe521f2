"""Which LLM variant `auto` runs, by the CPU's flags: pure functions, no engine."""

import json

import pytest

from benchmarks.quality import PROMPTS, facts_kept, is_correct
from models.cpu_variant import MEASURED, SAFE, LlmVariant, choose, cpu_description, cpu_kind
from models.quantize import QUANTIZATIONS, weights_of

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
AVX2 = frozenset({"avx2", "fma", "f16c"})
SKYLAKE = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})  # AVX-512 without BF16


def test_the_kind_of_cpu_is_read_from_its_flags():
    assert cpu_kind(AMX) == "amx"
    assert cpu_kind(ZEN4) == "avx512_bf16"
    assert cpu_kind(AVX2) == "avx2"
    assert cpu_kind(AMX - {"amx_int8"}) == "avx512_bf16"  # AMX only where all of it is enabled
    assert cpu_kind(SKYLAKE) == "other"  # vLLM's AVX-512 kernels without BF16: not measured
    assert cpu_kind(frozenset({"avx2"})) == cpu_kind(frozenset()) == "other"


def test_auto_is_the_fastest_measured_variant_and_elsewhere_the_safe_one():
    for kind, flags in (("amx", AMX), ("avx512_bf16", ZEN4), ("avx2", AVX2)):
        assert choose(flags=flags) == MEASURED[kind][0]
    # on AVX2 alone float32 was measured fastest; where nothing was measured, the safe one
    assert choose(flags=AVX2) == choose(flags=SKYLAKE) == SAFE == LlmVariant("none", "float32", "compiled")


def test_what_the_user_fixes_is_kept_and_the_rest_is_measured():
    assert choose("none", flags=AMX).weights == "none"
    assert choose("none", flags=AMX) in MEASURED["amx"]
    # eager bfloat16 with the full weights was never found right on AMX: float32 there
    assert choose("none", "auto", "eager", flags=AMX) == LlmVariant("none", "float32", "eager")
    # nothing measured fits: what was fixed, the safe parts for the rest
    assert choose("int4", flags=AVX2) == LlmVariant("int4", "bfloat16", "compiled")
    assert choose("none", "float16", flags=AVX2) == LlmVariant("none", "float16", "compiled")
    # int8 lost a fact on AVX2 (compiled): not offered there unless asked for
    assert all(v.weights == "none" for v in MEASURED["avx2"])
    for variants in MEASURED.values():
        for variant in variants:
            assert choose(*variant.astuple(), flags=AMX) == variant  # all fixed: exactly that


def test_measured_variants_are_well_formed():
    assert {"amx", "avx512_bf16", "avx2"} <= MEASURED.keys() and all(MEASURED.values())
    for variants in MEASURED.values():
        assert len(set(variants)) == len(variants)
        for v in variants:
            assert v.weights in ("none", *QUANTIZATIONS) and v.execution in ("compiled", "eager")
            assert v.dtype in ("float32", "bfloat16", "float16")
            assert v.weights == "none" or v.dtype == "bfloat16"  # vLLM's quantized CPU kernels


def test_this_cpu_is_described_for_the_record():
    described = cpu_description()
    assert described["model"] and described["kind"] in ("amx", "avx512_bf16", "avx2", "other")
    assert (
        isinstance(described["flags"], list)
        and isinstance(described["cores"], int)
        and described["cores"] >= 1
    )
    json.dumps(described)


@pytest.mark.parametrize("name", list(QUANTIZATIONS))
def test_the_weights_of_a_directory_are_read_from_its_config(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": QUANTIZATIONS[name]}))
    assert weights_of(tmp_path) == name


def test_full_weights_and_unreadable_directories_are_none(tmp_path):
    assert weights_of(tmp_path) == "none"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert weights_of(tmp_path) == "none"
    (tmp_path / "config.json").write_text("{not json")
    assert weights_of(tmp_path) == "none"
    assert weights_of("HuggingFaceTB/SmolLM2-135M-Instruct") == "none"


def test_a_variant_is_correct_only_if_it_keeps_every_fact_in_english():
    reference = ["The capital of France is Paris."] + ["A week has seven days."] + ["They make honey."] * 10
    assert facts_kept(reference) == 3
    assert is_correct(reference, reference)
    lost = ["The capital of France is Lyon."] + reference[1:]
    assert not is_correct(lost, reference)
    foreign = ["L'Étoile, la Marseillaise, Paris."] + reference[1:]
    assert not is_correct(foreign, reference)
    empty = [""] + reference[1:]
    assert not is_correct(empty, reference)
    reworded = ["Paris is the capital of France."] + reference[1:]
    assert is_correct(reworded, reference)
    assert len(PROMPTS) == len(reference)
