"""The benchmarks, one module per benchmark: its measurement, and the result file and
plots `make bench` writes from it; and the harnesses they share with the tests (the
scripted caller, `benchmarks.caller`; the spoken test set, `benchmarks.speech_set`).
They ship with the source checkout, not the wheel, and the runtime never imports them.

- ``duplex bench <stage> ...`` runs ``python -m benchmarks <stage> ...`` in the checkout
  (`benchmarks.__main__`), which measures one stage in its process and prints one JSON
  object as its last line (`run_bench`);
- ``python -m benchmarks.<stage> ...`` (the same flags) measures it and writes
  ``benchmarks/results/<stage>.json`` and its plots;
- ``python -m benchmarks.run`` (`make bench`) runs every benchmark, each in a process of
  its own.
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duplex.config import Config


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    """The result of ``args.stage`` (``ar-cpu`` is `benchmarks.ar_cpu`, ...)."""
    module = importlib.import_module(f"benchmarks.{args.stage.replace('-', '_')}")
    result: dict[str, Any] = module.measure(config, args)
    return result


def run_bench(config: Config, args: argparse.Namespace) -> int:
    """``duplex bench``: measure, and print the result as one JSON line, the last."""
    print(json.dumps(measure(config, args)))
    return 0
