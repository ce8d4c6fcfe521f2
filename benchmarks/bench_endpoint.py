"""End-of-turn silence: `duplex bench endpoint`, saved with a plot of split rate and
voice-to-voice by setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.common import new_plot, save_plot, write_result


def main() -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "duplex", "bench", "endpoint"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
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
