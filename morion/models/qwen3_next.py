"""Qwen3-Next: a hybrid of Gated DeltaNet and gated full-attention layers, every layer a sparse MoE.

Module names follow the Hugging Face checkpoints, so checkpoint names are parameter names, except the
routed experts: checkpoints store them per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the model
keeps them stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and
`load_weights` scatters them (models/moe_checkpoint.py). Already stacked checkpoints (transformers'
in-memory names) load as is.

The native MTP head (`mtp.*`) is loaded into `self.mtp` and not run by `forward`. Its math, for the
speculative decoder that will run it (vLLM/sglang `qwen3_next_mtp`): for draft position t,
`x = fc(cat[pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)])` with h_t the target's
final-normed hidden state, then `mtp.layers` (full-attention decoder layers), `mtp.norm`, and the
target's lm_head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from morion.cache.spec import CacheSpec, TokenComponent
from morion.layers.gated_attention import GatedAttention
from morion.layers.hybrid_backend import HybridBackend
from morion.layers.mlp import SwiGLU
from morion.layers.moe import SparseMoE
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import RotaryEmbedding
from morion.models.checkpoint import carries_nothing, require_complete
from morion.models.hybrid_config import LINEAR_ATTENTION, HybridConfig
from morion.models.hybrid_model import (
    HybridForCausalLM,
    attention,
    gated_delta_net,
    gated_delta_net_states,
    sparse_moe,
)
from morion.models.moe_checkpoint import MoECheckpointLoader
from morion.ops.slot_partials import SlotPartials

FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class Qwen3NextConfig(HybridConfig):
    """The feed-forward is a sparse MoE, except dense SwiGLU layers listed in `dense_mlp_layers`."""

    attention_type: ClassVar[str] = FULL_ATTENTION

    intermediate_size: int
    dense_mlp_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3NextConfig:
        model_type = hf.get("model_type", "qwen3_next")
        common = cls.common_fields(model_type, hf, partial_rotary_factor=0.25)
        num_layers = common["num_layers"]
        num_experts = hf.get("num_experts", 0)
        sparse_step = hf.get("decoder_sparse_step", 1)
        mlp_only = set(hf.get("mlp_only_layers") or ())
        dense_mlp_layers = tuple(
            i for i in range(num_layers) if i in mlp_only or num_experts == 0 or (i + 1) % sparse_step != 0
        )
        return cls(
            **common,
            linear_key_head_dim=hf["linear_key_head_dim"],
            linear_value_head_dim=hf["linear_value_head_dim"],
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
            intermediate_size=hf.get("intermediate_size", 0),
            dense_mlp_layers=dense_mlp_layers,
            # Not in transformers' config; vLLM and sglang default it to 1 (the released model has one).
            num_mtp_layers=hf.get("num_nextn_predict_layers", 1),
        )


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then + mlp(norm(.)). The mixer is gated attention
    (`self_attn`) or Gated DeltaNet (`linear_attn`); `ordinal` counts layers of the same kind.

    The residual stream is carried beside the block outputs, so each add happens together with the norm
    after it (`ZeroCentredRMSNorm.add_and_norm`, one kernel on CUDA): the layer takes the previous
    layer's MLP output `x` and the stream before it (`residual`; None for the first layer, whose `x` is
    the stream itself) and returns its own MLP output and stream. The stream after the layer is
    `residual + x` of its outputs; the values are those of the plain `x = x + block(norm(x))` sequence.

    Where a block reads its input quantized per row (FP8 weights: the mixer's input projections, the
    routed experts; `reads_fp8_rows`, fixed once `--weight-dtype fp8` has converted the model), the norm
    before it quantizes the normed rows in the same kernel (`add_and_norm(quantize=True)`) and the layer
    hands them to the block, instead of the block quantizing them in a kernel of its own. BF16 blocks
    get no quantization. The router and in_proj_ba still read the normed rows in the model dtype.
    """

    def __init__(self, config: Qwen3NextConfig, layer_type: str, ordinal: int, sparse_mlp: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = attention(config, ordinal, GatedAttention)
        else:
            self.linear_attn = gated_delta_net(config, ordinal)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if sparse_mlp:
            self.mlp = sparse_moe(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor | SlotPartials,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: HybridBackend,
    ) -> tuple[torch.Tensor | SlotPartials, torch.Tensor]:
        mixer = self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn
        if residual is None:  # the first layer: no add to fuse; an FP8 mixer quantizes h itself
            h, residual, quantized = self.input_layernorm(x), x, None
        else:
            h, residual, quantized = self.input_layernorm.add_and_norm(x, residual, mixer.reads_fp8_rows)
        if self.layer_type == FULL_ATTENTION:
            h = mixer(h, cos, sin, backend, quantized=quantized)
        else:
            h = mixer(h, backend, quantized=quantized)
        if isinstance(self.mlp, SparseMoE):
            # The block's output goes only to the next add + norm (the next layer's, or the final norm's),
            # whose kernel adds the experts' slots itself where the fused decode kernels ran (`unsummed`).
            quantize = self.mlp.reads_fp8_rows
            h, residual, quantized = self.post_attention_layernorm.add_and_norm(h, residual, quantize)
            return self.mlp(h, quantized=quantized, unsummed=True), residual
        h, residual, _ = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


def run_layers(
    layers: Iterable[Qwen3NextDecoderLayer],
    norm: ZeroCentredRMSNorm,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backend: HybridBackend,
) -> torch.Tensor:
    """The stream x through `layers`, then `norm`: the last layer's residual add fused with it."""
    residual = None
    for layer in layers:
        x, residual = layer(x, residual, cos, sin, backend)
    return norm(x) if residual is None else norm.add_and_norm(x, residual).normed


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
        return run_layers(self.layers, self.norm, self.embed_tokens(input_ids), cos, sin, backend)


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


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Token-flat interface: input_ids and positions are [T]; the backend knows which sequence each is."""

    # Linear layers --weight-dtype fp8 leaves in the model dtype (layers/fp8_convert.py): the router and
    # the shared-expert gate decide which experts run and how much of the shared expert passes (a flipped
    # top-k choice costs more accuracy than their bytes are worth), and in_proj_ba feeds the Gated
    # DeltaNet decay and write gates, whose errors compound over the sequence. For the 80B model that is
    # ~0.11 GB of ~80 GB, and at N <= 512 these GEMMs gain nothing from FP8 at decode sizes.
    fp8_keep: ClassVar[tuple[str, ...]] = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba")

    config: Qwen3NextConfig
    mtp: Qwen3NextMTP | None

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__(config, Qwen3NextModel(config), Qwen3NextMTP)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: HybridBackend
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; `compute_logits` turns the ones needed into logits."""
        return self.model(input_ids, positions, backend)

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
        return run_layers(mtp.layers, mtp.norm, x, cos, sin, backend)

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
        states = gated_delta_net_states(config, self.model.embed_tokens.weight.dtype, state_dtype)
        kv_layers = len(config.attention_layers) + (len(self.mtp.layers) if draft_layers and self.mtp else 0)
        kv = TokenComponent("kv", kv_layers, (2, config.num_kv_heads, config.head_dim), kv_dtype)
        return CacheSpec(page_size, (kv,), states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the parameters, per-expert ones scattered into the
        stacked experts; every parameter must be covered. MTP weights are all or nothing (see
        models/moe_checkpoint.py)."""
        loader = MoECheckpointLoader(self, self.config.model_type)
        for name, tensor in weights:
            if not carries_nothing(name, self.config.tie_word_embeddings):
                loader.copy(name, tensor)
        require_complete(loader.finish())
