"""Qwen3.8-Flash-Next's tensor-parallel split (models/qwen4_exp_parallel.py), checked in one process
against the whole tiny model: every parameter (the MTP head's too) and every checkpoint name has a rule and
a rank's part has the rank's shape; Gated DeltaNet's head-first projections give exactly the rank's heads
and out_proj's partial outputs add up; what is per token (the indexer, hyper-connections, PLE) is whole."""

from __future__ import annotations

import pytest
import torch

from morion.models.qwen4_exp import Qwen4ExpForCausalLM
from morion.models.qwen4_exp_parallel import local_config, shard_of
from morion.parallel.shards import REPLICATED, cut

SIZE = 2


@pytest.fixture(scope="module")
def whole_and_ranks(qwen4_exp_tiny) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    whole = qwen4_exp_tiny.model
    whole_parameters = dict(whole.named_parameters())
    ranks = []
    for rank in range(SIZE):
        model = Qwen4ExpForCausalLM(local_config(whole.config, SIZE)).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name == "lm_head.weight":
                    continue  # split by vocabulary where the head is built (hybrid_parallel.split_lm_head)
                part = cut(whole_parameters[name], shard_of(name, whole.config), rank, SIZE)
                assert part.shape == parameter.shape, name
                parameter.copy_(part)
        ranks.append(model)
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
    whole, ranks = whole_and_ranks
    index = whole.config.linear_layers[0]
    full = whole.model.layers[index].linear_attn
    x = torch.randn(5, whole.config.hidden_size)
    qkv, z, b, a = full.project(x).head_major()
    q, k, v = qkv.split([full.key_dim, full.key_dim, full.value_dim], dim=-1)
    value_heads = full.num_v_heads // SIZE
    outputs = []
    for rank, model in enumerate(ranks):
        part = model.model.layers[index].linear_attn
        heads = slice(rank * value_heads, (rank + 1) * value_heads)
        local_qkv, local_z, local_b, local_a = part.project(x).head_major()
        local_q, local_k, local_v = local_qkv.split([part.key_dim, part.key_dim, part.value_dim], dim=-1)
        keys = slice(rank * part.key_dim, (rank + 1) * part.key_dim)
        values = slice(rank * part.value_dim, (rank + 1) * part.value_dim)
        for got, want in ((local_q, q[:, keys]), (local_k, k[:, keys]), (local_v, v[:, values])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for got, want in ((local_z, z[:, heads]), (local_b, b[:, heads]), (local_a, a[:, heads])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert torch.equal(part.A_log, full.A_log[heads])
        outputs.append(part.out_proj(v[:, values]))
    torch.testing.assert_close(sum(outputs), full.out_proj(v), rtol=0, atol=1e-5)


def test_per_token_modules_are_whole_on_every_rank(whole_and_ranks):
    whole, ranks = whole_and_ranks
    attention = whole.config.attention_layers[0]
    for model in ranks:
        for module in ("self_attn.indexer", "attn_hyper_connection"):
            got = model.model.layers[attention].get_submodule(module).state_dict()
            want = whole.model.layers[attention].get_submodule(module).state_dict()
            assert all(torch.equal(got[name], want[name]) for name in want)
