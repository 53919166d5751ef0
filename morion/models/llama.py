"""The dense decoder family: Llama (SmolLM2, Llama 3), Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm).

Module names follow the Hugging Face checkpoints, so a checkpoint's tensor names are parameter names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from morion.cache.spec import CacheSpec, TokenComponent
from morion.errors import ModelLoadError
from morion.layers.attention import AttentionBackend, SelfAttention
from morion.layers.mlp import SwiGLU
from morion.layers.norm import RMSNorm
from morion.layers.rotary import RotaryEmbedding
from morion.models.checkpoint import carries_nothing, copy_checkpoint_tensor, fp8_scales, require_complete


@dataclass(frozen=True)
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DenseConfig:
        model_type = hf["model_type"]
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r} for {model_type} (need silu)")
        num_heads = hf["num_attention_heads"]
        # transformers >= 5 nests theta and scaling in `rope_parameters`; older configs keep them flat.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has QKV bias (its config has no flag); Llama and Qwen3 state it.
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: DenseConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(
            layer_index,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            bias=config.attention_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseModel(nn.Module):
    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)


class DenseForCausalLM(nn.Module):
    """Token-flat interface: input_ids and positions are [T]; the backend knows which sequence each is."""

    # --weight-dtype fp8 converts every projection and the LM head (layers/fp8_convert.py).
    fp8_keep: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DenseModel(config)
        # Tied checkpoints read logits through the embedding matrix itself: no second parameter that
        # meta-device construction or dtype conversion could silently untie.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; `compute_logits` turns the ones needed into logits."""
        return self.model(input_ids, positions, backend)

    def cache_spec(
        self, page_size: int, kv_dtype: torch.dtype, state_dtype: torch.dtype = torch.float32
    ) -> CacheSpec:
        """Per token: K and V of every layer. No per-request state (`state_dtype` has nothing to set)."""
        kv = TokenComponent(
            "kv", self.config.num_layers, (2, self.config.num_kv_heads, self.config.head_dim), kv_dtype
        )
        return CacheSpec(page_size, (kv,))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Through the module, not its weight: under --weight-dtype fp8 the head is an Fp8Linear.
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        scales = fp8_scales(self)
        missing = set(params)
        for name, tensor in weights:
            if carries_nothing(name, self.config.tie_word_embeddings):
                continue
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.config.model_type}")
            copy_checkpoint_tensor(name, tensor, param, scales.get(name))
            missing.discard(name)
        require_complete(missing)
