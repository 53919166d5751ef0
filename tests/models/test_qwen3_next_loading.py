"""Qwen3-Next construction, config parsing, cache spec and weight loading (names, layouts, errors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from morion.errors import ModelLoadError
from morion.layers.moe import SparseMoE
from morion.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)

# The released Qwen3-Next-80B-A3B config.json (transformers 4.57 style: rope keys at the top level).
RELEASED_80B = {
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rope_scaling": None,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    reference = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**SMALL)).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.add_(torch.randn_like(param) * 0.2)
    directory = tmp_path_factory.mktemp("qwen3_next_small")
    reference.save_pretrained(directory)
    return directory


def _copy_with(source: Path, destination: Path, change) -> Path:
    """A copy of the checkpoint whose tensors dict went through `change`."""
    destination.mkdir()
    shutil.copy(source / "config.json", destination / "config.json")
    tensors = load_file(source / "model.safetensors")
    save_file(change(dict(tensors)), destination / "model.safetensors")
    return destination


def _logits(model, backend_factory, tokens) -> torch.Tensor:
    return backend_factory(model).prefill(model, tokens)


def test_released_config_and_cache_spec_sizes():
    config = Qwen3NextConfig.from_hf(RELEASED_80B)
    assert config.attention_layers == tuple(range(3, 48, 4))
    assert len(config.linear_layers) == 36
    assert config.rotary_dim == 64 and config.rope["rope_theta"] == 10000000
    assert config.conv_dim == 8192 and config.num_mtp_layers == 1
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    assert list(model.buffers()) == []  # nothing that to_empty would leave uninitialised
    # The shared expert (as wide as a routed one) stacked as expert 512, its gate the router's row 512.
    mlp = model.model.layers[0].mlp
    assert mlp.experts.gate_up_proj.shape == (513, 1024, 2048) and mlp.gate.weight.shape == (513, 2048)
    assert mlp.shared_slot == 512 and mlp.shared_expert is None
    spec = model.cache_spec(page_size=64, kv_dtype=torch.bfloat16)
    # model-architecture.md §3: 24 KiB/token of bf16 K/V; 1.69 MiB conv + 72 MiB fp32 recurrent state.
    assert spec.bytes_per_token == 24 * 1024
    assert spec.bytes_per_slot == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    (kv,) = spec.token_components
    conv, recurrent = spec.state_components
    assert (kv.num_layers, kv.token_shape) == (12, (2, 2, 256))
    assert (conv.shape, conv.dtype) == ((3, 8192), torch.bfloat16)
    assert (recurrent.shape, recurrent.dtype) == ((32, 128, 128), torch.float32)
    bf16_state = model.cache_spec(64, torch.float8_e4m3fn, state_dtype=torch.bfloat16)
    assert bf16_state.state_components[1].dtype == torch.bfloat16
    assert bf16_state.bytes_per_token == 12 * 1024


def test_config_rejects_what_it_cannot_run():
    with pytest.raises(ModelLoadError, match="hidden_act"):
        Qwen3NextConfig.from_hf({**RELEASED_80B, "hidden_act": "gelu"})
    with pytest.raises(ModelLoadError, match="layer_types"):
        Qwen3NextConfig.from_hf({**RELEASED_80B, "layer_types": ["linear_attention", "mamba"] * 24})
    with pytest.raises(ModelLoadError, match="linear_num_value_heads"):
        Qwen3NextConfig.from_hf(
            {**RELEASED_80B, "linear_num_value_heads": 24, "linear_num_key_heads": 16 + 1}
        )


def test_the_shared_expert_loads_into_the_stacked_slot(small_checkpoint, build_qwen3_next):
    tensors = load_file(small_checkpoint / "model.safetensors")
    mlp = build_qwen3_next(small_checkpoint).model.layers[1].mlp
    slot, width = SMALL["num_experts"], SMALL["moe_intermediate_size"]
    assert mlp.shared_slot == slot and mlp.experts.num_experts == slot + 1
    shared = "model.layers.1.mlp.shared_expert"
    assert torch.equal(mlp.experts.gate_up_proj[slot, :width], tensors[f"{shared}.gate_proj.weight"])
    assert torch.equal(mlp.experts.gate_up_proj[slot, width:], tensors[f"{shared}.up_proj.weight"])
    assert torch.equal(mlp.experts.down_proj[slot], tensors[f"{shared}.down_proj.weight"])
    assert torch.equal(mlp.gate.weight[:slot], tensors["model.layers.1.mlp.gate.weight"])
    assert torch.equal(mlp.gate.weight[slot:], tensors["model.layers.1.mlp.shared_expert_gate.weight"])
    assert torch.equal(mlp.experts.down_proj[2], tensors["model.layers.1.mlp.experts.2.down_proj.weight"])


def test_stacked_expert_names_load_like_per_expert_names(
    small_checkpoint, tmp_path, build_qwen3_next, hybrid_backend
):
    def stack(tensors):
        for layer in range(SMALL["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts"
            gate_up, down = [], []
            for e in range(SMALL["num_experts"]):
                gate = tensors.pop(f"{prefix}.{e}.gate_proj.weight")
                up = tensors.pop(f"{prefix}.{e}.up_proj.weight")
                gate_up.append(torch.cat((gate, up)))
                down.append(tensors.pop(f"{prefix}.{e}.down_proj.weight"))
            tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{prefix}.down_proj"] = torch.stack(down)
        return tensors

    stacked = _copy_with(small_checkpoint, tmp_path / "stacked", stack)
    tokens = list(range(1, 30))
    expected = _logits(build_qwen3_next(small_checkpoint), hybrid_backend, tokens)
    assert torch.equal(_logits(build_qwen3_next(stacked), hybrid_backend, tokens), expected)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: {**t, "model.layers.0.linear_attn.bogus": torch.zeros(1)}, "no place"),
        (lambda t: {**t, "model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(32, 64)}, "no place"),
        # Expert 4 is where the shared expert is stacked: no checkpoint's routed expert goes there.
        (lambda t: {**t, "model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(32, 64)}, "no place"),
        (lambda t: {**t, "model.layers.3.self_attn.q_norm.weight": torch.zeros(33)}, "shape"),
        (lambda t: {**t, "model.layers.1.mlp.experts.2.down_proj.weight": torch.zeros(32, 64)}, "shape"),
        (lambda t: {k: v for k, v in t.items() if not k.endswith("linear_attn.A_log")}, "lacks 3"),
        (
            lambda t: {k: v for k, v in t.items() if not k.endswith("mlp.shared_expert_gate.weight")},
            "lacks 4",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"},
            "experts.3.up_proj",
        ),
    ],
    ids=[
        "unknown",
        "expert-out-of-range",
        "expert-in-the-shared-slot",
        "shape",
        "expert-shape",
        "missing",
        "missing-shared-gate",
        "missing-expert-part",
    ],
)
def test_bad_checkpoints_are_rejected(small_checkpoint, tmp_path, build_qwen3_next, change, message):
    broken = _copy_with(small_checkpoint, tmp_path / "broken", change)
    with pytest.raises(ModelLoadError, match=message):
        build_qwen3_next(broken)


def _mtp_tensors(config: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors under checkpoint names (per-expert, the shared expert apart), shaped from
    the model's own in the separate layout."""
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
        for name, block in list(model.named_modules()):
            if isinstance(block, SparseMoE):  # the same block in the separate layout
                parent, _, child = name.rpartition(".")
                separate = SparseMoE(
                    block.hidden_size,
                    block.num_experts,
                    block.top_k,
                    block.experts.intermediate_size,
                    block.shared_expert_intermediate_size,
                    block.norm_topk_prob,
                )
                setattr(model.get_submodule(parent), child, separate)
        shapes = {n: p.shape for n, p in model.named_parameters() if n.startswith("mtp.")}
    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), shape[1] // 2
            for e in range(shape[0]):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = torch.randn(half, shape[2], generator=gen)
                tensors[f"{prefix}.{e}.up_proj.weight"] = torch.randn(half, shape[2], generator=gen)
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(shape[0]):
                tensors[f"{prefix}.{e}.down_proj.weight"] = torch.randn(*shape[1:], generator=gen)
        else:
            tensors[name] = torch.randn(*shape, generator=gen)
    return tensors


