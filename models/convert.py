"""One-time conversion of a GGUF LLM into a safetensors directory vLLM can load.

vLLM 0.32's GGUF loader is CUDA-only, so on CPU the GGUF is dequantized once with
transformers (which needs ``gguf`` and ``accelerate`` for this) and saved in bf16
with its tokenizer and chat template. Two pitfalls handled here: ``save_pretrained``
refuses a model that still carries its GGUF quantizer, and the saved config would keep
a ``quantization_config`` naming GGUF, which vLLM then rejects ("Unknown quantization
method: gguf"); both are removed, since the weights are plain bf16 after loading.

The result is written to a temporary sibling directory and renamed into place, so an
interrupted conversion never leaves a half-written model where a complete one is
expected. A ``duplex-source.json`` beside the weights records what it was made from;
a later run with the same source reuses the directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

SOURCE_FILE = "duplex-source.json"
FORMAT_VERSION = 1  # bump when the conversion itself changes, to force a redo


def source_fingerprint(gguf: Path) -> dict[str, object]:
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {
        "format_version": FORMAT_VERSION,
        "source_name": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "source_sha256": digest.hexdigest(),
    }


def is_converted(out_dir: Path, fingerprint: dict[str, object]) -> bool:
    """True when ``out_dir`` holds a complete conversion of the same source."""
    try:
        recorded = json.loads((out_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    recorded = {k: v for k, v in recorded.items() if k in fingerprint}
    return recorded == fingerprint and (out_dir / "model.safetensors").is_file()


@contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def conversion_lock(out_dir: Path) -> Iterator[None]:
    """Exclusive across processes: check-and-convert of one output directory."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with (out_dir.parent / f".{out_dir.name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_partials(out_dir: Path) -> None:
    """Delete staging directories left behind by an interrupted conversion."""
    for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def convert_gguf(gguf: Path, out_dir: Path, fingerprint: dict[str, object], progress: bool = True) -> float:
    """Convert ``gguf`` into ``out_dir`` (replaced atomically); returns seconds taken."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    steps = tqdm(total=4, desc=f"Converting {gguf.name}", unit="step", disable=not progress)
    with _staging_dir(out_dir) as tmp:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        steps.update()
        steps.set_postfix_str("saving")
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        steps.update()
        config = json.loads((tmp / "config.json").read_text())
        assert "quantization_config" not in config, "GGUF quantization_config leaked into config.json"
        if not tokenizer.chat_template:
            raise ValueError(f"{gguf.name} carries no chat template; a chat model needs one")
        (tmp / SOURCE_FILE).write_text(json.dumps(fingerprint | {"source_path": str(gguf)}, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        steps.update()
    steps.close()
    return time.monotonic() - started
