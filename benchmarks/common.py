"""Shared helpers: the stage's configuration and arguments (those of ``duplex bench``),
percentiles, where results go, machine facts recorded with every result, plots.

matplotlib is imported only to plot, so that ``duplex bench`` (which measures and prints,
writing nothing) runs without it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.cpu_variant import cpu_description

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from duplex.config import Config

RESULTS = Path(__file__).resolve().parent / "results"

_PORTS_GIVEN: set[tuple[int, int]] = set()  # (socket kind, port) handed out by this process


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    """A free loopback port, never one this process handed out before: the OS may give
    the same free port to two calls in a row (a test's front end once got its HTTP and
    gRPC ports equal, and its gRPC bind failed)."""
    while True:
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if (kind, port) not in _PORTS_GIVEN:
            _PORTS_GIVEN.add((kind, port))
            return port


Measure = Callable[["Config", argparse.Namespace], dict[str, Any]]
Plot = Callable[[dict[str, Any]], None]


def percentiles(values: list[float], digits: int = 1) -> dict[str, float | int | None]:
    """p50, p95 and n, rounded to ``digits`` (milliseconds: 1; a probability needs more)."""
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    return {
        "p50": round(float(np.percentile(values, 50)), digits),
        "p95": round(float(np.percentile(values, 95)), digits),
        "n": len(values),
    }


def sessions_of(args: argparse.Namespace) -> list[int]:
    """``--sessions 1,4,8`` as numbers."""
    return [int(n) for n in args.sessions.split(",") if n.strip()]


def stage_config(stage: str, argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The configuration and arguments of ``duplex bench STAGE ARGV`` (``ARGV``: this
    process's arguments if None)."""
    return bench_config([stage, *(sys.argv[1:] if argv is None else argv)])


def bench_config(argv: Sequence[str]) -> tuple[Config, argparse.Namespace]:
    """The configuration and arguments of ``duplex bench ARGV``: the same flags,
    ``DUPLEX_*`` environment and config file; logging set up as the command does."""
    from duplex.cli import build_parser
    from duplex.config import FIELDS, ConfigError, load_config
    from duplex.logs import setup_logging

    args = build_parser().parse_args(["bench", *argv])
    flags = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    try:
        config = load_config(args.config, os.environ, flags)
    except ConfigError as e:
        raise SystemExit(f"{args.stage}: configuration: {e}") from e
    setup_logging(config.log_level, config.log_format, [config.auth_token or ""])
    return config, args


def bench_main(stage: str, measure: Measure, plot: Plot | None = None) -> None:
    """``python -m benchmarks.<stage> [the flags of duplex bench <stage>]``: measure, then
    write ``results/<stage>.json`` (and its plots), as `make bench` does."""
    config, args = stage_config(stage)
    result = measure(config, args)
    print(write_result(stage.replace("-", "_"), result))
    if plot is not None:
        plot(result)


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


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    return plt


def new_plot() -> tuple[Figure, Axes]:
    fig, ax = _pyplot().subplots(figsize=(7, 3.5))
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
    _pyplot().close(fig)
    return path
