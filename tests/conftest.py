import os
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from benchmarks.common import free_port  # noqa: F401 (the tests' free ports, from here)

REPO = Path(__file__).resolve().parent.parent


def duplex_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "duplex", *args]


@pytest.fixture
def offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a child duplex: offline, no inherited DUPLEX_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In make test's background lane (tests/lanes.py): the modules that use the session's
    vLLM engine last, so that it starts once the lane's builds and conversions are done
    (one engine fewer in memory beside theirs) and, on a cold compile cache, after the
    paced lane's engine has compiled the shapes they share. Modules stay whole."""
    from tests.lanes import BACKGROUND

    if config.option.markexpr != BACKGROUND:
        return
    engine_modules = {item.module.__name__ for item in items if "llm_engine" in item.fixturenames}  # type: ignore[attr-defined]
    items.sort(key=lambda item: item.module.__name__ in engine_modules)  # type: ignore[attr-defined]


# -- real engines, one of each per test session (they are thread-based and loop-agnostic) --


@pytest.fixture(scope="session")
def tts_engine():
    from models.bundled import BUNDLED
    from models.tts import TtsEngine

    engine = TtsEngine(BUNDLED["voice"].locate(), deterministic=True)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def asr_engine():
    from models.asr import AsrEngine
    from models.bundled import BUNDLED

    engine = AsrEngine(BUNDLED["asr"].locate())
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vad_engine():
    from models.bundled import BUNDLED
    from models.vad import VadEngine

    engine = VadEngine(BUNDLED["vad"].locate())
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def speech_set(tts_engine):
    from benchmarks.speech_set import synthesize_set

    return synthesize_set(tts_engine)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def llm_engine():
    """One real vLLM engine (CPU, the default model and weights, compiled) for the whole
    test session."""
    from models.cache import default_cache_dir
    from models.llm import LlmConfig, LlmEngine
    from models.prepare import ModelChoice, prepare

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    llm = next(p for p in prepare([ModelChoice("llm", None, "auto")], default_cache_dir(), progress=False))
    engine = LlmEngine(LlmConfig(model=llm.path, max_model_len=2048, max_tokens=48))
    await engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def engines(vad_engine, asr_engine, tts_engine, llm_engine):
    from duplex.engines import Engines

    return Engines(vad_engine, asr_engine, tts_engine, llm_engine)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """What a module's server starts with, as the service's would after start-up: every
    object alive then (the session's engines included: pytest sets up session fixtures
    first) frozen (`duplex.engines.freeze_heap`). Without it, the ~670,000
    objects the test session holds stalled the loop ~400 ms in each full collection,
    which the hostile suites' loop-lag limit caught."""
    from duplex.engines import freeze_heap

    freeze_heap()


def speech(tts_engine, text: str):
    """``text`` spoken by the bundled voice, at the runtime's 16 kHz."""
    from audio_io.pcm import RUNTIME_RATE
    from audio_io.resample import resample

    synthesis = tts_engine.synthesize(text)
    return resample(synthesis.audio, tts_engine.sample_rate, RUNTIME_RATE)
