"""Model preparation: a cold conversion of the bundled GGUF, then a warm (reuse) run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import write_result


def _run(cache: str) -> tuple[float, dict[str, Any]]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "duplex", "prepare", "--json", "--cache-dir", cache],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return time.monotonic() - started, {p["stage"]: p for p in json.loads(done.stdout)}


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        cold_s, cold = _run(cache)
        warm_s, warm = _run(cache)
    result = {
        "cold_wall_s": cold_s,
        "cold_conversion_s": cold["llm"]["seconds"],
        "cold_action": cold["llm"]["action"],
        "warm_wall_s": warm_s,
        "warm_action": warm["llm"]["action"],
    }
    print(write_result("prepare", result))


if __name__ == "__main__":
    main()
