"""What the Qwen3-Next-family models (qwen3_next.py, qwen4_exp.py) build alike from their config
(models/hybrid_config.py): their Gated DeltaNet, attention and sparse-MoE layers, the Gated DeltaNet
layers' per-sequence state, and the causal LM around the trunk (a tied or separate LM head, an optional
MTP head)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from morion.cache.spec import StateComponent
from morion.layers.gated_delta_net import GatedDeltaNet
from morion.layers.moe import SparseMoE
from morion.models.hybrid_config import HybridConfig

Attention = TypeVar("Attention", bound=nn.Module)


def attention(config: HybridConfig, ordinal: int, layer: type[Attention], **options: Any) -> Attention:
    """Attention layer number `ordinal`: `layer` (a `GatedAttentionProjections`) with the config's
    shapes, and `options` for what the subclass adds."""
    return layer(
        ordinal,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.rms_norm_eps,
        config.attention_bias,
        **options,
    )


def gated_delta_net(
    config: HybridConfig, ordinal: int, layer: type[GatedDeltaNet] = GatedDeltaNet, **options: Any
) -> GatedDeltaNet:
    """Gated DeltaNet layer number `ordinal` (`layer`: the class, for its projection layout)."""
    return layer(
        ordinal,
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        config.rms_norm_eps,
        **options,
    )


def sparse_moe(config: HybridConfig) -> SparseMoE:
    """The MoE block, its shared expert stacked as one more routed-kernel expert where it is as wide as a
    routed one (layers/moe.py; the 80B and Flash-Next shapes: 512 and 640)."""
    width = config.moe_intermediate_size
    return SparseMoE(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        width,
        config.shared_expert_intermediate_size,
        config.norm_topk_prob,
        stack_shared_expert=width > 0 and config.shared_expert_intermediate_size == width,
    )


def gated_delta_net_states(
    config: HybridConfig, model_dtype: torch.dtype, state_dtype: torch.dtype
) -> tuple[StateComponent, ...]:
    """Per sequence, for each Gated DeltaNet layer: the conv window (the last W-1 pre-conv q|k|v vectors,
    token-major as vLLM keeps it) in the model's dtype and the recurrent state [HV, Dk, Dv] in
    `state_dtype`. None without Gated DeltaNet layers."""
    num_linear = len(config.linear_layers)
    if not num_linear:
        return ()
    return (
        StateComponent("conv", num_linear, (config.linear_conv_kernel_dim - 1, config.conv_dim), model_dtype),
        StateComponent(
            "recurrent",
            num_linear,
            (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
            state_dtype,
        ),
    )


class HybridForCausalLM(nn.Module):
    """The trunk `model` (with `embed_tokens`), the LM head and the MTP head (`mtp`, None when the config
    has no MTP layers or the checkpoint carries none: see models/moe_checkpoint.py).

    What `forward` returns ("the hidden states", [T, `hidden_width`]) is whatever the model's
    `compute_logits` and its MTP head read: Qwen3-Next's final-normed hidden state ([T, H]), or
    Qwen3.8-Flash-Next's pre-mixer hyper-connection streams ([T, n * H], the mixer applied by
    `compute_logits`). The engine keeps them per position for the MTP drafter (spec/mtp.py), which feeds
    them to `mtp_forward` and reads its draft logits through `mtp_head_input` and `lm_logits`.
    """

    # A short forward of one sequence (2 to SHORT_CHUNK_TOKENS new tokens: a prompt's tail) makes no host
    # sync, so the engine replays it from a CUDA graph (runner/model_runner.capture_short_graphs); models
    # without the attribute (the dense ones) run it eagerly.
    short_chunk_graphs: ClassVar[bool] = True

    def __init__(
        self, config: HybridConfig, model: nn.Module, mtp: Callable[[HybridConfig], nn.Module]
    ) -> None:
        """`mtp` builds the MTP head from the config (not called when the config has no MTP layers)."""
        super().__init__()
        self.config = config
        self.model = model
        # Tied checkpoints read logits through the embedding matrix itself (as in llama.py).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.mtp = mtp(config) if config.num_mtp_layers > 0 else None

    @property
    def hidden_width(self) -> int:
        """Width of the hidden states `forward` and `mtp_forward` return (hidden_size here)."""
        return self.config.hidden_size

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head alone: x [T, hidden_size] (what the head reads) -> fp32 logits [T, vocab]."""
        # Through the module, not its weight: under --weight-dtype fp8 the head is an Fp8Linear.
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight).float()
        return self.lm_head(x).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of hidden states [T, hidden_width] as `forward` returns them."""
        return self.lm_logits(hidden)

    def mtp_head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from the MTP head's output (`mtp_forward`): here that output itself."""
        return hidden
