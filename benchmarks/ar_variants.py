"""``duplex bench ar-variants``: every way the service can run the LLM on this CPU,
measured alike, so that ``auto`` (`models.cpu_variant`) can be chosen from figures.

Variants: the weights (full, int8 W8A8, the 4-bit GPTQ checkpoint: `models.quantize`)
times the activations' dtype (float32, bfloat16, float16 for full weights; bfloat16 for
quantized ones) times compiled or eager execution. Each variant's engine is started
alone (its compiled graph built first if need be, outside the figures), then measured
as ``duplex bench ar-cpu`` measures vLLM (`benchmarks.ar_cpu.measure_vllm`):

- ``decode_tok_s``, ``ttft_ms`` (40 and 400 prompt tokens) and ``batched_8_tok_s``;
- ``quality``: greedy replies to 12 fixed prompts (`benchmarks.quality`) against the
  float32 compiled variant's (the reference: full weights, full precision), with the
  facts each reply must carry (Paris, seven, honey, ...);
- ``correct``: every reply non-empty English, and no fact lost against the reference
  (`quality.is_correct`);
- ``speedup``: against the reference, the geometric mean of the four ratios (decode,
  8 batched, and the inverse of each TTFT). Decode alone misleads: float16 on a CPU
  without AVX512-FP16 decodes one sequence as fast as bfloat16 and prefills 9x slower;
  a voice service waits on the first token and serves many callers at once;
- ``error``: a variant that would not start or failed is recorded as such, not skipped.

The result names the CPU (model and the flags that decide vLLM's kernels), the variant
`auto` picks here, and the correct ones by speedup, best first: what `MEASURED` in
`models.cpu_variant` holds for this kind of CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.ar_cpu import Vllm, measure_vllm
from benchmarks.common import bench_main, new_plot, save_plot
from benchmarks.quality import agreement, facts_kept, greedy_replies, is_correct
from models.cache import configure_engine_caches, default_cache_dir
from models.cpu_variant import LlmVariant, cpu_description, default_variant
from models.llm import LlmEngine
from models.prepare import ModelChoice, prepare

if TYPE_CHECKING:
    from duplex.config import Config

VARIANTS = tuple(
    LlmVariant(weights, dtype, execution)
    for weights, dtypes in (
        ("none", ("float32", "bfloat16", "float16")),
        ("int8", ("bfloat16",)),
        ("int4", ("bfloat16",)),
    )
    for dtype in dtypes
    for execution in ("compiled", "eager")
)
REFERENCE = LlmVariant("none", "float32", "compiled")


def speedup(result: dict[str, Any], reference: dict[str, Any]) -> float:
    """The geometric mean of a variant's gains over the reference: decode, 8 batched, and
    the first token after 40 and after 400 prompt tokens."""
    ratios = [
        result["decode_tok_s"] / reference["decode_tok_s"],
        result["batched_8_tok_s"] / reference["batched_8_tok_s"],
        *(reference["ttft_ms"][n] / result["ttft_ms"][n] for n in ("40", "400")),
    ]
    return round(math.prod(ratios) ** (1 / len(ratios)), 2)


async def _run_variant(config: Config, cache: Path, variant: LlmVariant, reps: int) -> dict[str, Any]:
    (llm,) = prepare([ModelChoice("llm", config.llm, variant.weights)], cache, progress=False)
    llm_config = dataclasses.replace(
        config.llm_config(llm.path), dtype=variant.dtype, enforce_eager=variant.execution == "eager"
    )
    started = time.perf_counter()
    engine = LlmEngine(llm_config)
    await engine.start()
    start_s = time.perf_counter() - started
    try:
        if not reps:  # a start only (a compiled variant's first builds its graph)
            return {"start_s": round(start_s, 1)}
        figures = await measure_vllm(Vllm(engine), engine.tokenizer, reps)
        replies = await greedy_replies(engine)
    finally:
        engine.shutdown()
    return {
        "start_s": round(start_s, 1),
        "decode_tok_s": figures["decode"],
        "ttft_ms": {"40": figures["ttft_40"], "400": figures["ttft_400"]},
        "batched_8_tok_s": figures["batched_8"],
        "replies": replies,
    }


def bench_ar_variants(config: Config, quick: bool = False, only: list[str] | None = None) -> dict[str, Any]:
    cache = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir)
    configure_engine_caches(cache)
    # the reference first, always: the others are judged against it as they come
    variants = [REFERENCE, *(v for v in VARIANTS if v != REFERENCE and (not only or v.name in only))]
    results: dict[str, dict[str, Any]] = {}
    reference: dict[str, Any] = {}
    for variant in variants:
        print(f"variant {variant.name} ...", file=sys.stderr, flush=True)
        try:
            # a first start of a compiled variant builds its graph; figures come from a second
            if variant.execution == "compiled":
                asyncio.run(_run_variant(config, cache, variant, 0))
            result = asyncio.run(_run_variant(config, cache, variant, 1 if quick else 3))
        except Exception as e:  # a variant that fails here is a finding
            if variant == REFERENCE:
                raise SystemExit(f"the reference {variant.name} failed, nothing to judge against: {e}") from e
            results[variant.name] = {"error": f"{type(e).__name__}: {e}"[:500], "correct": False}
            print(f"variant {variant.name} failed: {e}", file=sys.stderr, flush=True)
            continue
        if variant == REFERENCE:
            reference = result
        result["quality"] = agreement(result["replies"], reference["replies"]).as_dict()
        result["facts"] = facts_kept(result["replies"])
        result["correct"] = is_correct(result["replies"], reference["replies"])
        result["speedup"] = speedup(result, reference)
        results[variant.name] = result
        print(
            f"variant {variant.name}: decode {result['decode_tok_s']} tok/s, ttft {result['ttft_ms']} ms, "
            f"8 batched {result['batched_8_tok_s']} tok/s, facts {result['facts']}, "
            f"correct {result['correct']}, speedup {result['speedup']}",
            file=sys.stderr,
            flush=True,
        )
    correct = sorted((r["speedup"], name) for name, r in results.items() if r.get("correct"))
    return {
        "cpu": cpu_description(),
        "reference": REFERENCE.name,
        "auto": default_variant().name,
        "correct_by_speedup": [name for _, name in reversed(correct)],
        "variants": results,
    }


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    only = [v for v in args.variants.split(",") if v.strip()]
    return bench_ar_variants(config, quick=args.quick, only=only)


def plot(result: dict[str, Any]) -> None:
    measured = {name: r for name, r in result["variants"].items() if "decode_tok_s" in r}
    fig, ax = new_plot()
    x = np.arange(len(measured))
    for offset, key, label in (
        (-0.2, "decode_tok_s", "decode, 1 sequence"),
        (0.2, "batched_8_tok_s", "8 batched / 8"),
    ):
        scale = 8 if key == "batched_8_tok_s" else 1
        ax.bar(x + offset, [r[key] / scale for r in measured.values()], width=0.4, label=label)
    names = [name + ("" if r["correct"] else " (wrong)") for name, r in measured.items()]
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
    cpu = result["cpu"]
    save_plot(
        fig, ax, "ar_variants", f"LLM variants on {cpu['model']} ({cpu['kind']})", "tokens/s per sequence"
    )


if __name__ == "__main__":
    bench_main("ar-variants", measure, plot)
