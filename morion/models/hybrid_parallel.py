"""What the tensor-parallel splits of the Qwen3-Next-family models (qwen3_next_parallel.py,
qwen4_exp_parallel.py) share: each rank's configuration, the LM head by vocabulary, the collectives as
forward hooks, and the rules of the layers they build alike (models/hybrid_model.py): gated attention by
query heads, Gated DeltaNet's conv, gates and output by heads, the sparse MoE by intermediate size.

A rank's model is the one-rank model built from `local_config` (heads and intermediate sizes divided by
the number of ranks), so its layers run unchanged; the output projections (o_proj, out_proj, the experts'
and shared expert's down) then hold partial sums, added across ranks by one all-reduce per mixer and one
per MLP (o_proj's bias, where there is one, on rank 0 only, so that it is added once).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TypeVar

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.models.hybrid_config import HybridConfig
from morion.ops.slot_partials import SlotPartials
from morion.parallel.group import TensorParallel
from morion.parallel.shards import REPLICATED, FirstRank, ReplicatedHeads, Shard, Split, split_evenly

Config = TypeVar("Config", bound=HybridConfig)
Rules = list[tuple[str, Shard]]  # (pattern of a parameter name with `.N.` for indices, its shard)

# The decoder layers of the trunk and of the MTP head.
LAYER = r"(model|mtp)\.layers\.N"
# Modules whose output is a partial sum on each rank: the mixers (o_proj, out_proj) and the MLPs.
_PARTIAL_SUMS = r"(model|mtp)\.layers\.\d+\.(self_attn|linear_attn|mlp)"


def local_config(config: Config, size: int) -> Config:
    """The configuration one of `size` ranks builds its modules from: the fields `HybridConfig` has
    divided (vocabulary unchanged: the LM head's rows are split where it is built). A MorionError names
    what `size` does not divide."""
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
    )


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
            module.register_forward_hook(lambda module, inputs, out: _added_across(tensor_parallel, out))


def _added_across(tensor_parallel: TensorParallel, out: torch.Tensor | SlotPartials) -> torch.Tensor:
    """A module's partial sum added across ranks, in place. A MoE block's unsummed slots (`SlotPartials`,
    which its next kernel would add) are summed on the rank first: the hook's output replaces them, so
    the collective adds what one rank would have returned."""
    if isinstance(out, SlotPartials):
        out = out.summed()
    return tensor_parallel.all_reduce_(out)


def shard_by_rules(name: str, rules: Rules) -> Shard:
    """The shard of the first rule whose pattern matches `name` with its indices as `.N.`. Raises
    KeyError for a name no rule covers: a new parameter must be placed on purpose, never by default."""
    key = re.sub(r"\.\d+\.", ".N.", name)
    for pattern, shard in rules:
        if re.fullmatch(pattern, key):
            return shard
    raise KeyError(f"no tensor-parallel rule for {name}")


def shared_rules(config: HybridConfig) -> Rules:
    """The rules of the layers both models build alike: gated attention (QSA's projections too) by query
    heads, K/V heads split or shared by consecutive ranks; Gated DeltaNet's conv channels (q | k | v,
    each head-major, cut block by block), decay parameters by value head and out_proj's input by value
    head; the experts by intermediate size (every rank holds every expert, 1/N of each; a shared expert
    stacked as expert E, layers/moe.py, cut like a routed one from its own checkpoint tensors; so is one
    beside them in a stack of its own), the separate shared expert and dense MLPs column- then
    row-parallel, the router and the shared expert's gate whole; the
    LM head by vocabulary; the token embedding whole."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    intermediate = config.moe_intermediate_size
    shared = config.shared_expert_intermediate_size
    kv = ReplicatedHeads(0, config.num_kv_heads)
    return [
        (rf"{LAYER}\.self_attn\.q_proj\.(weight|bias)", Split(0)),
        (rf"{LAYER}\.self_attn\.[kv]_proj\.(weight|bias)", kv),
        (rf"{LAYER}\.self_attn\.o_proj\.weight", Split(1)),
        (rf"{LAYER}\.self_attn\.o_proj\.bias", FirstRank()),
        (rf"{LAYER}\.self_attn\.[qk]_norm\.weight", REPLICATED),
        (rf"{LAYER}\.linear_attn\.conv1d\.weight", Split(0, (key_dim, key_dim, value_dim))),
        (rf"{LAYER}\.linear_attn\.(A_log|dt_bias)", Split(0)),
        (rf"{LAYER}\.linear_attn\.out_proj\.weight", Split(1)),
        (rf"{LAYER}\.linear_attn\.norm\.weight", REPLICATED),
        (rf"{LAYER}\.mlp\.experts\.gate_up_proj", Split(1, (intermediate, intermediate))),
        (rf"{LAYER}\.mlp\.experts\.down_proj", Split(2)),
        (rf"{LAYER}\.mlp\.shared_experts\.gate_up_proj", Split(1, (shared, shared))),
        (rf"{LAYER}\.mlp\.shared_experts\.down_proj", Split(2)),
        (rf"{LAYER}\.mlp\.(shared_expert\.|experts\.N\.)?(gate|up)_proj\.weight", Split(0)),
        (rf"{LAYER}\.mlp\.(shared_expert\.|experts\.N\.)?down_proj\.weight", Split(1)),
        (rf"{LAYER}\.mlp\.(gate|shared_expert_gate)\.weight", REPLICATED),
        (r"lm_head\.weight", Split(0)),
        (r"model\.embed_tokens\.weight", REPLICATED),
    ]
