"""``duplex bench ar``: the AR stage on vLLM, as a conversation uses it.

- ``ttft_ms_by_turn``: time to first token at each turn of a 20-turn conversation,
  with KV reuse on (the session's stream keeps its KV, as in service) and off (every
  turn a new request on a second engine started without prefix caching: the whole
  history is prefilled every turn).
- ``eot_to_first_token_ms``: a 40-word utterance, from the end of the turn to the first
  token, with its words prefilled while "spoken" (incremental) and without (full);
  ``eot_prefill_tokens``: what vLLM computed for that last step (its own counters).
- ``decode_tok_s``: generated tokens per second per session, 1, 4 and 8 at once.
- ``startup_s``: engine start, first in this process (cold) and again (warm).
- ``abort_ms``: from `Conversation.abort` to the end of the reply's stream.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import bench_main, new_plot, percentiles, save_plot, sessions_of
from models.cache import configure_engine_caches, default_cache_dir
from models.conversation import Conversation
from models.llm import LlmConfig, LlmEngine
from models.prepare import ModelChoice, prepare

if TYPE_CHECKING:
    from duplex.config import Config

QUESTIONS = (
    "Hi there!",
    "What is the capital of France?",
    "And of Spain?",
    "Name a big river in Europe.",
    "How long is it?",
    "What is two plus two?",
    "Tell me a color.",
    "What is the weather like in spring?",
    "Name an animal that can fly.",
    "What do bees make?",
    "Say something kind.",
    "What is a noun?",
    "Name a fruit.",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "What is ice?",
    "Name a musical instrument.",
    "What do we call a baby dog?",
    "What is the sun?",
    "Thank you, goodbye!",
)
WORDS_40 = (
    "I am planning a trip to Italy next summer with my whole family and we would love to see Rome "
    "and the old town of Florence, but my mother cannot walk very far, so could you suggest a calm "
    "route with short days and good hotels near the train stations?"
)


async def _ttft_by_turn(engine: LlmEngine) -> list[float]:
    conversation = Conversation(engine)
    out = []
    for question in QUESTIONS:
        if not engine.prefix_caching:
            conversation.close()  # a new request each turn: nothing reused
        async for _ in conversation.reply(question):
            pass
        assert conversation.last.first_token_s is not None
        out.append(round(conversation.last.first_token_s * 1000, 1))
    return out


async def _eot(engine: LlmEngine, incremental: bool, run: int) -> tuple[float, int]:
    conversation = Conversation(engine)
    # a first turn of its own, so that no other run's KV of the 40 words is in the cache
    async for _ in conversation.reply(f"Hello there, this is call number {run}."):
        pass
    words = WORDS_40.split()
    if incremental:
        for n in range(1, len(words)):
            await conversation.prefill(" ".join(words[:n]))
    before = engine.counters.prefill_tokens
    async for _ in conversation.reply(WORDS_40):
        break  # the first token is all we time
    prefilled = engine.counters.prefill_tokens - before
    await conversation.abort()
    assert conversation.last.first_token_s is not None
    return conversation.last.first_token_s * 1000, prefilled


async def _decode(engine: LlmEngine, sessions: int, tokens: int = 48) -> float:
    async def one(i: int) -> tuple[float, int]:
        conversation = Conversation(engine)
        prompt = conversation.prompt_for(f"Count from {i} upwards.")
        first: float | None = None
        count = 0
        async for delta in engine.generate(f"bench-decode-{sessions}-{i}", prompt, tokens, ignore_eos=True):
            if first is None:
                first = time.perf_counter()
            count += len(delta.token_ids)
        assert first is not None
        return time.perf_counter() - first, count - 1  # tokens after the first, over decode time

    results = await asyncio.gather(*(one(i) for i in range(sessions)))
    return round(sum(n / t for t, n in results) / sessions, 1)


async def _abort(engine: LlmEngine, runs: int = 5) -> list[float]:
    out = []
    for _ in range(runs):
        conversation = Conversation(engine)
        started = 0.0
        async for _ in conversation.reply("Tell me a very long story about a dragon."):
            if not started:
                started = time.perf_counter()
                await conversation.abort()
        out.append((time.perf_counter() - started) * 1000)
    return out


async def _measure(llm: LlmConfig, sessions: list[int], prefix_caching: bool, quick: bool) -> dict[str, Any]:
    engine = LlmEngine(replace(llm, max_tokens=48), prefix_caching)
    started = time.perf_counter()
    await engine.start()
    result: dict[str, Any] = {"startup_s": round(time.perf_counter() - started, 1)}
    try:
        result["ttft_ms_by_turn"] = await _ttft_by_turn(engine)
        if prefix_caching:
            reps = 1 if quick else 3
            result["eot_incremental"] = [await _eot(engine, True, 2 * i) for i in range(reps)]
            result["eot_full"] = [await _eot(engine, False, 2 * i + 1) for i in range(reps)]
            result["decode_tok_s"] = {str(n): await _decode(engine, n) for n in sessions}
            result["abort_ms"] = await _abort(engine)
    finally:
        engine.shutdown()
    return result


def bench_ar(config: Config, sessions: list[int], quick: bool = False) -> dict[str, Any]:
    cache = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir)
    configure_engine_caches(cache)
    model = prepare([ModelChoice("llm", config.llm, config.llm_quantization)], cache, progress=False)[0].path
    llm = config.llm_config(model)
    on = asyncio.run(_measure(llm, sessions, True, quick))
    off = asyncio.run(_measure(llm, sessions, False, quick))
    ttft_on, ttft_off = on["ttft_ms_by_turn"], off["ttft_ms_by_turn"]
    return {
        "ttft_ms_by_turn": {"prefix_on": ttft_on, "prefix_off": ttft_off},
        "ttft_turn20_over_turn1": {
            "prefix_on": round(ttft_on[-1] / ttft_on[0], 2),
            "prefix_off": round(ttft_off[-1] / ttft_off[0], 2),
        },
        "eot_to_first_token_ms": {
            "incremental": round(percentiles([t for t, _ in on["eot_incremental"]])["p50"] or 0, 1),
            "full": round(percentiles([t for t, _ in on["eot_full"]])["p50"] or 0, 1),
        },
        "eot_prefill_tokens": {
            "incremental": max(n for _, n in on["eot_incremental"]),
            "full": max(n for _, n in on["eot_full"]),
        },
        "decode_tok_s": on["decode_tok_s"],
        "startup_s": {"cold": on["startup_s"], "warm": off["startup_s"]},
        "abort_ms": percentiles(on["abort_ms"]),
        "method": "CPU eager engine, greedy, 48-token replies; warm start = the second engine of the "
        "process (prefix caching off), after the first was shut down",
    }


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_ar(config, sessions_of(args), quick=args.quick)


def plot(result: dict[str, Any]) -> None:
    fig, ax = new_plot()
    for key, label in (
        ("prefix_on", "KV reused (session stream)"),
        ("prefix_off", "no reuse (new request, no prefix cache)"),
    ):
        values = result["ttft_ms_by_turn"][key]
        ax.plot(range(1, len(values) + 1), values, "o-", label=label)
    title = "AR stage: TTFT over a 20-turn conversation (CPU, SmolLM2-135M)"
    save_plot(fig, ax, "ar_ttft", title, "time to first token (ms)", xlabel="turn")


if __name__ == "__main__":
    bench_main("ar", measure, plot)
