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

With ``--llm-url`` the same measures run over the remote backend against that LLM
service (`models.remote_llm`): "prefix caching off" is then a cache salt per request,
the start is reaching the service and checking its tokenizer, and the prefill counts
are the server's own (``usage.prompt_tokens_details``). With ``--compare`` as well,
both backends run in one process on the same turns, interleaved (`_interleaved`).
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
from models.llm_backend import LlmBackend
from models.prepare import ModelChoice, prepare
from models.remote_llm import RemoteLlm

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
# what `bench_ar` reports, whichever backend ran it
AR_KEYS = (
    "ttft_ms_by_turn",
    "ttft_turn20_over_turn1",
    "eot_to_first_token_ms",
    "eot_prefill_tokens",
    "decode_tok_s",
    "startup_s",
    "abort_ms",
    "backend",
    "method",
)
WORDS_40 = (
    "I am planning a trip to Italy next summer with my whole family and we would love to see Rome "
    "and the old town of Florence, but my mother cannot walk very far, so could you suggest a calm "
    "route with short days and good hotels near the train stations?"
)


async def _ttft_by_turn(engine: LlmBackend) -> list[float]:
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


async def _eot(engine: LlmBackend, incremental: bool, run: int) -> tuple[float, int]:
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
        pass  # the first token is timed; a remote request counts its prefill at its end
    prefilled = engine.counters.prefill_tokens - before
    assert conversation.last.first_token_s is not None
    return conversation.last.first_token_s * 1000, prefilled


async def _decode(engine: LlmBackend, sessions: int, tokens: int = 48) -> float:
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


async def _abort(engine: LlmBackend, runs: int = 5) -> list[float]:
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


async def _measure(
    llm: LlmConfig,
    sessions: list[int],
    prefix_caching: bool,
    quick: bool,
    url: str | None,
    api_key: str | None,
) -> dict[str, Any]:
    llm = replace(llm, max_tokens=48)
    engine: LlmBackend
    if url:
        engine = RemoteLlm(url, llm, api_key, prefix_caching)
    else:
        engine = LlmEngine(llm, prefix_caching)
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
        await asyncio.to_thread(engine.shutdown)
    return result


async def _interleaved(llm: LlmConfig, url: str, api_key: str | None, quick: bool) -> dict[str, Any]:
    """The in-process engine and the LLM service at ``url`` side by side in one process,
    turn by turn (which goes first alternates): what the HTTP hop and the prefix cache
    cost against the resumable request, on the same conversation."""
    llm = replace(llm, max_tokens=48)
    backends: dict[str, LlmBackend] = {"in_process": LlmEngine(llm), "remote": RemoteLlm(url, llm, api_key)}
    for backend in backends.values():
        await backend.start()
    try:
        conversations = {name: Conversation(backend) for name, backend in backends.items()}
        ttft: dict[str, list[float]] = {name: [] for name in backends}
        for n, question in enumerate(QUESTIONS):
            for name in sorted(backends, reverse=bool(n % 2)):
                async for _ in conversations[name].reply(question):
                    pass
                first = conversations[name].last.first_token_s
                assert first is not None
                ttft[name].append(round(first * 1000, 1))
        eot: dict[str, list[float]] = {name: [] for name in backends}
        prefilled: dict[str, list[int]] = {name: [] for name in backends}
        for run in range(3 if quick else 10):
            for name in sorted(backends, reverse=bool(run % 2)):
                ms, tokens = await _eot(backends[name], True, 1000 + run)
                eot[name].append(round(ms, 1))
                prefilled[name].append(tokens)
    finally:
        for backend in backends.values():
            await asyncio.to_thread(backend.shutdown)
    gaps = [r - i for i, r in zip(ttft["in_process"], ttft["remote"], strict=True)]
    eot_gaps = [r - i for i, r in zip(eot["in_process"], eot["remote"], strict=True)]
    return {
        "ttft_ms_by_turn": ttft,
        "ttft_ms": {name: percentiles(values) for name, values in ttft.items()},
        "eot_to_first_token_ms": {name: percentiles(values) for name, values in eot.items()},
        "eot_prefill_tokens": {name: max(values) for name, values in prefilled.items()},
        "remote_minus_in_process_ms": {
            "ttft": percentiles(gaps),
            "eot_to_first_token": percentiles(eot_gaps),
        },
        "backend": url,
        "method": "one process, both backends on the same 20-turn conversation and on 40-word turns "
        "prefilled while spoken, interleaved (the order alternates); greedy, 48-token replies",
    }


def bench_ar(
    config: Config, sessions: list[int], quick: bool = False, compare: bool = False
) -> dict[str, Any]:
    cache = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir)
    configure_engine_caches(cache)
    weights = config.llm_quantization if compare else config.llm_weights()  # compare: both run it
    model = prepare([ModelChoice("llm", config.llm, weights)], cache, progress=False)[0].path
    llm = config.llm_config(model)
    if compare:
        if not config.llm_url:
            raise SystemExit("--compare compares the in-process LLM with the one at --llm-url: give it")
        return asyncio.run(_interleaved(llm, config.llm_url, config.llm_api_key, quick))
    url, key = config.llm_url, config.llm_api_key
    on = asyncio.run(_measure(llm, sessions, True, quick, url, key))
    off = asyncio.run(_measure(llm, sessions, False, quick, url, key))
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
        "backend": config.llm_url or "in-process",
        "method": "greedy, 48-token replies; warm start = the second engine of the process (prefix caching "
        "off), after the first was shut down; with --llm-url: the remote backend (start = reaching the "
        "service and checking its tokenizer; prefix caching off = a cache salt per request)",
    }


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_ar(config, sessions_of(args), quick=args.quick, compare=args.compare)


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
