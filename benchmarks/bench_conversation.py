"""Whole sessions: `duplex bench conversation`, saved with a plot of voice-to-voice by load
and, for the long session, by turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.common import new_plot, save_plot, write_result

TURNS = int(os.environ.get("DUPLEX_BENCH_TURNS", "100"))


def main() -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "duplex", "bench", "conversation", "--turns", str(TURNS)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(write_result("conversation", result))
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
