"""``python -m benchmarks [--cwd DIR] STAGE [the flags of duplex bench STAGE]``: what
``duplex bench`` runs. It measures the stage in this process and prints the result as one
JSON line, the last (`run_bench`); nothing is written (``python -m benchmarks.<stage>``
writes the result file and plots).

It runs from the checkout's root, where `benchmarks` is found as a package of the current
directory (``python -m`` puts that directory first on the path, as an absolute one).
``--cwd DIR``, first if given, then makes ``DIR`` the working directory before anything is
read: ``duplex bench`` passes its own, so that relative paths in the flags (``--config``,
``--utterances``, a local ``--llm``) mean what they meant where it was run.
"""

from __future__ import annotations

import os
import sys

from benchmarks import run_bench
from benchmarks.common import bench_config


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cwd"]:
        if len(argv) < 2:
            raise SystemExit("python -m benchmarks: --cwd needs a directory")
        os.chdir(argv[1])
        argv = argv[2:]
    config, args = bench_config(argv)
    return run_bench(config, args)


if __name__ == "__main__":  # vLLM spawns workers that re-import __main__
    raise SystemExit(main(sys.argv[1:]))
