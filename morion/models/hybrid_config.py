"""What the configs of the Gated DeltaNet / attention hybrids with a sparse MoE (Qwen3-Next,
Qwen3.8-Flash-Next) share: the fields and their parsing from a Hugging Face config.json, with
transformers' defaults and checks. What cannot run is refused with a message naming the value
(`ModelLoadError`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from morion.errors import ModelLoadError
from morion.layers.rotary import scaled_context_length, standardize_rope

LINEAR_ATTENTION = "linear_attention"


def unsupported(model_type: str, reason: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported {model_type} config: {reason}")


@dataclass(frozen=True)
class HybridConfig:
    """Each layer is `LINEAR_ATTENTION` (Gated DeltaNet) or the subclass's `attention_type`."""

    attention_type: ClassVar[str]

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int  # with YaRN, its original context x factor when that is longer
    tie_word_embeddings: bool
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope: dict[str, Any]
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # sparse MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    num_mtp_layers: int

    @classmethod
    def common_fields(
        cls,
        model_type: str,
        hf: dict[str, Any],
        partial_rotary_factor: float,
        attention_names: Collection[str] = (),
    ) -> dict[str, Any]:
        """The fields both models parse alike, checked. `partial_rotary_factor` is the default where the
        config sets none; `attention_names` are other names of attention layers in `layer_types`."""
        if hf.get("hidden_act", "silu") != "silu":
            raise unsupported(model_type, f"hidden_act {hf['hidden_act']!r} (need silu)")
        num_layers = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types")
        if layer_types is None:
            interval = hf.get("full_attention_interval", 4)
            layer_types = [
                cls.attention_type if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, cls.attention_type, *attention_names})
        if unknown:
            raise unsupported(model_type, f"layer_types {unknown}")
        layer_types = tuple(
            LINEAR_ATTENTION if t == LINEAR_ATTENTION else cls.attention_type for t in layer_types
        )
        if len(layer_types) != num_layers:
            raise unsupported(
                model_type, f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}"
            )
        # transformers >= 5 nests theta and the partial factor in `rope_parameters`; the released
        # Qwen3-Next config.json keeps `rope_theta` and `partial_rotary_factor` at the top level, and
        # its model card adds YaRN as `rope_scaling` (which transformers prefers when both are there).
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        partial = float(
            rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", partial_rotary_factor))
        )
        max_position_embeddings = hf.get("max_position_embeddings", 32768)
        try:
            rope = standardize_rope(rope, max_position_embeddings, hf.get("original_max_position_embeddings"))
        except ModelLoadError as error:
            raise ModelLoadError(f"{model_type} config: {error}") from None
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary_dim = int(head_dim * partial)
        if rotary_dim < 2 or rotary_dim % 2:
            raise unsupported(
                model_type, f"partial_rotary_factor {partial} gives an odd rotary dim {rotary_dim}"
            )
        num_v_heads, num_k_heads = hf["linear_num_value_heads"], hf["linear_num_key_heads"]
        if num_v_heads % num_k_heads:
            raise unsupported(
                model_type, f"linear_num_value_heads {num_v_heads} is not a multiple of {num_k_heads}"
            )
        return dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            # YaRN's original context x factor when that is longer (what the positions may reach)
            max_position_embeddings=scaled_context_length(rope, max_position_embeddings),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope=rope,
            attention_bias=bool(hf.get("attention_bias", False)),
            linear_num_key_heads=num_k_heads,
            linear_num_value_heads=num_v_heads,
            linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == self.attention_type)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )
