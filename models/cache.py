"""Where prepared models and engine caches live: the user's XDG cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/duplex``, or ``~/.cache/duplex``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "duplex"


def configure_engine_caches(cache_dir: Path) -> None:
    """Point vLLM's and torch inductor's caches (and temporary files) into our cache.

    Values the user set explicitly win. Call before vLLM or torch is imported.
    """
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TMPDIR", "tmp")):
        if not os.environ.get(var):
            path = cache_dir / sub
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
