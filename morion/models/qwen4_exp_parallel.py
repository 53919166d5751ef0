"""Qwen3.8-Flash-Next (`qwen4_exp`, `qwen4_exp_text`) split over N tensor-parallel ranks (issue #28): each
rank's configuration and which part of every checkpoint tensor it holds (parallel/shards.py).

What it shares with Qwen3-Next's split (models/hybrid_parallel.py): QSA's gated attention projections by
query heads (K/V heads split, or shared by consecutive ranks where there are fewer), Gated DeltaNet's
conv, decay parameters and out_proj by heads, the sparse MoE and its shared expert by intermediate size,
the LM head by vocabulary, and one all-reduce per mixer and per MoE block (the trunk's layers and the MTP
head's). What is its own:

- Gated DeltaNet's Qwen3.5 projections are head-first: in_proj_qkv is q | k | v (each head-major, the
  conv's channel order), cut block by block as conv1d is; in_proj_z, in_proj_b and in_proj_a by value
  head. Value head j reads key head j // (HV / H) on each rank as at one rank (contiguous blocks of both);
  the conv and recurrent states are per rank, of its heads.
- QSA's indexer is replicated, with its side caches (raw index keys, block keys): every rank scores the
  blocks and selects the same tokens for its own query heads. Splitting its heads would need an
  all-reduce of the block scores (a sum over index heads before the top-k) inside every QSA layer, and
  its one MQA key head (what the caches hold) cannot be split at all; it is small beside the attention
  ((H_index + 1) * D_index rows of hidden_size per layer, 3 rows per token in the cache).
- The hyper-connections (per-stream norms, mix and inject weights, the final mixers) and PLE (its
  projections, norms, conv and state slots) are replicated: per-token work on the streams, which are the
  same on every rank after each all-reduce. So is the MTP head's fusion (its norms, fc_embedding,
  fc_hidden).
- PLE's n-gram table (host memory, layers/host_table.py) is replicated: every rank gathers its rows for
  its own PLE layers. Each rank is a process of its own, so under `--ple-placement ram` each holds a copy
  (N x 47.7 GiB of host RAM for the released FP8 table); under `--ple-placement mmap` the ranks map the
  same checkpoint files and the OS page cache holds one copy for all. Splitting the table by rows (a
  rank gathers the rows it holds, zeros for the others, and one all-reduce adds them) would hold one copy
  in RAM: not done yet.
- The vision tower (`visual.*`) is loaded whole on every rank; requests with images are refused at
  TP > 1 (engine/engine.py: a follower's forward has no image rows).

Checkpoint names arrive as the checkpoint spells them (the loader cuts a tensor before the model renames
it): the multimodal `model.language_model.` prefix is read as `model.`, and the PLE table, its hash
constants and the vision tower's tensors are whole on every rank.
"""

from __future__ import annotations

from morion.models.hybrid_parallel import (
    LAYER,
    local_config,
    shard_by_rules,
    shared_rules,
    split_lm_head,
    wire,
)
from morion.models.qwen4_exp_config import Qwen4ExpConfig
from morion.parallel.shards import REPLICATED, Shard, Split

__all__ = ["local_config", "shard_of", "split_lm_head", "wire"]

_TEXT_PREFIX = "model.language_model."  # multimodal (qwen4_exp) checkpoints' text model


def shard_of(name: str, config: Qwen4ExpConfig) -> Shard:
    """Which part of the whole tensor `name` (a parameter of the TP=1 model, or a checkpoint name) a rank
    holds. Raises KeyError for a name no rule covers: a new parameter must be placed on purpose."""
    if name.startswith(_TEXT_PREFIX):
        name = "model." + name.removeprefix(_TEXT_PREFIX)
    return shard_by_rules(name, _rules(config))


def _rules(config: Qwen4ExpConfig) -> list[tuple[str, Shard]]:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    hyper_connection = r"(input_mix_weight_down|input_mix_weight_up|block_inject_weight|hc_norm)"
    return [
        *shared_rules(config),
        (rf"{LAYER}\.linear_attn\.in_proj_qkv\.weight", Split(0, (key_dim, key_dim, value_dim))),
        (rf"{LAYER}\.linear_attn\.in_proj_[zba]\.weight", Split(0)),
        (rf"{LAYER}\.self_attn\.indexer\.(index_qk_proj|q_layernorm|k_layernorm)\.weight", REPLICATED),
        (rf"{LAYER}\.(attn|mlp)_hyper_connection\.{hyper_connection}\.weight", REPLICATED),
        (rf"(model|mtp)\.hyper_connection_mixer\.{hyper_connection}\.weight", REPLICATED),
        (rf"{LAYER}\.ple\.(key_proj|value_proj|norm_key|norm_query|norm_conv|conv1d)\.weight", REPLICATED),
        (rf"{LAYER}\.ple\.ple_embedding\..+", REPLICATED),  # the host table and its hash constants
        (r"mtp\.(fc_embedding|fc_hidden|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight", REPLICATED),
        (r"(model\.)?visual\..+", REPLICATED),
    ]
