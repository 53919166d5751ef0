"""Full-size configurations for random-weight benchmarking (`--model preset:NAME`): real shapes, no
checkpoint. Values are the released Qwen3-Next-80B-A3B config.json and Qwen3.8-Flash-Next's text_config
(see the reference notes, §1 and §4.2) and vision_config (its image processor: Qwen3-VL's settings,
multimodal/processing.py). One toy-sized preset keeps the Qwen3-Next layer pattern for smoke
runs of the server and tools on a CPU."""

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

# The text model of the RadixArk NVFP4 release (its text_config), with the n-gram (PLE) table declared
# FP8: random weights draw it in host RAM as e4m3 codes with a global scale, never on the device.
_QWEN3_8_FLASH_NEXT_TEXT: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "norm_topk_prob": True,
    "hc_count": 4,
    "hc_lowrank": 320,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20000000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128,
    "seed": 1234,
    "ple_embedding_dtype": "float8_e4m3fn",
    "output_gate_type": "sigmoid",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": 248044,
    "eos_token_id": 248044,
}

# Its vision tower (vision_config; issue #26): 27 blocks of width 1152, 16-pixel patches of 2 frames, 2x2
# patches merged into one token of the text model's width; 449 M parameters.
_QWEN3_8_FLASH_NEXT_VISION: dict[str, Any] = {
    "model_type": "qwen4_exp_vision",
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2560,
    "num_position_embeddings": 2304,
}


def _flash_next(num_layers: int) -> dict[str, Any]:
    """The multimodal config (`qwen4_exp`: text_config + vision_config, Qwen's image token ids)."""
    return {
        "model_type": "qwen4_exp",
        "text_config": {**_QWEN3_8_FLASH_NEXT_TEXT, "num_hidden_layers": num_layers},
        "vision_config": _QWEN3_8_FLASH_NEXT_VISION,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
    }


# The 80B preset's layer pattern and options (gated attention every 2nd layer here, MoE, MTP head) at toy
# sizes: 4 layers, hidden 64, vocabulary 512, 0.3 M parameters. It starts on a CPU in seconds, so the
# server path can be tried and tested without a checkpoint; its outputs mean nothing.
_QWEN3_NEXT_TINY: dict[str, Any] = {
    **_QWEN3_NEXT_80B_A3B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B_A3B,
    # The same layers, 12 of 48 (3 GDN : 1 attention kept): fits a GPU in BF16 for quick benchmarks.
    "qwen3-next-80b-a3b-12l": {**_QWEN3_NEXT_80B_A3B, "num_hidden_layers": 12},
    "qwen3.8-flash-next": _flash_next(48),
    # 12 of 48 layers (3 GDN : 1 QSA, PLE at layer 1 kept; the full n-gram table): fits a GPU in BF16.
    "qwen3.8-flash-next-12l": _flash_next(12),
    "qwen3-next-tiny": _QWEN3_NEXT_TINY,
}


def is_preset(model: str | None) -> bool:
    return model is not None and model.startswith(PRESET_PREFIX)


def preset_config(model: str) -> dict[str, Any]:
    name = model.removeprefix(PRESET_PREFIX)
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return dict(PRESETS[name])
