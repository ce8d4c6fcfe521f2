"""`Engines`: the four model engines a process shares among all its sessions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from duplex.config import Config
from models.asr import AsrEngine
from models.llm import LlmEngine
from models.tts import TtsEngine
from models.vad import VadEngine


@dataclass(frozen=True)
class Engines:
    vad: VadEngine
    asr: AsrEngine
    tts: TtsEngine
    llm: LlmEngine

    @classmethod
    async def start(cls, config: Config, deterministic_tts: bool = False) -> Engines:
        """Load every engine from the configured (and prepared) models."""
        from duplex.speech_cli import model_path
        from models.cache import configure_engine_caches, default_cache_dir
        from models.prepare import ModelChoice, prepare

        cache = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir)
        configure_engine_caches(cache)
        llm_path = prepare([ModelChoice("llm", config.llm)], cache, progress=False)[0].path
        vad = VadEngine(model_path(config, "vad"))
        asr = AsrEngine(model_path(config, "asr"), workers=config.asr_workers)
        tts = TtsEngine(model_path(config, "voice"), deterministic=deterministic_tts)
        llm = LlmEngine(config.llm_config(llm_path))
        try:
            await llm.start()
        except BaseException:
            for engine in (vad, asr, tts):
                engine.close()
            raise
        return cls(vad, asr, tts, llm)

    def close(self) -> None:
        for engine in (self.vad, self.asr, self.tts):
            engine.close()
        self.llm.shutdown()
