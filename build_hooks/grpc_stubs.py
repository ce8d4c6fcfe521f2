"""The gRPC stubs (package ``audio_io._proto``), generated from proto/duplex.proto.

One generator for every way of building: setup.py's build_py runs it for a wheel and
``pip install .`` (into the build directory) and for an editable install (into the
checkout); ``make`` runs this file as a script for the checkout.

protoc names a generated module after its .proto file's path under the include root.
Mapping the include root (``-Iaudio_io/_proto=proto``) puts duplex.proto at
``audio_io/_proto/duplex.proto`` as far as protoc knows, so the stubs are written there
and ``duplex_pb2_grpc`` imports its messages as ``from audio_io._proto import
duplex_pb2``: a package import, with nothing rewritten after generation. The descriptor
records that path as the file's name, which is what server reflection lists; nothing
resolves by it.

    python build_hooks/grpc_stubs.py [OUT]      # OUT: the checkout by default
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("proto") / "duplex.proto"
PACKAGE = Path("audio_io") / "_proto"
INIT = '"""Generated from proto/duplex.proto by build_hooks/grpc_stubs.py: do not edit."""\n'


def generate(root: Path, out: Path) -> list[Path]:
    """Write the stubs for ``root``'s proto into ``out``/audio_io/_proto, replacing what
    was there; returns the files written."""
    from grpc_tools import protoc  # a build requirement (pyproject's build-system)

    target = out / PACKAGE
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    proto = (root / PROTO).resolve()
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    code = protoc.main(
        [
            "protoc",
            f"-I{PACKAGE.as_posix()}={proto.parent}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto} (exit status {code}; its message is above)")
    (target / "__init__.py").write_text(INIT)
    return sorted(target.iterdir())


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(ROOT, out):
        print(path)