def test_mtp_weights_load_into_the_mtp_head(small_checkpoint, tmp_path, build_qwen3_next):
    config = Qwen3NextConfig.from_hf(json.loads((small_checkpoint / "config.json").read_text()))
    mtp = _mtp_tensors(config)
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in mtp and "mtp.fc.weight" in mtp
    model = build_qwen3_next(_copy_with(small_checkpoint, tmp_path / "mtp", lambda t: {**t, **mtp}))
    assert model.mtp is not None and len(model.mtp.layers) == 1
    assert torch.equal(model.mtp.fc.weight, mtp["mtp.fc.weight"])
    assert torch.equal(
        model.mtp.layers[0].mlp.experts.gate_up_proj[3, SMALL["moe_intermediate_size"] :],
        mtp["mtp.layers.0.mlp.experts.3.up_proj.weight"],
    )
    # Full attention with its own ordinal after the trunk's one attention layer.
    assert model.mtp.layers[0].self_attn.attention_ordinal == 1

    partial = {k: v for k, v in mtp.items() if k != "mtp.pre_fc_norm_hidden.weight"}
    with pytest.raises(ModelLoadError, match=r"mtp\.pre_fc_norm_hidden"):
        build_qwen3_next(_copy_with(small_checkpoint, tmp_path / "partial", lambda t: {**t, **partial}))


def test_checkpoint_without_mtp_has_no_mtp_head(small_checkpoint, build_qwen3_next):
    model = build_qwen3_next(small_checkpoint)
    assert model.mtp is None
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())


def test_bf16_prefill_and_decode_stay_close_to_transformers(
    small_checkpoint, build_qwen3_next, hybrid_backend
):
    """bf16 follows transformers' rounding points; what remains is summation order in bf16."""
    ours = build_qwen3_next(small_checkpoint, torch.bfloat16)
    reference = transformers.Qwen3NextForCausalLM.from_pretrained(
        small_checkpoint, dtype=torch.bfloat16
    ).eval()
    tokens = list(range(3, 80))
    backend = hybrid_backend(ours)
    with torch.no_grad():
        out = reference(torch.tensor([tokens[:70]]), use_cache=True)
        actual = backend.prefill(ours, tokens[:70])
        assert (actual - out.logits[0].float()).abs().max() < 0.05
        cache = out.cache
        for token in tokens[70:]:
            out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.cache
            assert (backend.run(ours, {0: [token]})[0] - out.logits[0].float()).abs().max() < 0.05
