"""Qwen3-Next's tensor-parallel split (models/qwen3_next_parallel.py, parallel/shards.py), checked in one
process against the whole model: every parameter of a rank's model is cut from the whole one with the
rank's shape; each rank's projections give exactly its heads' part of the whole projections; and the
partial outputs of the row-parallel projections and of the MoE block add up to the whole model's."""

from __future__ import annotations

import copy

import pytest
import torch

from morion.errors import MorionError
from morion.layers.moe import StackedExperts
from morion.models.hybrid_parallel import wire
from morion.models.qwen3_next import Qwen3NextForCausalLM
from morion.models.qwen3_next_parallel import local_config, shard_of
from morion.ops.slot_partials import SlotPartials
from morion.parallel.group import TensorParallel
from morion.parallel.shards import ReplicatedHeads, Split, cut
from tests.models.split_checks import TOLERANCE, check_gated_delta_net_split, fill_rank, same

SIZE = 2


@pytest.fixture(scope="module", params=["tiny", "odd"])  # odd: one K/V head, 3 value heads a group, bias
def whole_and_ranks(request, qwen3_next_checkpoint, build_qwen3_next):
    directory, _ = qwen3_next_checkpoint(request.param)
    whole = build_qwen3_next(directory)
    ranks = []
    for rank in range(SIZE):
        model = Qwen3NextForCausalLM(local_config(whole.config, SIZE)).eval()
        if whole.mtp is None:
            model.mtp = None  # transformers' checkpoints carry no MTP head
        ranks.append(fill_rank(model, whole, shard_of, rank, SIZE))
    return whole, ranks


def test_every_parameter_has_a_rule_and_ranks_hold_a_part(whole_and_ranks):
    whole, ranks = whole_and_ranks
    local = dict(ranks[0].named_parameters())
    assert local.keys() == dict(whole.named_parameters()).keys()
    split = [n for n, p in whole.named_parameters() if p.shape != local[n].shape]
    assert any("in_proj_qkvz" in n for n in split) and any("experts.down_proj" in n for n in split)
    with pytest.raises(KeyError, match=r"no tensor-parallel rule for model\.layers\.0\.new_thing\.weight"):
        shard_of("model.layers.0.new_thing.weight", whole.config)


def test_gated_delta_net_projections_are_the_ranks_heads(whole_and_ranks):
    check_gated_delta_net_split(*whole_and_ranks)


def test_attention_projections_and_row_parallel_output(whole_and_ranks):
    whole, ranks = whole_and_ranks
    index = whole.config.attention_layers[0]
    full = whole.model.layers[index].self_attn
    x = torch.randn(5, whole.config.hidden_size)
    query_gate = full.q_proj(x)
    keys, values = full.k_proj(x), full.v_proj(x)
    width = query_gate.shape[1] // SIZE
    attended = torch.randn(5, full.o_proj.in_features)
    partial = []
    for rank, model in enumerate(ranks):
        part = model.model.layers[index].self_attn
        assert same(part.q_proj(x), query_gate[:, rank * width : (rank + 1) * width])
        kv_heads = whole.config.num_kv_heads
        first = rank * kv_heads // SIZE  # shared by consecutive ranks where there are fewer heads
        count = max(1, kv_heads // SIZE)
        kv = slice(first * full.head_dim, (first + count) * full.head_dim)
        assert same(part.k_proj(x), keys[:, kv]) and same(part.v_proj(x), values[:, kv])
        rows = part.o_proj.in_features
        partial.append(part.o_proj(attended[:, rank * rows : (rank + 1) * rows]))
    assert (sum(partial) - full.o_proj(attended)).abs().max() < TOLERANCE


def test_moe_block_outputs_add_up_to_the_whole(whole_and_ranks):
    whole, ranks = whole_and_ranks
    x = torch.randn(7, whole.config.hidden_size)
    for index in (0, len(whole.model.layers) - 1):
        with torch.no_grad():
            expected = whole.model.layers[index].mlp(x)
            partial = sum(model.model.layers[index].mlp(x) for model in ranks)
        assert (partial - expected).abs().max() < TOLERANCE
        assert expected.abs().max() > 10 * TOLERANCE  # not a trivial zero


def test_a_stacked_shared_expert_splits_like_a_routed_one(whole_and_ranks):
    """tiny stacks its shared expert (as wide as a routed one), odd keeps it apart (48 against 64)."""
    whole, ranks = whole_and_ranks
    block = whole.model.layers[0].mlp
    config = whole.config
    assert (block.shared_slot is None) == (
        config.shared_expert_intermediate_size != config.moe_intermediate_size
    )
    if block.shared_slot is None:
        return
    slot, width = block.shared_slot, whole.config.moe_intermediate_size // SIZE
    gate, up = block.experts.gate_up_proj[slot].chunk(2)
    for rank, model in enumerate(ranks):
        local = model.model.layers[0].mlp
        assert local.shared_slot == slot and local.gate.weight.shape == block.gate.weight.shape
        rows = slice(rank * width, (rank + 1) * width)
        assert torch.equal(local.experts.gate_up_proj[slot], torch.cat((gate[rows], up[rows])))
        assert torch.equal(local.experts.down_proj[slot], block.experts.down_proj[slot][:, rows])


def test_lm_head_rows_are_split_by_vocabulary(whole_and_ranks):
    whole, _ = whole_and_ranks
    weight = whole.lm_head.weight
    parts = [cut(weight, shard_of("lm_head.weight", whole.config), rank, SIZE) for rank in range(SIZE)]
    assert torch.equal(torch.cat(parts), weight)


def test_shared_kv_heads_and_segments():
    whole = torch.arange(4 * 3).reshape(4, 3)  # 2 heads of 2 rows
    shared = [cut(whole, ReplicatedHeads(0, 2), rank, 4) for rank in range(4)]
    assert [part[0, 0].item() for part in shared] == [0, 0, 6, 6]
    blocks = torch.arange(12)
    assert cut(blocks, Split(0, (4, 8)), 1, 2).tolist() == [2, 3, 8, 9, 10, 11]
    with pytest.raises(MorionError, match="3 ranks cannot share 2 K/V heads"):
        cut(whole, ReplicatedHeads(0, 2), 0, 3)


def test_sizes_that_do_not_divide_are_one_clear_error(whole_and_ranks):
    whole, _ = whole_and_ranks
    with pytest.raises(MorionError, match="--tensor-parallel-size 3 does not divide the 4 attention heads"):
        local_config(whole.config, 3)
    assert local_config(whole.config, 1) is whole.config


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fused kernels on CPU tensors: the interpreter")
def test_wired_moe_blocks_hand_on_their_slots_summed(whole_and_ranks, monkeypatch):
    """Under tensor parallelism a MoE block's output is a partial sum that a forward hook adds across
    ranks (`hybrid_parallel.wire`): the fused decode kernels' unsummed slots (`SlotPartials`) are summed
    on the rank first, so the hook hands on the block's [T, H] partial, as it would without them."""
    whole, _ = whole_and_ranks
    model = copy.deepcopy(whole)
    monkeypatch.setattr(StackedExperts, "_path", lambda self, x, num_pairs: "triton")  # the interpreter
    block = model.model.layers[0].mlp
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        expected = block(x)
        # A stacked block hands its slots on; a separate shared expert is added to their sum in torch.
        assert isinstance(block(x, unsummed=True), SlotPartials) == (block.shared_slot is not None)
        wire(model, TensorParallel())  # one rank: the collective adds nothing
        got = block(x, unsummed=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
