"""onnxruntime sessions on the CPU, with their thread counts set (the VAD's, piper's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnxruntime


def cpu_session(model: str | Path | bytes, threads: int = 1) -> onnxruntime.InferenceSession:
    """An onnxruntime session on the CPU with ``threads`` for each op and one between ops,
    for a model file or a serialized model."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    source = model if isinstance(model, bytes) else str(model)
    return onnxruntime.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
