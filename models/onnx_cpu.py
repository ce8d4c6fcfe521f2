"""onnxruntime sessions on the CPU, with their thread counts set (the VAD's, piper's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnxruntime


def cpu_session(model_path: str | Path, threads: int = 1) -> onnxruntime.InferenceSession:
    """An onnxruntime session on the CPU with ``threads`` for each op and one between ops."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(
        str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
    )
