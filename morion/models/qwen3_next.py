"""Qwen3-Next: a hybrid of Gated DeltaNet and gated full-attention layers, every layer a sparse MoE.

Module names follow the Hugging Face checkpoints, so checkpoint names are parameter names, except the
routed experts: checkpoints store them per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the model
keeps them stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and
`load_weights` scatters them. Already stacked checkpoints (transformers' in-memory names) load as is.

The native MTP head (`mtp.*`) is loaded into `self.mtp` and not run by `forward`. Its math, for the
speculative decoder that will run it (vLLM/sglang `qwen3_next_mtp`): for draft position t,
`x = fc(cat[pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)])` with h_t the target's
final-normed hidden state, then `mtp.layers` (full-attention decoder layers), `mtp.norm`, and the
target's lm_head.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from morion.cache.spec import CacheSpec, StateComponent, TokenComponent
from morion.errors import ModelLoadError
from morion.layers.gated_attention import GatedAttention
from morion.layers.gated_delta_net import GatedDeltaNet
from morion.layers.hybrid_backend import HybridBackend
from morion.layers.mlp import SwiGLU
from morion.layers.moe import SparseMoE
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import RotaryEmbedding
from morion.models.checkpoint import carries_nothing, copy_checkpoint_tensor, fp8_scales, require_complete

logger = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class Qwen3NextConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # full attention
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
    # feed-forward: a sparse MoE, except dense SwiGLU layers listed in `dense_mlp_layers`
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    intermediate_size: int
    dense_mlp_layers: tuple[int, ...]
    num_mtp_layers: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3NextConfig:
        model_type = hf.get("model_type", "qwen3_next")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r} for {model_type} (need silu)")
        num_layers = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types")
        if layer_types is None:
            interval = hf.get("full_attention_interval", 4)
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        layer_types = tuple(layer_types)
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            raise ModelLoadError(f"unsupported layer_types {unknown} for {model_type}")
        if len(layer_types) != num_layers:
            raise ModelLoadError(
                f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}"
            )
        # transformers >= 5 nests theta and the partial factor in `rope_parameters`; the released
        # Qwen3-Next config.json keeps `rope_theta` and `partial_rotary_factor` at the top level.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary_dim = int(head_dim * partial)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ModelLoadError(f"partial_rotary_factor {partial} gives an odd rotary dim {rotary_dim}")
        num_experts = hf.get("num_experts", 0)
        sparse_step = hf.get("decoder_sparse_step", 1)
        mlp_only = set(hf.get("mlp_only_layers") or ())
        dense_mlp_layers = tuple(
            i for i in range(num_layers) if i in mlp_only or num_experts == 0 or (i + 1) % sparse_step != 0
        )
        num_v_heads, num_k_heads = hf["linear_num_value_heads"], hf["linear_num_key_heads"]
        if num_v_heads % num_k_heads:
            raise ModelLoadError(f"linear_num_value_heads {num_v_heads} is not a multiple of {num_k_heads}")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope=rope,
            attention_bias=bool(hf.get("attention_bias", False)),
            linear_num_key_heads=num_k_heads,
            linear_num_value_heads=num_v_heads,
            linear_key_head_dim=hf["linear_key_head_dim"],
            linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            intermediate_size=hf.get("intermediate_size", 0),
            dense_mlp_layers=dense_mlp_layers,
            # Not in transformers' config; vLLM and sglang default it to 1 (the released model has one).
            num_mtp_layers=hf.get("num_nextn_predict_layers", 1),
        )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then + mlp(norm(.)). The mixer is gated attention
    (`self_attn`) or Gated DeltaNet (`linear_attn`); `ordinal` counts layers of the same kind."""

    def __init__(self, config: Qwen3NextConfig, layer_type: str, ordinal: int, sparse_mlp: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(
                ordinal,
                config.hidden_size,
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.rms_norm_eps,
                bias=config.attention_bias,
            )
        else:
            self.linear_attn = GatedDeltaNet(
                ordinal,
                config.hidden_size,
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel_dim,
                config.rms_norm_eps,
            )
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if sparse_mlp:
            self.mlp = SparseMoE(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                config.norm_topk_prob,
            )
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: HybridBackend
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == FULL_ATTENTION:
            h = self.self_attn(h, cos, sin, backend)
        else:
            h = self.linear_attn(h, backend)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        ordinals = {FULL_ATTENTION: 0, LINEAR_ATTENTION: 0}
        layers = []
        for i, layer_type in enumerate(config.layer_types):
            sparse = i not in config.dense_mlp_layers
            layers.append(Qwen3NextDecoderLayer(config, layer_type, ordinals[layer_type], sparse))
            ordinals[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: HybridBackend
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)


class Qwen3NextMTP(nn.Module):
    """The multi-token-prediction head's weights (see the module docstring for its math).

    Its decoder layers are full-attention layers; their attention ordinals continue after the trunk's.
    """

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        first = len(config.attention_layers)
        sparse = config.num_experts > 0
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, FULL_ATTENTION, first + i, sparse)
            for i in range(config.num_mtp_layers)
        )
        self.norm = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)


