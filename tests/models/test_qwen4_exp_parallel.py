"""Qwen3.8-Flash-Next's tensor-parallel split (models/qwen4_exp_parallel.py), checked in one process
against the whole tiny model: every parameter (the MTP head's too) and every checkpoint name has a rule and
a rank's part has the rank's shape; Gated DeltaNet's head-first projections give exactly the rank's heads
and out_proj's partial outputs add up; what is per token (the indexer, hyper-connections, PLE) is whole."""

from __future__ import annotations

import pytest
import torch

from morion.models.qwen4_exp import Qwen4ExpForCausalLM
from morion.models.qwen4_exp_parallel import local_config, shard_of
from morion.parallel.shards import REPLICATED
from tests.models.split_checks import check_gated_delta_net_split, fill_rank

SIZE = 2


@pytest.fixture(scope="module")
def whole_and_ranks(qwen4_exp_tiny) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    whole = qwen4_exp_tiny.model
    ranks = []
    for rank in range(SIZE):
        model = Qwen4ExpForCausalLM(local_config(whole.config, SIZE)).eval()
        ranks.append(fill_rank(model, whole, shard_of, rank, SIZE))
    return whole, ranks


def test_every_parameter_and_checkpoint_name_has_a_rule(whole_and_ranks):
    whole, ranks = whole_and_ranks
    local = dict(ranks[0].named_parameters())
    assert local.keys() == dict(whole.named_parameters()).keys()
    assert any(name.startswith("mtp.layers.") for name in local)
    split = {n for n, p in whole.named_parameters() if p.shape != local[n].shape}
    assert any("in_proj_qkv" in n for n in split) and any("mtp.layers.0.self_attn.q_proj" in n for n in split)
    assert not any(part in n for n in split for part in ("indexer", "hyper_connection", "ple."))
    config = whole.config
    # As the checkpoints spell them: the multimodal text prefix, the n-gram table, the vision tower.
    assert shard_of("model.language_model.layers.3.self_attn.o_proj.weight", config) == shard_of(
        "model.layers.3.self_attn.o_proj.weight", config
    )
    assert shard_of("model.layers.1.ple.ple_embedding.ngram_embedding.shard_2.weight", config) is REPLICATED
    assert shard_of("model.visual.blocks.0.attn.qkv.weight", config) is REPLICATED
    with pytest.raises(KeyError, match=r"no tensor-parallel rule for model\.layers\.0\.new_thing\.weight"):
        shard_of("model.layers.0.new_thing.weight", config)


def test_gated_delta_net_projections_are_the_ranks_heads(whole_and_ranks):
    check_gated_delta_net_split(*whole_and_ranks)


def test_per_token_modules_are_whole_on_every_rank(whole_and_ranks):
    whole, ranks = whole_and_ranks
    attention = whole.config.attention_layers[0]
    for model in ranks:
        for module in ("self_attn.indexer", "attn_hyper_connection"):
            got = model.model.layers[attention].get_submodule(module).state_dict()
            want = whole.model.layers[attention].get_submodule(module).state_dict()
            assert all(torch.equal(got[name], want[name]) for name in want)
