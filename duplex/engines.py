"""`Engines`: the four model engines a process shares among all its sessions.

Loading them is the longer part of the start-up: each is a phase of the `Startup`
given (``load_vad``, ``load_asr``, ``load_tts``, then the LLM's, which vLLM's engine
core reports through its log lines: `duplex.startup.VllmPhaseTap`). With ``llm_url``
the LLM runs elsewhere (`models.remote_llm`): its phase is reaching that service and
checking that it runs the same tokenizer.

Once they are loaded, `freeze_heap` takes the objects alive then out of the garbage
collector's sight: they live as long as the process, and walking them all in each full
collection would stop the event loop for every session at once (figures:
docs/performance.md, "No partial pass in the silence; the heap frozen after start-up").
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from duplex.config import Config
from duplex.logs import route_vllm_logs
from duplex.startup import Startup, VllmPhaseTap, phase
from models.asr import AsrEngine
from models.handoff import in_daemon_thread
from models.llm import LlmEngine
from models.llm_backend import LlmBackend
from models.remote_llm import RemoteLlm
from models.tts import TtsEngine
from models.vad import VadEngine

log = logging.getLogger("duplex.engines")


def freeze_heap() -> None:
    """Collect, then freeze (`gc.freeze`) every object alive now (the count is logged).

    With the engines loaded a process tracks hundreds of thousands of objects (torch,
    vLLM, the tokenizer, the transports' libraries), and a full collection walks them
    all with the event loop stopped: audio that stalls for every caller at once. After
    this, full collections walk only what came later (figures: docs/performance.md,
    "No partial pass in the silence; the heap frozen after start-up"). Objects frozen
    and then dropped are still freed by their reference counts; only cycles among them
    are never collected."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    took_ms = round((time.perf_counter() - began) * 1000, 1)
    log.info("heap frozen", extra={"fields": {"objects": gc.get_freeze_count(), "collect_ms": took_ms}})


@dataclass(frozen=True)
class Engines:
    vad: VadEngine
    asr: AsrEngine
    tts: TtsEngine
    llm: LlmBackend  # in-process vLLM, or the LLM service at ``llm_url``

    @classmethod
    async def start(
        cls,
        config: Config,
        cache_dir: Path | None = None,
        deterministic_tts: bool = False,
        loaded: Callable[[str], None] = lambda component: None,
        startup: Startup | None = None,
    ) -> Engines:
        """Load every engine from the configured (and prepared) models, off the event
        loop; ``loaded`` is called with "vad", "asr", "tts" and "llm" as each is up, and
        ``startup`` follows the phases. vLLM's log lines go through this process's
        logging (`route_vllm_logs`)."""
        from models.cache import configure_engine_caches, default_cache_dir
        from models.prepare import ModelChoice, model_path, prepare

        if cache_dir is None:
            cache_dir = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir)
        configure_engine_caches(cache_dir)
        route_vllm_logs(config.log_level, config.log_format, cache_dir / "logging")
        with phase(startup, "load_vad"):
            vad = await in_daemon_thread(lambda: VadEngine(model_path(config, "vad")), "load-vad")
        loaded("vad")
        engines: list[VadEngine | AsrEngine | TtsEngine] = [vad]
        try:
            with phase(startup, "load_asr"):
                asr = await in_daemon_thread(
                    lambda: AsrEngine(model_path(config, "asr"), workers=config.asr_workers), "load-asr"
                )
            engines.append(asr)
            loaded("asr")
            with phase(startup, "load_tts"):
                tts = await in_daemon_thread(
                    lambda: TtsEngine(model_path(config, "voice"), deterministic=deterministic_tts),
                    "load-tts",
                )
            engines.append(tts)
            loaded("tts")
            choice = ModelChoice("llm", config.llm, config.llm_weights())
            llm_path = (
                await in_daemon_thread(lambda: prepare([choice], cache_dir, progress=False), "load-llm")
            )[0].path
            llm: LlmBackend
            if config.llm_url:
                with phase(startup, "llm_service"):
                    llm = RemoteLlm(config.llm_url, config.llm_config(llm_path), config.llm_api_key)
                    await llm.start()
            else:
                with phase(startup, "llm_engine"):
                    llm = LlmEngine(config.llm_config(llm_path))
                    # the phases end with the last one vLLM began
                    with VllmPhaseTap(startup) if startup is not None else contextlib.nullcontext():
                        await llm.start()
            loaded("llm")
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        freeze_heap()
        return cls(vad, asr, tts, llm)

    def close(self) -> None:
        for engine in (self.vad, self.asr, self.tts):
            engine.close()
        self.llm.shutdown()
