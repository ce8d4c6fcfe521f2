"""Quantized weights (models.quantize): the GPTQ layout vLLM unpacks, the error of each
grid, the checkpoints written from a bf16 directory, and the dtype the engine then runs."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.bundled import ModelNotFoundError
from models.prepare import ModelChoice, prepare
from models.quantize import (
    GROUP_SIZE,
    QUANTIZATIONS,
    dequantize_matrix,
    quantizable,
    quantize_checkpoint,
    quantize_matrix,
    quantize_matrix_int8,
)
from models.verify import resolve_dtype


def _weight(out_features: int = 64, in_features: int = 96) -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)


def test_codes_are_packed_as_vllm_unpacks_them():
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    weight = _weight()
    qweight, scales = quantize_matrix(weight)
    assert qweight.dtype == torch.int32 and qweight.shape == (96 // 8, 64)
    assert scales.shape == (96 // GROUP_SIZE, 64) and scales.dtype == torch.bfloat16
    codes = unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)  # [in, out]
    assert codes.shape == (96, 64) and codes.min() >= 0 and codes.max() <= 15
    # vLLM's reading of the codes (zero point 8) gives back our dequantization
    by_vllm = ((codes.float() - 8) * scales.float().repeat_interleave(GROUP_SIZE, dim=0)).t()
    assert torch.equal(by_vllm, dequantize_matrix(qweight, scales))


def test_the_searched_scale_beats_max_over_eight():
    weight = _weight(128, 256)
    qweight, scales = quantize_matrix(weight)
    error = (dequantize_matrix(qweight, scales) - weight.float()).square().mean()
    assert error / weight.float().square().mean() < 0.01  # 4 bits with a scale per 32 weights

    groups = weight.t().float().reshape(-1, GROUP_SIZE, 128)
    naive_scale = groups.abs().amax(dim=1, keepdim=True) / 8
    naive = ((groups / naive_scale).round().clamp(-8, 7) * naive_scale).reshape(256, 128).t()
    assert error < (naive - weight.float()).square().mean()


def test_int8_rows_keep_their_peak_and_lose_little():
    weight = _weight(128, 256)
    codes, scales = quantize_matrix_int8(weight)
    assert codes.dtype == torch.int8 and scales.shape == (128, 1)
    assert (codes.abs().amax(dim=1) == 127).all()  # each row's peak is the grid's end
    error = (codes.float() * scales - weight.float()).square().mean()
    assert error / weight.float().square().mean() < 1e-4


def test_shapes_that_do_not_split_into_groups_are_refused():
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_matrix(_weight(64, 40))


def _tiny_llama(path: Path) -> Path:
    """A two-layer Llama directory with random bf16 weights (tied LM head)."""
    path.mkdir()
    hidden, inter, vocab = 64, 128, 96
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64)}
    shapes |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    state = {"model.embed_tokens.weight": _weight(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for layer in range(2):
        for name, shape in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            state[f"model.layers.{layer}.{block}.{name}.weight"] = _weight(*shape)
    save_file(state, str(path / "model.safetensors"))
    return path


def test_an_int4_checkpoint_quantizes_every_projection_and_unties_the_head(tmp_path: Path):
    src = _tiny_llama(tmp_path / "bf16")
    out = tmp_path / "int4"
    quantize_checkpoint(src, out, "int4")
    state = load_file(str(out / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    assert not any(name.endswith("proj.weight") for name in state)
    assert sum(name.endswith(".qweight") for name in state) == 2 * 7 + 1  # 7 per layer and the head
    assert torch.equal(state["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    head = dequantize_matrix(state["lm_head.qweight"], state["lm_head.scales"])
    assert torch.allclose(head, source["model.embed_tokens.weight"].float(), atol=0.03)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATIONS["int4"] and config["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob(".*partial*"))
    # the engine runs these weights with bf16 activations, whatever "auto" means elsewhere
    assert resolve_dtype("auto", str(out)) == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("float32", str(out))
    assert not quantizable(out)  # already quantized


def test_an_int8_checkpoint_has_int8_projections_and_a_tied_bf16_head(tmp_path: Path):
    src = _tiny_llama(tmp_path / "bf16")
    out = tmp_path / "int8"
    quantize_checkpoint(src, out, "int8")
    state = load_file(str(out / "model.safetensors"))
    projections = [name for name in state if name.endswith("proj.weight")]
    assert len(projections) == 2 * 7 and all(state[name].dtype == torch.int8 for name in projections)
    assert all(f"{name}_scale" in state for name in projections)
    assert "lm_head.weight" not in state and state["model.embed_tokens.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATIONS["int8"] and config["tie_word_embeddings"] is True
    assert resolve_dtype("auto", str(out)) == "bfloat16"


def test_int4_is_refused_for_a_model_that_is_not_a_gguf(tmp_path: Path):
    src = _tiny_llama(tmp_path / "bf16")
    for scheme in ("int8", "int4"):
        with pytest.raises(ModelNotFoundError, match="GGUF"):
            prepare([ModelChoice("llm", str(src), scheme)], tmp_path)
    (prepared,) = prepare([ModelChoice("llm", str(src), "auto")], tmp_path)
    assert (prepared.path, prepared.quantization) == (str(src.resolve()), "none")
