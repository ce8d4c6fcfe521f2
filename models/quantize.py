"""Quantized weights for vLLM's CPU kernels, written once from a bf16 model directory.

Two schemes, each a checkpoint format vLLM reads natively:

- ``int8`` (the default on a CPU with AMX, `models.cpu_variant`): compressed-tensors
  W8A8. Weights int8 with a scale per output channel (symmetric), activations quantized
  to int8 per token at run time; vLLM's `CPUInt8ScaledMMLinearKernel` runs them (SGL's
  AMX kernel, else oneDNN).
  The LM head stays bf16 and tied (compressed-tensors does not quantize it). On
  SmolLM2-135M its greedy replies stay close to bf16's (docs/performance.md).
- ``int4``: GPTQ, 4-bit, symmetric, groups of 32, which `CPUWNA16LinearKernel` runs as
  W4A8 (``int4_scaled_mm_cpu``) on a CPU with AMX, and as W4A16 (``cpu_gemm_wna16``)
  without. Its GPTQ route only takes
  symmetric grids (``uint4b8``: zero point 8), so each group gets one scale s and codes
  q with w ≈ s·(q − 8); the scale is the one of `_SCALE_STEPS` candidates between
  max|w|/8.5 and max|w|/6 with the least squared error. The LM head is quantized too
  (a fifth of SmolLM2-135M's weights), so the checkpoint unties it from the embedding.
  Faster than int8, but on top of the GGUF's own 4 bits it costs SmolLM2-135M facts
  ("3 days in a week"): an option, not the default.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from models.convert import SOURCE_FILE

if TYPE_CHECKING:
    import torch

GROUP_SIZE = 32  # int4: weights per scale (vLLM's CPU GPTQ route takes 32 at the least)
_SCALE_STEPS = 26
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INT8 = {"num_bits": 8, "type": "int", "symmetric": True}
QUANTIZATIONS: dict[str, dict[str, object]] = {
    "int8": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _INT8 | {"strategy": "channel", "dynamic": False},
                "input_activations": _INT8 | {"strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    },
    "int4": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP_SIZE,
        "desc_act": False,
        "sym": True,
        "lm_head": True,
    },
}


def weights_of(model_dir: str | Path) -> str:
    """Which of `QUANTIZATIONS` a model directory's weights are in (``none``: full
    weights, or a directory or hub id without a config to read)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "none"
    method = config.get("quantization_config", {}).get("quant_method")
    return next((name for name, q in QUANTIZATIONS.items() if q["quant_method"] == method), "none")


def quantizable(model_dir: Path) -> bool:
    """A Llama-family model whose matrices split into the kernel's groups and tiles."""
    config = json.loads((model_dir / "config.json").read_text())
    sizes = (config.get("hidden_size", 1), config.get("intermediate_size", 1), config.get("vocab_size", 1))
    return (
        config.get("model_type") == "llama"
        and "quantization_config" not in config
        and all(size % GROUP_SIZE == 0 for size in sizes)
    )


def quantize_matrix(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight as GPTQ ``qweight`` [in/8, out] (int32) and ``scales``
    [in/group, out] (the weight's dtype)."""
    import torch

    out_features, in_features = weight.shape
    if in_features % group_size or in_features % 8 or out_features % 8:
        raise ValueError(f"a {out_features}x{in_features} weight does not split into groups of {group_size}")
    groups = weight.t().float().reshape(in_features // group_size, group_size, out_features)
    peak = groups.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    best_scale = peak / 8
    best_error = torch.full_like(peak, float("inf"))
    for divisor in torch.linspace(6.0, 8.5, _SCALE_STEPS).tolist():
        scale = peak / divisor
        codes = (groups / scale).round().clamp(-8, 7)
        error = (codes * scale - groups).square().sum(dim=1, keepdim=True)
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    codes = (
        ((groups / best_scale).round().clamp(-8, 7) + 8).to(torch.int64).reshape(in_features, out_features)
    )
    packed = torch.zeros(in_features // 8, out_features, dtype=torch.int64)
    for i in range(8):
        packed |= codes[i::8] << (4 * i)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return packed, best_scale.reshape(in_features // group_size, out_features).to(weight.dtype)


def quantize_matrix_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight as int8 codes [out, in] and float32 scales [out, 1]."""
    import torch

    rows = weight.float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return (rows / scale).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_matrix(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE
) -> torch.Tensor:
    """The [out, in] weight a GPTQ ``qweight``/``scales`` pair stands for (tests)."""
    import torch

    words, out_features = qweight.shape
    codes = torch.stack([(qweight.to(torch.int64) >> (4 * i)) & 0xF for i in range(8)], dim=1)
    codes = codes.reshape(words * 8, out_features).float() - 8
    return (codes * scales.float().repeat_interleave(group_size, dim=0)).t()


def _qzeros(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    import torch

    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    return torch.full((in_features // group_size, out_features // 8), 0x77777777, dtype=torch.int32)


def _quantized_state(state: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        layer, _, kind = name.rpartition(".")
        if kind != "weight" or layer.rpartition(".")[2] not in _PROJECTIONS:
            quantized[name] = tensor
        elif scheme == "int8":
            quantized[name], quantized[f"{layer}.weight_scale"] = quantize_matrix_int8(tensor)
        else:
            qweight, scales = quantize_matrix(tensor)
            quantized |= {f"{layer}.qweight": qweight, f"{layer}.scales": scales}
            quantized[f"{layer}.qzeros"] = _qzeros(qweight, GROUP_SIZE)
    if scheme == "int4":
        head = quantized.pop("lm_head.weight", state["model.embed_tokens.weight"])
        qweight, scales = quantize_matrix(head)
        quantized |= {"lm_head.qweight": qweight, "lm_head.scales": scales}
        quantized["lm_head.qzeros"] = _qzeros(qweight, GROUP_SIZE)
    return quantized


def quantize_checkpoint(src: Path, out: Path, scheme: str) -> float:
    """Write ``out`` (replaced atomically) from the bf16 directory ``src`` in ``scheme``
    ("int8" or "int4"); seconds taken."""
    from safetensors.torch import load_file, save_file

    started = time.monotonic()
    if not quantizable(src):
        raise ValueError(
            f"{src} is not an unquantized Llama-family model with sizes divisible by {GROUP_SIZE}"
        )
    config = json.loads((src / "config.json").read_text())
    quantized = _quantized_state(load_file(str(src / "model.safetensors")), scheme)
    config["quantization_config"] = QUANTIZATIONS[scheme]
    if scheme == "int4":
        config["tie_word_embeddings"] = False

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging, ignore=shutil.ignore_patterns("model.safetensors", SOURCE_FILE))
    save_file(quantized, str(staging / "model.safetensors"))
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    source = json.loads((src / SOURCE_FILE).read_text()) if (src / SOURCE_FILE).is_file() else {}
    (staging / SOURCE_FILE).write_text(json.dumps(source | {"quantization": QUANTIZATIONS[scheme]}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return time.monotonic() - started
