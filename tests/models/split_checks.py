"""What both hybrids' tensor-parallel split tests share: a rank's model filled with its parts of the whole
model's parameters, and the check that a rank's Gated DeltaNet holds exactly its heads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from morion.parallel.shards import Shard, cut

TOLERANCE = 1e-5  # fp32; only the order of a sum's terms differs


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal but for the last bits: a GEMM of fewer output columns may block its sums differently."""
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item()))


def fill_rank(
    model: torch.nn.Module,
    whole: torch.nn.Module,
    shard_of: Callable[[str, object], Shard],
    rank: int,
    size: int,
) -> torch.nn.Module:
    """`model` (built from the rank's local configuration) given rank `rank`'s part of every parameter of
    `whole`, as the loader cuts them; the LM head is left to where it is built (split by vocabulary)."""
    whole_parameters = dict(whole.named_parameters())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name == "lm_head.weight":
                continue
            part = cut(whole_parameters[name], shard_of(name, whole.config), rank, size)
            assert part.shape == parameter.shape, name
            parameter.copy_(part)
    return model


def check_gated_delta_net_split(whole: torch.nn.Module, ranks: list[torch.nn.Module]) -> None:
    """On the first linear-attention layer: each rank's q, k, v, z, b and a projections are its heads' of
    the whole layer's, its conv channels and decay parameters too, and the ranks' out_proj parts add up to
    the whole out_proj."""
    size = len(ranks)
    index = whole.config.linear_layers[0]
    full = whole.model.layers[index].linear_attn
    x = torch.randn(5, whole.config.hidden_size)
    qkv, z, b, a = full.project(x).head_major()
    q, k, v = qkv.split([full.key_dim, full.key_dim, full.value_dim], dim=-1)
    value_heads = full.num_v_heads // size
    outputs = []
    for rank, model in enumerate(ranks):
        part = model.model.layers[index].linear_attn
        heads = slice(rank * value_heads, (rank + 1) * value_heads)
        local_qkv, local_z, local_b, local_a = part.project(x).head_major()
        local_q, local_k, local_v = local_qkv.split([part.key_dim, part.key_dim, part.value_dim], dim=-1)
        keys = slice(rank * part.key_dim, (rank + 1) * part.key_dim)
        values = slice(rank * part.value_dim, (rank + 1) * part.value_dim)
        assert same(local_q, q[:, keys]) and same(local_k, k[:, keys])
        assert same(local_v, v[:, values])
        assert same(local_z, z[:, heads]) and same(local_b, b[:, heads])
        assert same(local_a, a[:, heads])
        # The conv's channels follow mixed_qkv's: the rank's q, k and v channels of the whole conv.
        channels = torch.cat(
            [
                torch.arange(full.key_dim)[keys],
                full.key_dim + torch.arange(full.key_dim)[keys],
                2 * full.key_dim + torch.arange(full.value_dim)[values],
            ]
        )
        assert torch.equal(part.conv1d.weight, full.conv1d.weight[channels])
        assert torch.equal(part.A_log, full.A_log[heads]) and torch.equal(part.dt_bias, full.dt_bias[heads])
        outputs.append(part.out_proj(v[:, values]))
    assert (sum(outputs) - full.out_proj(v)).abs().max() < TOLERANCE
