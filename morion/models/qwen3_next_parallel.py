"""Qwen3-Next split over N tensor-parallel ranks (issue #28): each rank's configuration and which part of
every checkpoint tensor it holds (parallel/shards.py).

The split, as SGLang and vLLM make it for this model:
- gated attention by query heads: q_proj (each head's query and gate dims together) and o_proj's input;
  K/V heads split too, or shared by consecutive ranks where there are fewer K/V heads than ranks;
- Gated DeltaNet by key-head group: in_proj_qkvz and in_proj_ba are stored group-first (each group's q, k,
  v, z, or b, a, together), so a group is a contiguous block; conv1d's channels are q | k | v (each
  head-major), cut block by block; A_log and dt_bias by value head; out_proj's input by value head. The
  conv and recurrent states are then per rank (their sizes follow the local heads);
- the MoE's experts by intermediate size (every rank holds every expert, 1/N of each), the shared expert
  and dense MLPs column- then row-parallel; the router and the shared expert's gate whole. A shared
  expert stacked as expert E (layers/moe.py) is then cut like every routed expert, from its own checkpoint
  tensors (the rules below still name them), and its gate is the replicated router's row E;
- the LM head by vocabulary (logits gathered before sampling); embeddings and norms whole.
A layer's output projections (o_proj, out_proj, the experts' and shared expert's down) then hold partial
sums, added across ranks by one all-reduce per mixer and one per MLP (o_proj's bias, where there is one,
on rank 0 only, so that it is added once).
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from morion.errors import ModelLoadError
from morion.models.qwen3_next import Qwen3NextConfig
from morion.parallel.group import TensorParallel
from morion.parallel.shards import REPLICATED, FirstRank, ReplicatedHeads, Shard, Split, split_evenly


def local_config(config: Qwen3NextConfig, size: int) -> Qwen3NextConfig:
    """The configuration one of `size` ranks builds its modules from (vocabulary unchanged: the LM head's
    rows are split where it is built). A MorionError names what `size` does not divide."""
    if size == 1:
        return config
    heads = split_evenly(config.num_heads, size, "attention heads")
    kv = config.num_kv_heads
    kv_heads = split_evenly(kv, size, "K/V heads") if kv >= size else 1
    if kv < size:
        split_evenly(size, kv, "ranks over the K/V heads")  # shared evenly: size a multiple of kv
    return dataclasses.replace(
        config,
        num_heads=heads,
        num_kv_heads=kv_heads,
        linear_num_key_heads=split_evenly(config.linear_num_key_heads, size, "linear-attention key heads"),
        linear_num_value_heads=split_evenly(
            config.linear_num_value_heads, size, "linear-attention value heads"
        ),
        moe_intermediate_size=split_evenly(config.moe_intermediate_size, size, "expert intermediate size"),
        shared_expert_intermediate_size=split_evenly(
            config.shared_expert_intermediate_size, size, "shared expert intermediate size"
        ),
        intermediate_size=split_evenly(config.intermediate_size, size, "MLP intermediate size"),
    )


# Modules whose output is a partial sum on each rank: the mixers (o_proj, out_proj) and the MLPs.
_PARTIAL_SUMS = r"(model|mtp)\.layers\.\d+\.(self_attn|linear_attn|mlp)"


def split_lm_head(model: nn.Module, size: int) -> None:
    """A model built from `local_config` keeps its rank's block of the vocabulary in its LM head (called
    where the model is built, before it is converted or filled)."""
    if model.lm_head is None:
        raise ModelLoadError("tensor parallelism needs an untied LM head (this checkpoint ties it)")
    vocab = split_evenly(model.config.vocab_size, size, "vocabulary entries")
    model.lm_head = nn.Linear(model.config.hidden_size, vocab, bias=False)


def wire(model: nn.Module, tensor_parallel: TensorParallel) -> None:
    """The collectives of one rank, as forward hooks (the layers stay as they are at one rank, and CUDA
    graphs capture the collectives with the rest): each partial sum is added across ranks and the LM
    head's logits are gathered. After any module swap (FP8), which would drop a hook of the module."""
    model.lm_head.register_forward_hook(lambda module, inputs, out: tensor_parallel.gather_last_dim(out))
    for name, module in model.named_modules():
        if re.fullmatch(_PARTIAL_SUMS, name):
            module.register_forward_hook(lambda module, inputs, out: tensor_parallel.all_reduce_(out))


def shard_of(name: str, config: Qwen3NextConfig) -> Shard:
    """Which part of the whole tensor `name` (a parameter of the TP=1 model) a rank holds. Raises
    KeyError for a name no rule covers: a new parameter must be placed on purpose, never by default."""
    key = re.sub(r"\.\d+\.", ".N.", name)
    for pattern, shard in _rules(config):
        if re.fullmatch(pattern, key):
            return shard
    raise KeyError(f"no tensor-parallel rule for {name}")


def _rules(config: Qwen3NextConfig) -> list[tuple[str, Shard]]:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    intermediate = config.moe_intermediate_size
    layer = r"(model|mtp)\.layers\.N"
    kv = ReplicatedHeads(0, config.num_kv_heads)
    return [
        (rf"{layer}\.self_attn\.q_proj\.(weight|bias)", Split(0)),
        (rf"{layer}\.self_attn\.[kv]_proj\.(weight|bias)", kv),
        (rf"{layer}\.self_attn\.o_proj\.weight", Split(1)),
        (rf"{layer}\.self_attn\.o_proj\.bias", FirstRank()),
        (rf"{layer}\.linear_attn\.in_proj_(qkvz|ba)\.weight", Split(0)),
        (rf"{layer}\.linear_attn\.conv1d\.weight", Split(0, (key_dim, key_dim, value_dim))),
        (rf"{layer}\.linear_attn\.(A_log|dt_bias)", Split(0)),
        (rf"{layer}\.linear_attn\.out_proj\.weight", Split(1)),
        (rf"{layer}\.mlp\.experts\.gate_up_proj", Split(1, (intermediate, intermediate))),
        (rf"{layer}\.mlp\.experts\.down_proj", Split(2)),
        (rf"{layer}\.mlp\.(shared_expert\.|experts\.N\.)?(gate|up)_proj\.weight", Split(0)),
        (rf"{layer}\.mlp\.(shared_expert\.|experts\.N\.)?down_proj\.weight", Split(1)),
        (r"lm_head\.weight", Split(0)),
        (rf"{layer}\.(input_layernorm|post_attention_layernorm)\.weight", REPLICATED),
        (rf"{layer}\.self_attn\.[qk]_norm\.weight", REPLICATED),
        (rf"{layer}\.linear_attn\.norm\.weight", REPLICATED),
        (rf"{layer}\.mlp\.(gate|shared_expert_gate)\.weight", REPLICATED),
        (r"model\.(embed_tokens|norm)\.weight", REPLICATED),
        (r"mtp\.(fc|norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight", REPLICATED),
    ]
