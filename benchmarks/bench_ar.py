"""AR stage: `duplex bench ar`, saved with a plot of time to first token by turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.common import new_plot, save_plot, write_result


def main() -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "duplex", "bench", "ar"], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
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
