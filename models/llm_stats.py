"""A vLLM stat logger that feeds `EngineCounters` (imported only once vLLM is)."""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from models.llm_types import EngineCounters


def recorder_factory(counters: EngineCounters) -> Any:
    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                counters.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return Recorder
