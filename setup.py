"""Build steps that pyproject.toml cannot declare: the gRPC stubs and the demo page.

A wheel (and ``pip install .``) gets both in its build directory: the stubs generated
from proto/duplex.proto (build_hooks/grpc_stubs.py), and demo_web/ copied into the
``duplex`` package as its data, where ``duplex.http_app`` looks first. An editable
install generates the stubs in the checkout instead (setuptools' ``editable_mode``:
the checkout is what gets imported), and the server finds the checkout's demo_web/.
Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # the build backend runs this file without the checkout on the path
from build_hooks.grpc_stubs import generate  # noqa: E402

PAGE = ROOT / "demo_web"


class BuildPy(build_py):
    """setuptools' build_py, then the stubs and the page."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            generate(ROOT, ROOT)
            return
        lib = Path(self.build_lib)
        generate(ROOT, lib)
        shutil.rmtree(lib / "duplex" / PAGE.name, ignore_errors=True)
        shutil.copytree(PAGE, lib / "duplex" / PAGE.name)


setup(cmdclass={"build_py": BuildPy})
