"""Model preparation, offline: bundled files, one conversion, reuse, and a vLLM reply."""

import json
import subprocess
from pathlib import Path

import pytest

from models.bundled import BUNDLED, BundledModel, ModelNotFoundError
from models.convert import FORMAT_VERSION, SOURCE_FILE, is_converted, remove_stale_partials
from models.prepare import ModelChoice, prepare
from models.quantize import QUANTIZATIONS
from tests.conftest import duplex_command

pytestmark = pytest.mark.background  # no pace: beside the paced tests in make test (tests/lanes.py)


def test_every_bundled_model_is_found_in_its_package():
    for name, model in BUNDLED.items():
        path = model.locate()
        assert path.exists(), name
    assert (BUNDLED["asr"].locate() / "model.bin").is_file()
    assert BUNDLED["voice"].locate().with_suffix(".onnx.json").is_file()


def test_a_missing_package_is_named():
    ghost = BundledModel("llm", "ghost-llm", "ghost_llm_pkg", "x.gguf", "")
    with pytest.raises(ModelNotFoundError, match="'ghost-llm' is not installed"):
        ghost.locate()


def test_local_paths_are_used_as_given(tmp_path: Path):
    vad = BUNDLED["vad"].locate()
    prepared = prepare(
        [ModelChoice("vad", str(vad)), ModelChoice("asr", "Systran/faster-whisper-small")], tmp_path
    )
    assert [(p.stage, p.source, p.action) for p in prepared] == [
        ("vad", "path", "found"),
        ("asr", "hub", "hub"),
    ]


def test_conversion_records_and_stale_partials(tmp_path: Path):
    out = tmp_path / "models" / "m-bf16"
    out.mkdir(parents=True)
    fingerprint = {
        "format_version": FORMAT_VERSION,
        "source_name": "m.gguf",
        "source_bytes": 3,
        "source_sha256": "ab",
    }
    assert not is_converted(out, fingerprint)  # no record
    (out / SOURCE_FILE).write_text(json.dumps(fingerprint | {"source_path": "/x/m.gguf"}))
    assert not is_converted(out, fingerprint)  # no weights
    (out / "model.safetensors").write_bytes(b"w")
    assert is_converted(out, fingerprint)
    assert not is_converted(out, fingerprint | {"source_sha256": "cd"})  # another source
    assert not is_converted(out, fingerprint | {"format_version": FORMAT_VERSION + 1})
    partial = tmp_path / "models" / ".m-bf16.partial-x1"
    partial.mkdir()
    remove_stale_partials(out)
    assert not partial.exists() and out.exists()


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _prepare_json(cache: Path, env: dict[str, str], *args: str) -> dict[str, dict[str, str]]:
    result = subprocess.run(
        duplex_command("prepare", "--json", "--cache-dir", str(cache), *args),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return {item["stage"]: item for item in json.loads(result.stdout)}


@pytest.mark.slow
def test_offline_preparation_converts_once_then_reuses(fresh_cache: Path, offline_env):
    first = _prepare_json(fresh_cache, offline_env, "--llm-quantization", "none")
    llm = Path(first["llm"]["path"])
    assert first["llm"]["action"] == "converted"
    assert llm.parent == fresh_cache / "models"
    config = json.loads((llm / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (llm / "chat_template.jinja").is_file() and (llm / "tokenizer.json").is_file()
    weights = llm / "model.safetensors"
    before = weights.stat()

    second = _prepare_json(fresh_cache, offline_env, "--llm-quantization", "none")
    assert second["llm"] == first["llm"] | {"action": "reused", "seconds": 0.0}
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    assert not list(fresh_cache.glob("models/.*partial*"))

    # quantized weights: each scheme written once from the conversion, beside it
    for scheme in ("int8", "int4"):
        made = _prepare_json(fresh_cache, offline_env, "--llm-quantization", scheme)["llm"]
        assert (made["action"], made["quantization"]) == ("converted", scheme)
        quantized = Path(made["path"])
        assert quantized.parent == llm.parent and quantized.name.endswith(f"-{scheme}")
        config = json.loads((quantized / "config.json").read_text())
        assert config["quantization_config"] == QUANTIZATIONS[scheme]
        again = _prepare_json(fresh_cache, offline_env, "--llm-quantization", scheme)["llm"]
        assert again == made | {"action": "reused", "seconds": 0.0}
    assert weights.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.slow
def test_converted_model_gives_a_chat_reply_under_vllm(fresh_cache: Path, offline_env):
    result = subprocess.run(
        duplex_command("prepare", "--verify", "--no-progress", "--cache-dir", str(fresh_cache)),
        env=offline_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("LLM check"))
    reply = line.split(": ", 1)[1]
    assert reply.strip("'\" ")
    assert "Paris" in reply  # greedy decoding of a correct conversion knows this
