"""Shared helpers: where results go, machine facts recorded with every result."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display here
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from models.cpu_variant import cpu_description

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu": cpu_description(),  # model, kind and kernel flags: figures compare within one
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2))
    return path


def plot_path(name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}.png"


def new_plot() -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    return fig, ax


def save_plot(
    fig: Figure,
    ax: Axes,
    name: str,
    title: str,
    ylabel: str,
    xlabel: str | None = None,
    legend_size: int | None = None,
) -> Path:
    """Label, legend, write ``results/<name>.png`` and free the figure."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path)
    plt.close(fig)
    return path


def duplex_bench(*args: str) -> dict[str, Any]:
    """Run ``duplex bench ARGS`` offline; its result is the JSON object on its last line.
    A failure shows the end of its stderr (what went wrong) before stopping."""
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "duplex", "bench", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"duplex bench {' '.join(args)} failed with exit status {done.returncode}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
