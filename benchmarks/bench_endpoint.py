"""End-of-turn silence: `duplex bench endpoint`, saved with a plot of split rate and
voice-to-voice by setting."""

from __future__ import annotations

from benchmarks.common import duplex_bench, new_plot, save_plot, write_result


def main() -> None:
    result = duplex_bench("endpoint")
    print(write_result("endpoint", result))
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
    main()
