"""Speech stages: `duplex bench asr` and `duplex bench tts`, saved with plots."""

from __future__ import annotations

from typing import Any

from benchmarks.common import duplex_bench, new_plot, save_plot, write_result


def _bench(stage: str) -> dict[str, Any]:
    return duplex_bench(stage)


def _plot_asr(result: dict[str, Any]) -> None:
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


def _plot_tts(result: dict[str, Any]) -> None:
    fig, ax = new_plot()
    for n, run in result["sessions"].items():
        by_words = run["first_audio_ms_by_first_phrase_words"]
        ax.plot(
            [int(w) for w in by_words], [v["p50"] for v in by_words.values()], "o-", label=f"{n} sessions"
        )
    ax.axhline(80, color="red", linestyle="--", label="goal: 80 ms p50")
    ylabel = "first audio after first phrase (ms, p50)"
    save_plot(fig, ax, "tts", "TTS first-audio latency", ylabel, "words in the first phrase", legend_size=7)


def main() -> None:
    asr = _bench("asr")
    print(write_result("asr", asr))
    _plot_asr(asr)
    tts = _bench("tts")
    print(write_result("tts", tts))
    _plot_tts(tts)


if __name__ == "__main__":
    main()
