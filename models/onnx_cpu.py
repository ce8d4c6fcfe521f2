"""Thread counts on the CPU: onnxruntime sessions (the VAD's, piper's), and numpy's BLAS
(the ASR's)."""

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


def limit_blas_threads() -> None:
    """One BLAS thread for numpy in this process.

    faster-whisper computes log-mel features with numpy; left to itself, OpenBLAS keeps
    a second thread spinning after each call, which doubles a pass's CPU time for the
    same wall time (docs/performance.md, "Speech stages"). Our numpy work is small;
    model compute has its own thread settings (CTranslate2 ``cpu_threads``,
    onnxruntime, vLLM's processes).
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
