"""``duplex bench asr``: final latency after end of speech, CPU per audio second, WER.

Sessions are real-time paced: each plays its utterances in 20 ms frames on a
monotonic schedule, with 1.2 s of silence between them, through its own VAD and ASR
streams on the shared engines, as a caller would. Final latency is the wall time
from the VAD's end-of-speech event to the final transcript. CPU is the process's CPU
time over the run divided by the audio seconds all sessions played.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from audio_io.resample import resample
from benchmarks.common import bench_main, new_plot, percentiles, save_plot, sessions_of
from benchmarks.speech_set import synthesize_set, wer
from models.asr import AsrEngine
from models.listen import Listener, ListenEventKind
from models.prepare import model_path
from models.tts import TtsEngine
from models.vad import VadEngine

if TYPE_CHECKING:
    from duplex.config import Config

UTTERANCES = {
    "1s": ("No, thanks.", "Yes, please.", "Okay, let's do that."),
    "3s": (
        "Could you tell me what the weather will be like tomorrow in Boston?",
        "What time does the pharmacy on Main Street close tonight?",
    ),
    "8s": (
        "Please book a table for four people at the Italian restaurant downtown tonight, and tell my sister "
        "and her husband that we will meet them there right after work, at around seven.",
    ),
}
GAP = int(1.2 * 16000)


async def _session(
    vad: VadEngine, asr: AsrEngine, plan: list[tuple[str, str, npt.NDArray[np.int16]]]
) -> list[dict[str, Any]]:
    listener = Listener(vad, asr)
    audio = np.concatenate(
        [np.concatenate([np.zeros(GAP, np.int16), a]) for _, _, a in plan] + [np.zeros(GAP, np.int16)]
    )
    results: list[dict[str, Any]] = []
    stopped_at: float | None = None
    start = time.monotonic()
    try:
        for i, offset in enumerate(range(0, audio.size, 320)):
            delay = start + i * 0.02 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            for event in await listener.push(audio[offset : offset + 320]):
                if event.kind is ListenEventKind.SPEECH_STOPPED:
                    stopped_at = event.at
                elif (
                    event.kind is ListenEventKind.FINAL
                    and event.result is not None
                    and stopped_at is not None
                ):
                    results.append(
                        {
                            "latency_ms": (event.at - stopped_at) * 1000,
                            "compute_ms": event.result.compute_ms,
                            "text": event.result.text,
                        }
                    )
    finally:
        listener.close()
    # match finals to the plan in order (a VAD split would show up as a WER penalty)
    for i, (cls, text, _) in enumerate(plan):
        if i < len(results):
            results[i].update({"class": cls, "reference": text})
    return results


async def _run(
    vad: VadEngine,
    asr: AsrEngine,
    clips: dict[str, list[tuple[str, npt.NDArray[np.int16]]]],
    sessions: int,
    reps: int,
) -> dict[str, Any]:
    plan = [(cls, text, audio) for _ in range(reps) for cls, items in clips.items() for text, audio in items]
    cpu0, wall0, busy0 = time.process_time(), time.perf_counter(), asr.busy_s
    per_session = await asyncio.gather(*(_session(vad, asr, plan) for _ in range(sessions)))
    cpu, busy = time.process_time() - cpu0, asr.busy_s - busy0
    audio_s = sum(a.size for _, _, a in plan) / 16000 * sessions
    rows = [r for rs in per_session for r in rs if "class" in r]
    return {
        "final_latency_ms": {
            c: percentiles([r["latency_ms"] for r in rows if r["class"] == c]) for c in clips
        },
        "final_compute_ms": {
            c: percentiles([r["compute_ms"] for r in rows if r["class"] == c]) for c in clips
        },
        "cpu_s_per_audio_s": round(cpu / audio_s, 3),
        "asr_busy_s_per_audio_s": round(busy / audio_s, 3),
        "wer": round(wer([(r["reference"], r["text"]) for r in rows]), 4),
        "finals": len(rows),
        "expected_finals": len(plan) * sessions,
        "wall_s": round(time.perf_counter() - wall0, 1),
    }


def bench_asr(config: Config, sessions: list[int], quick: bool = False) -> dict[str, Any]:
    tts = TtsEngine(model_path(config, "voice"), deterministic=True)
    asr = AsrEngine(model_path(config, "asr"), workers=config.asr_workers)
    vad = VadEngine(model_path(config, "vad"))
    try:
        clips = {
            cls: [(t, resample(tts.synthesize(t).audio, tts.sample_rate, 16000)) for t in texts]
            for cls, texts in UTTERANCES.items()
        }
        # WER of the streaming path (lockstep, not paced) on the 20-sentence set
        test_set = synthesize_set(tts)
        streamed = asyncio.run(_lockstep(vad, asr, [u.audio for u in test_set]))
        set_wer = wer([(u.text, h) for u, h in zip(test_set, streamed, strict=True)])
        runs = {str(n): asyncio.run(_run(vad, asr, clips, n, 1 if quick else 2)) for n in sessions}
    finally:
        for engine in (tts, asr, vad):
            engine.close()
    first = runs[str(sessions[0])]
    return {
        "final_latency_ms": first["final_latency_ms"],
        "cpu_s_per_audio_s": first["cpu_s_per_audio_s"],
        "wer": round(set_wer, 4),
        "sessions": runs,
        "voiced_seconds": {c: [round(a.size / 16000, 2) for _, a in v] for c, v in clips.items()},
        "method": "real-time paced sessions; latency = VAD end-of-speech event to final; "
        "wer = streaming finals on the 20-sentence synthesized set",
    }


async def _lockstep(vad: VadEngine, asr: AsrEngine, clips: list[npt.NDArray[np.int16]]) -> list[str]:
    out = []
    for audio in clips:
        listener = Listener(vad, asr)
        padded = np.concatenate([np.zeros(GAP, np.int16), audio, np.zeros(GAP, np.int16)])
        finals = []
        for offset in range(0, padded.size, 320):
            for event in await listener.push(padded[offset : offset + 320]):
                if event.kind is ListenEventKind.FINAL and event.result is not None:
                    finals.append(event.result.text)
            await listener.asr.idle()
        finals += [e.result.text for e in await listener.flush() if e.result is not None]
        listener.close()
        out.append(" ".join(finals))
    return out


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_asr(config, sessions_of(args), quick=args.quick)


def plot(result: dict[str, Any]) -> None:
    fig, ax = new_plot()
    sessions = list(result["sessions"])
    classes = list(result["final_latency_ms"])
    width = 0.8 / len(sessions)
    for i, n in enumerate(sessions):
        run = result["sessions"][n]
        p50 = [run["final_compute_ms"][c]["p50"] or 0 for c in classes]
        latency = [run["final_latency_ms"][c]["p95"] or 0 for c in classes]
        xs = [k + i * width for k in range(len(classes))]
        ax.bar(xs, p50, width, label=f"{n} sessions: final pass compute p50")
        ax.plot(xs, latency, "k_", markersize=14)
    ax.axhline(150, color="red", linestyle="--", label="goal: final ready 150 ms after end of speech")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(classes))], classes)
    title = "ASR final: pass compute (bars), end-of-speech to final p95 (ticks)"
    save_plot(fig, ax, "asr", title, "ms", legend_size=7)


if __name__ == "__main__":
    bench_main("asr", measure, plot)
