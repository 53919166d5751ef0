"""Qwen3-Next split over N tensor-parallel ranks (issue #28): each rank's configuration and which part of
every checkpoint tensor it holds (parallel/shards.py).

The split, as SGLang and vLLM make it for this model (what it shares with Qwen3.8-Flash-Next's split, and
how the partial sums are added, is in models/hybrid_parallel.py):
- gated attention by query heads: q_proj (each head's query and gate dims together) and o_proj's input;
  K/V heads split too, or shared by consecutive ranks where there are fewer K/V heads than ranks;
- Gated DeltaNet by key-head group: in_proj_qkvz and in_proj_ba are stored group-first (each group's q, k,
  v, z, or b, a, together), so a group is a contiguous block; conv1d's channels are q | k | v (each
  head-major), cut block by block; A_log and dt_bias by value head; out_proj's input by value head. The
  conv and recurrent states are then per rank (their sizes follow the local heads);
- the MoE's experts by intermediate size (every rank holds every expert, 1/N of each), the shared expert
  and dense MLPs column- then row-parallel; the router and the shared expert's gate whole;
- the LM head by vocabulary (logits gathered before sampling); embeddings and norms whole.
"""

from __future__ import annotations

import dataclasses

from morion.models import hybrid_parallel
from morion.models.hybrid_parallel import LAYER, shard_by_rules, shared_rules, split_lm_head, wire
from morion.models.qwen3_next import Qwen3NextConfig
from morion.parallel.shards import REPLICATED, Shard, Split, split_evenly

__all__ = ["local_config", "shard_of", "split_lm_head", "wire"]


def local_config(config: Qwen3NextConfig, size: int) -> Qwen3NextConfig:
    """The configuration one of `size` ranks builds its modules from (hybrid_parallel.local_config, and
    the dense MLP layers' intermediate size). A MorionError names what `size` does not divide."""
    local = hybrid_parallel.local_config(config, size)
    if size == 1:
        return local
    mlp = split_evenly(config.intermediate_size, size, "MLP intermediate size")
    return dataclasses.replace(local, intermediate_size=mlp)


def shard_of(name: str, config: Qwen3NextConfig) -> Shard:
    """Which part of the whole tensor `name` (a parameter of the TP=1 model) a rank holds. Raises
    KeyError for a name no rule covers: a new parameter must be placed on purpose, never by default."""
    return shard_by_rules(name, _rules(config))


def _rules(config: Qwen3NextConfig) -> list[tuple[str, Shard]]:
    return [
        *shared_rules(config),
        (rf"{LAYER}\.linear_attn\.in_proj_(qkvz|ba)\.weight", Split(0)),
        (rf"{LAYER}\.(input_layernorm|post_attention_layernorm)\.weight", REPLICATED),
        (r"model\.norm\.weight", REPLICATED),
        (r"mtp\.(fc|norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight", REPLICATED),
    ]
