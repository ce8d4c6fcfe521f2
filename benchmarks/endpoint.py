"""``duplex bench endpoint``: what each end-of-turn silence costs, to choose the default.

Two sides of one setting (`SessionConfig.end_of_turn_ms`, the VAD's silence that ends
the caller's turn):

- ``split_rate``: turns of two sentences (each pair of the spoken test set, as one
  caller would say them) that the VAD would end early, inside the turn, at a pause
  between or within the sentences. The turn's audio goes through a real `VadStream`
  with that silence; a split is a ``speech_end`` before the turn's last voiced sample.
- ``v2v_ms``: voice-to-voice with that silence, one real-time session of
  ``turns`` questions (echo on, speculative replies on), as ``duplex bench conversation``.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from benchmarks.common import bench_main, new_plot, percentiles, save_plot
from benchmarks.conversation import clips_for, run_sessions, with_engines
from duplex.config import Config
from duplex.engines import Engines
from duplex.session_config import SessionConfig
from models.speech_set import SENTENCES
from models.tts import voiced_span
from models.vad import VadConfig, VadEngine, VadEventKind

CANDIDATES_MS = (200, 300, 400, 500, 600, 800)
CHUNK = RUNTIME_RATE // 50  # fed in 20 ms frames, as a transport would


async def _splits(vad: VadEngine, turn: np.ndarray, end_of_turn_ms: int) -> int:
    """How many times the VAD ended this turn before its last voiced sample."""
    config = VadConfig(min_silence_ms=end_of_turn_ms, pause_ms=min(192, end_of_turn_ms))
    stream = vad.stream(config)
    _, last_voiced = voiced_span(turn.astype(np.float32), RUNTIME_RATE)
    audio = np.concatenate([turn, np.zeros(RUNTIME_RATE, np.int16)])  # and a second of silence
    ends = []
    for start in range(0, audio.size, CHUNK):
        for event in await stream.push(audio[start : start + CHUNK]):
            if event.kind is VadEventKind.SPEECH_END:
                ends.append(event.position)
    return sum(1 for position in ends if position < last_voiced)


def bench_endpoint(
    config: Config, turns: int = 10, candidates: tuple[int, ...] = CANDIDATES_MS
) -> dict[str, Any]:
    async def body(engines: Engines) -> dict[str, Any]:
        tts = engines.tts
        pairs = [f"{SENTENCES[i]} {SENTENCES[(i + 1) % len(SENTENCES)]}" for i in range(len(SENTENCES))]
        spoken = [resample(tts.synthesize(t).audio, tts.sample_rate, RUNTIME_RATE) for t in pairs]
        clips = clips_for(engines)
        out: dict[str, Any] = {}
        for ms in candidates:
            split = [await _splits(engines.vad, turn, ms) for turn in spoken]
            session = SessionConfig(end_of_turn_ms=ms)
            run = await run_sessions(engines, clips, 1, turns, session) if turns else {}
            out[str(ms)] = {
                "split_rate": round(sum(1 for s in split if s) / len(split), 3),
                "splits": sum(split),
                "v2v_ms": run.get("v2v_ms", percentiles([])),
                "self_interruptions": run.get("self_interruptions"),
            }
        return {"end_of_turn_ms": out, "turns_checked_for_splits": len(spoken)}

    return with_engines(
        config,
        body,
        "split_rate: two-sentence turns of the spoken test set ended early by the VAD at that "
        "silence; v2v_ms: one real-time session of questions with echo at -20 dB",
    )


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_endpoint(config, turns=args.turns or 10)


def plot(result: dict[str, Any]) -> None:
    """Split rate and voice-to-voice by setting."""
    settings = sorted(result["end_of_turn_ms"], key=int)
    rows = [result["end_of_turn_ms"][s] for s in settings]
    fig, ax = new_plot()
    ax.plot([int(s) for s in settings], [r["v2v_ms"]["p50"] for r in rows], "o-", label="voice-to-voice p50")
    ax.plot(
        [int(s) for s in settings],
        [r["split_rate"] * 1000 for r in rows],
        "s--",
        label="turns split, per mille",
    )
    save_plot(
        fig, ax, "endpoint", "End-of-turn silence (CPU, 2 cores)", "ms / per mille", xlabel="end_of_turn_ms"
    )


if __name__ == "__main__":
    bench_main("endpoint", measure, plot)
