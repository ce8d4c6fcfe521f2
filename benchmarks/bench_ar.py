"""AR stage: `duplex bench ar`, saved with a plot of time to first token by turn."""

from __future__ import annotations

from benchmarks.common import duplex_bench, new_plot, save_plot, write_result


def main() -> None:
    result = duplex_bench("ar")
    print(write_result("ar", result))
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
    main()
