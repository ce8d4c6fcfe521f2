"""``duplex bench tts``: first-audio latency and real-time factor of streaming TTS.

Each session receives a reply as an LLM would send it (a few characters every 15 ms,
about 60 tokens/s) and reads its frames as fast as they come. First-audio latency is
the wall time from the text delta that completes the first phrase to the first 20 ms
frame. The real-time factor is synthesis time over audio time, engine-wide.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import TYPE_CHECKING, Any

from benchmarks.common import bench_main, new_plot, percentiles, save_plot, sessions_of
from models.prepare import model_path
from models.tts import TtsEngine, WordMark

if TYPE_CHECKING:
    from duplex.config import Config

REPLIES = (
    "Sure.",
    "Of course, I can help with that.",
    "The weather in Boston tomorrow will be sunny, with a high of seventy degrees.",
    "I found three Italian restaurants nearby; the closest one is open until ten tonight.",
    "Okay, I have added milk, eggs and bread to your shopping list.",
    "Your flight to Denver leaves at nine in the morning from gate twelve.",
    "Pride and Prejudice was written by Jane Austen and published in eighteen thirteen.",
    "No problem at all.",
)


async def _reply(tts: TtsEngine, text: str) -> dict[str, Any]:
    stream = tts.stream()
    first_phrase: dict[str, Any] = {}

    async def feed() -> None:
        for i in range(0, len(text), 4):
            for phrase in stream.push_text(text[i : i + 4]):
                if phrase.index == 0:
                    first_phrase.update(at=time.perf_counter(), words=len(phrase.text.split()))
            await asyncio.sleep(0.015)
        for phrase in stream.end_text():
            if phrase.index == 0:
                first_phrase.update(at=time.perf_counter(), words=len(phrase.text.split()))

    feeder = asyncio.create_task(feed())
    first_audio = None
    async for item in stream.frames():
        if not isinstance(item, WordMark) and first_audio is None:
            first_audio = time.perf_counter()
    await feeder
    assert first_audio is not None and first_phrase, "a reply produced no audio"
    return {
        "first_audio_ms": (first_audio - first_phrase["at"]) * 1000,
        "first_phrase_words": first_phrase["words"],
    }


async def _run(tts: TtsEngine, sessions: int, reps: int) -> dict[str, Any]:
    busy0, audio0 = tts.busy_s, tts.audio_s
    rows: list[dict[str, Any]] = []
    for r in range(reps):
        texts = [REPLIES[(r + i) % len(REPLIES)] for i in range(sessions)]
        rows += await asyncio.gather(*(_reply(tts, t) for t in texts))
    by_words: dict[str, list[float]] = {}
    for row in rows:
        by_words.setdefault(str(row["first_phrase_words"]), []).append(row["first_audio_ms"])
    return {
        "first_audio_ms": percentiles([row["first_audio_ms"] for row in rows]),
        "first_audio_ms_by_first_phrase_words": {k: percentiles(v) for k, v in sorted(by_words.items())},
        "rtf": round((tts.busy_s - busy0) / max(tts.audio_s - audio0, 1e-9), 4),
    }


def bench_tts(config: Config, sessions: list[int], quick: bool = False) -> dict[str, Any]:
    tts = TtsEngine(model_path(config, "voice"))
    try:
        tts.synthesize("Warm up.")
        runs = {
            str(n): asyncio.run(_run(tts, n, len(REPLIES) // 2 if quick else len(REPLIES))) for n in sessions
        }
    finally:
        tts.close()
    first = runs[str(sessions[0])]
    return {"first_audio_ms": first["first_audio_ms"], "rtf": first["rtf"], "sessions": runs}


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_tts(config, sessions_of(args), quick=args.quick)


def plot(result: dict[str, Any]) -> None:
    fig, ax = new_plot()
    for n, run in result["sessions"].items():
        by_words = run["first_audio_ms_by_first_phrase_words"]
        ax.plot(
            [int(w) for w in by_words], [v["p50"] for v in by_words.values()], "o-", label=f"{n} sessions"
        )
    ax.axhline(80, color="red", linestyle="--", label="goal: 80 ms p50")
    ylabel = "first audio after first phrase (ms, p50)"
    save_plot(fig, ax, "tts", "TTS first-audio latency", ylabel, "words in the first phrase", legend_size=7)


if __name__ == "__main__":
    bench_main("tts", measure, plot)
