"""Whole sessions: `duplex bench conversation`, saved with a plot of voice-to-voice by load
and, for the long session, by turn."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.common import duplex_bench, new_plot, save_plot, write_result

TURNS = int(os.environ.get("DUPLEX_BENCH_TURNS", "100"))


def main() -> None:
    result = duplex_bench("conversation", "--turns", str(TURNS))
    print(write_result("conversation", result))
    plot(result)


def plot(result: dict[str, Any]) -> None:
    fig, ax = new_plot()
    loads = sorted(result["sessions"], key=int)
    for key, label in (("p50", "voice-to-voice p50"), ("p95", "voice-to-voice p95")):
        ax.plot(
            [int(n) for n in loads], [result["sessions"][n]["v2v_ms"][key] for n in loads], "o-", label=label
        )
    stops = [result["sessions"][n]["bargein_stop_ms"]["p95"] for n in loads]
    ax.plot([int(n) for n in loads], stops, "s--", label="barge-in stop p95")
    save_plot(fig, ax, "conversation_load", "Whole sessions by load (CPU, 2 cores)", "ms", xlabel="sessions")
    if "long_session" in result:
        by_turn = result["long_session"]["v2v_ms_by_turn"]
        fig, ax = new_plot()
        ax.plot(range(1, len(by_turn) + 1), by_turn, ".-", label="voice-to-voice")
        save_plot(fig, ax, "conversation_long", f"One session, {len(by_turn)} turns", "ms", xlabel="turn")


if __name__ == "__main__":
    main()
