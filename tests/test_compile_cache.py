"""vLLM's compiled graph: saved by the first start, loaded (not compiled again) by the
next one, which answers the same (the shim in models/vllm_shims.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from models import vllm_shims

pytestmark = pytest.mark.background  # no pace: beside the paced tests in make test (tests/lanes.py)

START = """
import asyncio, json, time
from models.cache import default_cache_dir
from models.conversation import Conversation
from models.llm import LlmConfig, LlmEngine
from models.prepare import ModelChoice, prepare

async def main():
    (llm,) = prepare([ModelChoice("llm", None, "auto")], default_cache_dir(), progress=False)
    engine = LlmEngine(LlmConfig(model=llm.path, enforce_eager=False, max_model_len=1024, max_tokens=16))
    started = time.perf_counter()
    await engine.start()
    seconds = time.perf_counter() - started
    reply = "".join([d async for d in Conversation(engine).reply("What is the capital of France?")])
    engine.shutdown()
    print("RESULT " + json.dumps({"reply": reply, "seconds": seconds}))

if __name__ == "__main__":
    asyncio.run(main())
"""


def start(caches: Path) -> tuple[dict[str, object], str]:
    """Start a compiled engine in a new process with these caches: its reply, and its log."""
    env = os.environ | {
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), log


@pytest.mark.slow
def test_a_second_start_loads_the_compiled_graph_and_answers_the_same(tmp_path):
    first, log = start(tmp_path)
    assert "saved AOT compiled function" in log
    second, log = start(tmp_path)
    assert "Compiling model again" not in log, log[-3000:]
    assert "Directly load AOT compilation" in log
    assert second["reply"] == first["reply"] and "Paris" in str(first["reply"])


def test_the_shim_gives_a_loaded_plain_function_a_finalize_loading(monkeypatch):
    import torch

    def graph(*args: object) -> None:
        pass

    loaded = types.SimpleNamespace(_artifacts=types.SimpleNamespace(compiled_fn=graph))
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda *a, **k: loaded)
    vllm_shims._load_compiled_graphs_on_cpu()
    vllm_shims._load_compiled_graphs_on_cpu()  # once is enough: not wrapped twice
    load: Any = torch.compiler.load_compiled_function
    assert load(None)._artifacts.compiled_fn is graph
    assert getattr(graph, "finalize_loading")(object()) is None  # noqa: B009 (set by the shim)
    assert load.__wrapped__.__name__ == "<lambda>"


def test_the_shims_stay_off_for_other_vllm_versions(monkeypatch):
    import torch

    before = torch.compiler.load_compiled_function
    monkeypatch.setattr(vllm_shims, "_vllm_version", lambda: "0.33.0")
    vllm_shims.register()
    assert torch.compiler.load_compiled_function is before
