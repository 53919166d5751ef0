"""Random-weight loading (`--load-format dummy`, `preset:NAME`) and Qwen's block-FP8 checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from morion.engine.sampling_params import SamplingParams
from morion.errors import ModelLoadError
from morion.loader import load_model
from morion.loader.dummy_weights import fill_dummy_weights
from morion.loader.fp8_block import dequantize_block_fp8
from morion.models.presets import preset_config
from morion.models.registry import build_model

CPU = torch.device("cpu")


def test_dummy_weights_from_a_config_only_directory(
    tiny_qwen3_next_config_dir, engine_factory, engine_runner
):
    directory = tiny_qwen3_next_config_dir
    first = load_model(str(directory), torch.float32, CPU, load_format="dummy", seed=3)
    again = load_model(str(directory), torch.float32, CPU, load_format="dummy", seed=3)
    other = load_model(str(directory), torch.float32, CPU, load_format="dummy", seed=4)
    params = dict(first.model.named_parameters())
    for name, param in again.model.named_parameters():
        assert torch.equal(param, params[name]), name
        assert param.abs().sum() > 0, f"{name} is all zeros"
    assert not torch.equal(next(other.model.parameters()), next(first.model.parameters()))
    [out] = engine_runner(engine_factory(first), [[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4


def test_a_dummy_tensor_depends_on_its_name_and_the_seed_only():
    """Each parameter draws from a generator of its own (seed and name): a model with one tensor more (a
    stacked shared expert's router row, say) leaves every other tensor's values as they were."""
    small = torch.nn.ModuleDict({"gate": torch.nn.Linear(16, 8, bias=False)})
    larger = torch.nn.ModuleDict(
        {"extra": torch.nn.Linear(16, 4, bias=False), "gate": torch.nn.Linear(16, 8, bias=False)}
    )
    fill_dummy_weights(small, seed=5)
    fill_dummy_weights(larger, seed=5)
    assert torch.equal(small["gate"].weight, larger["gate"].weight)
    fill_dummy_weights(larger, seed=6)
    assert not torch.equal(small["gate"].weight, larger["gate"].weight)


def test_dummy_without_weights_is_only_for_dummy(tiny_qwen3_next_config_dir):
    directory = tiny_qwen3_next_config_dir
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(directory), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="unknown load format"):
        load_model(str(directory), torch.float32, CPU, load_format="zeros")


def test_full_size_preset_has_the_real_shapes():
    with torch.device("meta"):
        model = build_model(preset_config("preset:qwen3-next-80b-a3b"), torch.bfloat16, torch.device("meta"))
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    # Reference notes §1: about 79.7B without the MTP layer (which adds its own 512 experts).
    assert 79.0e9 < total - mtp < 80.5e9
    spec = model.cache_spec(16, torch.bfloat16)
    assert spec.bytes_per_token == 12 * 2 * 2 * 256 * 2  # 24 KiB: 12 attention layers, K+V, bf16
    # Per request: 36 GDN layers x (fp32 recurrent 32x128x128 + bf16 conv window 3 x 8192).
    assert spec.bytes_per_slot == 36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    with pytest.raises(ModelLoadError, match="unknown preset"):
        preset_config("preset:nope")


def _quantize_block_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // block), -(-cols // block))
    quantized = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scales[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantized, scales


def test_block_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=192,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "bf16")
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):  # Qwen quantizes the linear projections only
            weight, scale = _quantize_block_fp8(tensor.float())
            fp8[name], fp8[name + "_scale_inv"] = weight, scale
            dequantized[name] = dequantize_block_fp8(weight, scale, (128, 128))
        else:
            fp8[name] = dequantized[name] = tensor
    hf_config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    for kind, weights, extra in [
        ("fp8", fp8, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}),
        ("plain", dequantized, {}),
    ]:
        (tmp_path / kind).mkdir()
        names = sorted(weights)
        # Two shards, with weights and their scales split across them.
        save_file({n: weights[n].contiguous() for n in names[::2]}, tmp_path / kind / "a.safetensors")
        save_file({n: weights[n].contiguous() for n in names[1::2]}, tmp_path / kind / "b.safetensors")
        (tmp_path / kind / "config.json").write_text(json.dumps({**hf_config, **extra}))
    from_fp8 = load_model(str(tmp_path / "fp8"), torch.float32, CPU).model
    from_plain = load_model(str(tmp_path / "plain"), torch.float32, CPU).model
    plain = dict(from_plain.named_parameters())
    for name, param in from_fp8.named_parameters():
        assert torch.equal(param, plain[name]), name
    original = tensors["model.layers.0.mlp.up_proj.weight"].float()
    loaded = dict(from_fp8.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert (loaded - original).abs().max() < 0.07 * original.abs().max()  # e4m3 keeps ~3 mantissa bits
