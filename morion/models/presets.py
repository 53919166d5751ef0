"""Full-size configurations for random-weight benchmarking (`--model preset:NAME`): real shapes, no
checkpoint. Values are the released Qwen3-Next-80B-A3B config.json (see the reference notes, §1)."""

from __future__ import annotations

from typing import Any

from morion.errors import ModelLoadError

PRESET_PREFIX = "preset:"

_QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B_A3B,
    # The same layers, 12 of 48 (3 GDN : 1 attention kept): fits a GPU in BF16 for quick benchmarks.
    "qwen3-next-80b-a3b-12l": {**_QWEN3_NEXT_80B_A3B, "num_hidden_layers": 12},
}


def is_preset(model: str | None) -> bool:
    return model is not None and model.startswith(PRESET_PREFIX)


def preset_config(model: str) -> dict[str, Any]:
    name = model.removeprefix(PRESET_PREFIX)
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return dict(PRESETS[name])
