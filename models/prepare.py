"""Model preparation: resolve every stage's model to local files, converting once.

Each stage's model is either the bundled default (`models.bundled`) or what the
config names: a local path, or for the LLM and ASR a hub id (``org/name``), which
is passed through for machines with network access. Local paths are checked for the
files each engine needs, and a missing one names the model and the path tried.

A GGUF LLM (the bundled one, or one given by path) is converted once into
``<cache>/models/<name>-bf16``; later runs find the conversion and reuse it. With
quantized weights chosen (`ModelChoice.quantization`: ``int8`` or ``int4``; ``auto`` is
what was measured fastest and right on this kind of CPU, `models.cpu_variant`),
``<cache>/models/<name>-int8`` (or ``-int4``) is written once from that conversion and
is what the engine loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from models.bundled import BUNDLED, ModelNotFoundError
from models.convert import (
    conversion_lock,
    convert_gguf,
    is_converted,
    remove_stale_partials,
    source_fingerprint,
)
from models.cpu_variant import cpu_backend, default_variant
from models.quantize import QUANTIZATIONS, quantizable, quantize_checkpoint

STAGES = ("vad", "asr", "voice", "llm")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class PreparedModel:
    stage: str
    path: str  # local path, or the hub id for a hub model
    source: str  # "bundled", "path" or "hub"
    action: str  # "found", "converted", "reused" or "hub"
    seconds: float = 0.0
    quantization: str = "none"  # "int8" or "int4": quantized weights (models.quantize)

    def describe(self) -> str:
        what = {
            "found": "ready",
            "converted": f"converted in {self.seconds:.1f} s",
            "reused": "converted earlier, reused",
            "hub": "hub id, fetched by its engine",
        }[self.action]
        weights = f", {self.quantization} weights" if self.quantization != "none" else ""
        return f"{self.stage:<6} {self.path}  ({self.source}{weights}, {what})"


@dataclass(frozen=True)
class ModelChoice:
    """What the config says for one stage (None: the bundled default)."""

    stage: str
    value: str | None
    quantization: str = "none"  # the LLM's weights: "auto", "int8", "int4" or "none"


def _is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not Path(value).exists()


def _check_local(stage: str, path: Path) -> None:
    """Raise `ModelNotFoundError` unless ``path`` has what the stage's engine loads."""
    if not path.exists():
        raise ModelNotFoundError(stage, path, "no such file or directory")
    if stage == "vad" and not (path.is_file() and path.suffix in {".onnx", ".jit"}):
        raise ModelNotFoundError(stage, path, "expected a Silero VAD .onnx or .jit file")
    if stage == "asr" and not (path / "model.bin").is_file():
        raise ModelNotFoundError(stage, path, "expected a CTranslate2 Whisper directory with model.bin")
    if stage == "voice":
        if path.suffix != ".onnx" or not path.is_file():
            raise ModelNotFoundError(stage, path, "expected a piper voice .onnx file")
        config = path.with_name(path.name + ".json")
        if not config.is_file():
            raise ModelNotFoundError(stage, config, "the piper voice's .onnx.json config is missing")
    if (
        stage == "llm"
        and not (path.suffix == ".gguf" and path.is_file())
        and not (path / "config.json").is_file()
    ):
        raise ModelNotFoundError(stage, path, "expected a Hugging Face model directory or a .gguf file")


def resolve(choice: ModelChoice) -> tuple[Path | str, str]:
    """The stage's model location and its source, checked but not converted."""
    if choice.value is None:
        return BUNDLED[choice.stage].locate(), "bundled"
    if choice.stage in {"llm", "asr"} and _is_hub_id(choice.value):
        return choice.value, "hub"
    path = Path(choice.value).expanduser()
    _check_local(choice.stage, path)
    return path.resolve(), "path"


class SpeechModels(Protocol):
    """The speech stages' models as a configuration names them (`duplex.config.Config`);
    None is the bundled one."""

    @property
    def vad(self) -> str | None: ...
    @property
    def asr(self) -> str | None: ...
    @property
    def voice(self) -> str | None: ...


def model_path(config: SpeechModels, stage: str) -> str:
    """The local path (or hub id) of a speech stage's model: ``vad``, ``asr`` or ``voice``,
    which are used as found (only the LLM is prepared, `prepare`)."""
    location, _ = resolve(ModelChoice(stage, getattr(config, stage)))
    return str(location)


def check_models(choices: list[ModelChoice]) -> None:
    """Fail fast (`ModelNotFoundError`) before anything slow starts."""
    for choice in choices:
        resolve(choice)


def converted_dir(cache_dir: Path, gguf: Path) -> Path:
    return cache_dir / "models" / f"{gguf.stem}-bf16"


def prepare(choices: list[ModelChoice], cache_dir: Path, progress: bool = True) -> list[PreparedModel]:
    """Resolve every stage's model; convert a GGUF LLM unless already converted."""
    prepared = []
    for choice in choices:
        location, source = resolve(choice)
        gguf = isinstance(location, Path) and location.suffix == ".gguf"
        if choice.stage == "llm" and choice.quantization not in ("auto", "none") and not gguf:
            raise ModelNotFoundError(
                "llm", Path(str(location)), "quantized weights are made from a GGUF model; give a .gguf file"
            )
        if source == "hub":
            prepared.append(PreparedModel(choice.stage, str(location), source, "hub"))
        elif choice.stage == "llm" and isinstance(location, Path) and gguf:
            prepared.append(_prepare_gguf(location, source, cache_dir, progress, choice.quantization))
        else:
            prepared.append(PreparedModel(choice.stage, str(location), source, "found"))
    return prepared


def _prepare_gguf(
    gguf: Path, source: str, cache_dir: Path, progress: bool, quantization: str
) -> PreparedModel:
    out = converted_dir(cache_dir, gguf)
    fingerprint = source_fingerprint(gguf)
    seconds = 0.0
    with conversion_lock(out):  # another process may be converting the same model
        if not is_converted(out, fingerprint):
            remove_stale_partials(out)
            try:
                seconds = convert_gguf(gguf, out, fingerprint, progress=progress)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                # transformers and gguf raise these for files that are not a GGUF model
                # they can read; say which file, not a traceback.
                raise ModelNotFoundError("llm", gguf, f"cannot convert this GGUF: {e}") from e
    if quantization == "auto":
        # what runs fastest, and right, on this CPU (models.cpu_variant)
        quantization = default_variant().weights if cpu_backend() and quantizable(out) else "none"
    if quantization != "none":
        if not quantizable(out):
            raise ModelNotFoundError(
                "llm", gguf, f"{quantization} weights are written for Llama-family models only"
            )
        quantized = out.with_name(f"{gguf.stem}-{quantization}")
        fingerprint = fingerprint | {"quantization": QUANTIZATIONS[quantization]}
        with conversion_lock(quantized):
            if not is_converted(quantized, fingerprint):
                seconds += quantize_checkpoint(out, quantized, quantization)
        out = quantized
    return PreparedModel("llm", str(out), source, "converted" if seconds else "reused", seconds, quantization)