# Per-expert checkpoint names, scattered into the stacked parameters.
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class Qwen3NextForCausalLM(nn.Module):
    """Token-flat interface: input_ids and positions are [T]; the backend knows which sequence each is."""

    # Linear layers --weight-dtype fp8 leaves in the model dtype (layers/fp8_convert.py): the router and
    # the shared-expert gate decide which experts run and how much of the shared expert passes (a flipped
    # top-k choice costs more accuracy than their bytes are worth), and in_proj_ba feeds the Gated
    # DeltaNet decay and write gates, whose errors compound over the sequence. For the 80B model that is
    # ~0.11 GB of ~80 GB, and at N <= 512 these GEMMs gain nothing from FP8 at decode sizes.
    fp8_keep: ClassVar[tuple[str, ...]] = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba")

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config)
        # Tied checkpoints read logits through the embedding matrix itself (as in llama.py).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # None when the config has no MTP layers or the checkpoint carries none (see load_weights).
        self.mtp: Qwen3NextMTP | None = Qwen3NextMTP(config) if config.num_mtp_layers > 0 else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: HybridBackend
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; `compute_logits` turns the ones needed into logits."""
        return self.model(input_ids, positions, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Through the module, not its weight: under --weight-dtype fp8 the head is an Fp8Linear.
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        target_hidden: torch.Tensor,
        backend: HybridBackend,
    ) -> torch.Tensor:
        """The MTP head at flat positions [T]: row t fuses the embedding of `input_ids[t]` (the token
        after position t) with `target_hidden[t]` (the hidden state at position t that predicted it: the
        trunk's final-normed output, or this head's own output for a chained draft step) and runs the
        head's decoder layers (their K/V at the attention ordinals after the trunk's) and norm. Returns
        [T, hidden]; `compute_logits` gives the draft distribution for the token after input_ids[t]."""
        mtp = self.mtp
        if mtp is None:
            raise RuntimeError("this model has no MTP head (its checkpoint carries no mtp.* weights)")
        embedded = mtp.pre_fc_norm_embedding(self.model.embed_tokens(input_ids))
        x = mtp.fc(torch.cat((embedded, mtp.pre_fc_norm_hidden(target_hidden)), dim=-1))
        cos, sin = self.model.rotary(positions)
        for layer in mtp.layers:
            x = layer(x, cos, sin, backend)
        return mtp.norm(x)

    def cache_spec(
        self,
        page_size: int,
        kv_dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32,
        draft_layers: bool = False,
    ) -> CacheSpec:
        """K/V per token for each full-attention layer (and, with `draft_layers`, the MTP head's layers
        after them: its K/V is paged with the trunk's); per sequence, for each Gated DeltaNet layer, the
        conv window (the last W-1 pre-conv q|k|v vectors, token-major as vLLM keeps it, in the model's
        dtype) and the recurrent state [HV, Dk, Dv] in `state_dtype` (fp32 by default)."""
        config = self.config
        num_linear = len(config.linear_layers)
        model_dtype = self.model.embed_tokens.weight.dtype
        states = ()
        if num_linear:
            states = (
                StateComponent(
                    "conv", num_linear, (config.linear_conv_kernel_dim - 1, config.conv_dim), model_dtype
                ),
                StateComponent(
                    "recurrent",
                    num_linear,
                    (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
                    state_dtype,
                ),
            )
        kv_layers = len(config.attention_layers) + (len(self.mtp.layers) if draft_layers and self.mtp else 0)
        kv = TokenComponent("kv", kv_layers, (2, config.num_kv_heads, config.head_dim), kv_dtype)
        return CacheSpec(page_size, (kv,), states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the parameters; every parameter must be covered.

        MTP weights are all or nothing: a checkpoint without any `mtp.*` tensor (transformers'
        `save_pretrained` writes none) leaves the model without its MTP head (`self.mtp = None`).
        """
        params = dict(self.named_parameters())
        scales = fp8_scales(self)
        # Checkpoint names still to arrive; a stacked expert tensor counts as its per-expert names.
        missing = {unit for name, param in params.items() for unit in _checkpoint_names(name, param)}
        saw_mtp = False
        for name, tensor in weights:
            if carries_nothing(name, self.config.tie_word_embeddings):
                continue
            saw_mtp = saw_mtp or name.startswith("mtp.")
            param_name, index, covered = self._weight_target(name, params)
            scale = scales.get(param_name)
            copy_checkpoint_tensor(
                name, tensor, params[param_name][index], None if scale is None else scale[index]
            )
            missing.difference_update(covered)
        if not saw_mtp and self.mtp is not None:
            logger.info("checkpoint has no mtp.* weights: the model has no MTP head")
            self.mtp = None
            missing = {name for name in missing if not name.startswith("mtp.")}
        require_complete(missing)

    def _weight_target(
        self, name: str, params: dict[str, nn.Parameter]
    ) -> tuple[str, tuple[int | slice, ...], list[str]]:
        """The parameter that checkpoint tensor `name` fills, the index of the part it fills (a stacked
        expert's slice; the same index selects an FP8 parameter's per-row scales) and the checkpoint
        names it covers."""
        param = params.get(name)
        if param is not None:
            return name, (), _checkpoint_names(name, param)
        match = _PER_EXPERT.match(name)
        if match is not None:
            expert, proj = int(match["expert"]), match["proj"]
            kind = "down_proj" if proj == "down_proj" else "gate_up_proj"
            stacked_name = f"{match['experts']}.{kind}"
            stacked = params.get(stacked_name)
            if stacked is not None and expert < stacked.shape[0]:
                if proj == "down_proj":
                    return stacked_name, (expert,), [name]
                size = stacked.shape[1] // 2
                rows = slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
                return stacked_name, (expert, rows), [name]
        raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.config.model_type}")


def _checkpoint_names(name: str, param: torch.Tensor) -> list[str]:
    """The per-expert checkpoint names a stacked expert parameter stands for; otherwise its own name."""
    experts, _, kind = name.rpartition(".")
    if not experts.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
        return [name]
    projections = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return [f"{experts}.{e}.{proj}.weight" for e in range(param.shape[0]) for proj in projections]
