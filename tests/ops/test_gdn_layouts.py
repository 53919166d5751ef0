"""The Gated DeltaNet kernels reading the projections where in_proj puts them (no copies): grouped conv
inputs, group-first a/b, and the layer's views of them, against the same kernels on the copied
head-major inputs (bit for bit) and against the references. In Triton's interpreter on the CPU (fp32,
tiny shapes); the GPU tests at the 80B shapes also count the kernels of a decode step."""

from __future__ import annotations

import pytest
import torch

from morion.layers.gated_delta_net import GatedDeltaNet, Projections
from morion.ops.causal_conv1d import GroupedChannels
from morion.ops.causal_conv1d_triton import causal_conv1d_steps_, causal_conv1d_varlen_
from morion.ops.gated_delta_rule_triton import fused_gdn_chunks_, fused_gdn_steps_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH = 4


def _grouped_projection(tokens: int, groups: int, key_width: int, value_width: int, seed: int):
    """A group-first projection [T, G, q | k | v | z] (z as wide as v) and its q|k|v grouped view."""
    gen = torch.Generator().manual_seed(seed)
    columns = 2 * key_width + 2 * value_width
    projection = torch.randn(tokens, groups * columns, generator=gen).to(DEVICE).view(tokens, groups, columns)
    return projection, GroupedChannels(projection, key_width, value_width)


def test_grouped_channels_flat_is_the_head_major_concatenation():
    projection, grouped = _grouped_projection(3, 2, 2, 4, seed=0)
    q, k, v = projection[..., :2], projection[..., 2:4], projection[..., 4:8]
    expected = torch.cat([part.reshape(3, -1) for part in (q, k, v)], dim=-1)
    assert grouped.channels == 16 and torch.equal(grouped.flat(), expected)
    plain = torch.randn(3, 16)
    assert torch.equal(GroupedChannels.of(plain).flat(), plain)
    assert GroupedChannels.of(grouped) is grouped


@pytest.mark.parametrize("steps", [1, 3])
def test_conv_steps_read_grouped_inputs_in_place(steps):
    groups, key_width, value_width = 2, 4, 8
    channels = groups * (2 * key_width + value_width)
    slots = torch.tensor([[2, 5, 0][:steps], [-1, -1, -1][:steps], [4, 1, 6][:steps]], dtype=torch.int32)
    slots = slots.to(DEVICE)
    _, grouped = _grouped_projection(3 * steps, groups, key_width, value_width, seed=1)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(channels, WIDTH, generator=gen).to(DEVICE) * 0.5
    pool = torch.randn(8, WIDTH - 1, channels, generator=gen).to(DEVICE)
    flat_pool = pool.clone()
    got = causal_conv1d_steps_(grouped, pool, weight, slots, "silu", block_c=8)
    expected = causal_conv1d_steps_(grouped.flat(), flat_pool, weight, slots, "silu", block_c=8)
    assert torch.equal(got, expected) and torch.equal(pool, flat_pool)


def test_conv_varlen_reads_grouped_inputs_in_place():
    groups, key_width, value_width = 2, 4, 8
    channels = groups * (2 * key_width + value_width)
    lengths = [5, 0, 2, 1]
    cu_seqlens = torch.tensor([0, 5, 5, 7, 8], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor([3, 0, 1, 6], dtype=torch.int32, device=DEVICE)
    _, grouped = _grouped_projection(sum(lengths), groups, key_width, value_width, seed=3)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(channels, WIDTH, generator=gen).to(DEVICE) * 0.5
    pool = torch.randn(8, WIDTH - 1, channels, generator=gen).to(DEVICE)
    flat_pool = pool.clone()
    got = causal_conv1d_varlen_(grouped, pool, weight, indices, cu_seqlens, "silu", block_t=4, block_c=8)
    expected = causal_conv1d_varlen_(
        grouped.flat(), flat_pool, weight, indices, cu_seqlens, "silu", block_t=4, block_c=8
    )
    assert torch.equal(got, expected) and torch.equal(pool, flat_pool)


def test_conv_rejects_a_grouping_that_does_not_give_its_channels():
    _, grouped = _grouped_projection(2, 2, 4, 8, seed=5)
    weight = torch.zeros(grouped.channels + 1, WIDTH, device=DEVICE)
    pool = torch.zeros(2, WIDTH - 1, grouped.channels + 1, device=DEVICE)
    slots = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="does not give the conv's"):
        causal_conv1d_steps_(grouped, pool, weight, slots)


def _step_inputs(rows: int, heads: int, per_group: int, dim: int, seed: int):
    """q, k, v [rows, ., dim]; a and b as group-first views of one [rows, H, 2r] projection."""
    gen = torch.Generator().manual_seed(seed)
    v_heads = heads * per_group
    q, k = (torch.randn(rows, heads, dim, generator=gen).to(DEVICE) for _ in range(2))
    v = torch.randn(rows, v_heads, dim, generator=gen).to(DEVICE)
    ba = (torch.randn(rows, heads, 2 * per_group, generator=gen) * 2).to(DEVICE)
    a_log = (torch.rand(v_heads, generator=gen) * 4 - 3).to(DEVICE)
    dt_bias = (torch.randn(v_heads, generator=gen) * 0.5).to(DEVICE)
    return q, k, v, ba[..., per_group:], ba[..., :per_group], a_log, dt_bias


def test_gdn_steps_read_group_first_gates_in_place():
    heads, per_group, dim = 2, 2, 16
    slots = torch.tensor([[1, 4], [3, 0]], dtype=torch.int32, device=DEVICE)
    q, k, v, a, b, a_log, dt_bias = _step_inputs(4, heads, per_group, dim, seed=6)
    pool = torch.randn(6, heads * per_group, dim, dim, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    copied_pool = pool.clone()
    got = fused_gdn_steps_(q, k, v, a, b, a_log, dt_bias, pool, slots, 0.25)
    head_major = a.reshape(4, -1), b.reshape(4, -1)
    expected = fused_gdn_steps_(q, k, v, *head_major, a_log, dt_bias, copied_pool, slots, 0.25)
    assert torch.equal(got, expected) and torch.equal(pool, copied_pool)


def test_gdn_chunks_read_group_first_gates_in_place():
    heads, per_group, dim = 2, 2, 16
    q, k, v, a, b, a_log, dt_bias = _step_inputs(5, heads, per_group, dim, seed=8)
    indices = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE)
    pool = torch.randn(3, heads * per_group, dim, dim, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    copied_pool = pool.clone()
    got = fused_gdn_chunks_(q, k, v, a, b, a_log, dt_bias, pool, indices, cu_seqlens, 0.25)
    head_major = a.reshape(5, -1), b.reshape(5, -1)
    expected = fused_gdn_chunks_(q, k, v, *head_major, a_log, dt_bias, copied_pool, indices, cu_seqlens, 0.25)
    assert torch.equal(got, expected) and torch.equal(pool, copied_pool)


def test_gdn_steps_reject_gates_of_another_shape():
    q, k, v, a, b, a_log, dt_bias = _step_inputs(2, 2, 2, 16, seed=10)
    pool = torch.zeros(2, 4, 16, 16, device=DEVICE)
    slots = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="must be"):
        fused_gdn_steps_(q, k, v, a[:, :1], b[:, :1], a_log, dt_bias, pool, slots, 0.25)


def _layer(hidden: int, heads: int, v_heads: int, dim: int, dtype=torch.float32) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(0, hidden, heads, v_heads, dim, dim, WIDTH, 1e-6)
    with torch.no_grad():
        layer.A_log.uniform_(-3.0, 0.5)
        layer.dt_bias.normal_(0.0, 0.5)
        layer.conv1d.weight.normal_(0.0, 0.4)
        layer.norm.weight.normal_(1.0, 0.2)
    return layer.to(DEVICE, dtype)


def test_project_views_index_the_checkpoints_heads():
    """The views `project` returns are the group-first projections' parts: value head h * r + j of z, b
    and a; mixed_qkv = q | k | v of every head, as the conv and the references number channels."""
    layer = _layer(32, 2, 4, 8)
    x = torch.randn(3, 32, device=DEVICE)
    projections = layer.project(x)
    assert isinstance(projections, Projections)
    qkvz = layer.in_proj_qkvz(x).view(3, 2, 8 + 8 + 16 + 16)
    ba = layer.in_proj_ba(x).view(3, 2, 4)
    mixed, z, b, a = projections.head_major()
    q, k, v = qkvz[..., :8], qkvz[..., 8:16], qkvz[..., 16:32]
    assert torch.equal(mixed, torch.cat([q.reshape(3, -1), k.reshape(3, -1), v.reshape(3, -1)], dim=-1))
    assert torch.equal(z, qkvz[..., 32:].reshape(3, 4, 8))
    assert torch.equal(b, ba[..., :2].reshape(3, 4)) and torch.equal(a, ba[..., 2:].reshape(3, 4))
    # Views, not copies: they share in_proj's storage.
    assert projections.z.data_ptr() == projections.qkv.x.data_ptr() + 32 * projections.z.element_size()


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU, the engine's speculative tests run both paths")
def test_verify_kernels_match_the_verify_reference():
    """`_verify_kernels` (one conv and one step launch over n tokens, reading the projections in place)
    against `_verify_reference` (token by token, copied inputs) on the same pools: outputs and every
    token's slot."""
    layer = _layer(32, 2, 4, 16)
    gen = torch.Generator().manual_seed(11)
    slots = torch.tensor([[4, 1, 6], [0, 3, 2]], dtype=torch.int32)
    pools = {
        "conv": torch.randn(8, WIDTH - 1, layer.conv_dim, generator=gen),
        "recurrent": torch.randn(8, 4, 16, 16, generator=gen) * 0.5,
    }
    kernel_pools = {name: pool.clone() for name, pool in pools.items()}
    weight = layer.conv1d.weight[:, 0, :]
    with torch.no_grad():
        projections = layer.project(torch.randn(6, 32, generator=gen))
        expected = layer._verify_reference(projections, pools["conv"], pools["recurrent"], weight, slots)
        got = layer._verify_kernels(
            projections, kernel_pools["conv"], kernel_pools["recurrent"], weight, slots
        )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for name, pool in kernel_pools.items():
        torch.testing.assert_close(pool, pools[name], atol=1e-5, rtol=0)


# -- on the GPU, at Qwen3-Next-80B's shapes ----------------------------------------------------------

H, HV, DIM, HIDDEN = 16, 32, 128, 2048  # models/presets.py: 16 key heads, 32 value heads of 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_80b_grouped_reads_equal_the_copied_inputs_on_cuda(tokens):
    per_group = HV // H
    projection, grouped = _grouped_projection(tokens, H, DIM, per_group * DIM, seed=12)
    grouped = GroupedChannels(projection.bfloat16(), DIM, per_group * DIM)
    gen = torch.Generator().manual_seed(13)
    weight = (torch.randn(grouped.channels, WIDTH, generator=gen) * 0.5).cuda().bfloat16()
    pool = torch.randn(2 * tokens, WIDTH - 1, grouped.channels, generator=gen).cuda().bfloat16()
    flat_pool = pool.clone()
    slots = torch.arange(tokens, dtype=torch.int32, device="cuda")[:, None] * 2
    got = causal_conv1d_steps_(grouped, pool, weight, slots)
    assert torch.equal(got, causal_conv1d_steps_(grouped.flat(), flat_pool, weight, slots))
    assert torch.equal(pool, flat_pool)

    q, k, v, a, b, a_log, dt_bias = _step_inputs(tokens, H, per_group, DIM, seed=14)
    q, k, v, a, b = (t.bfloat16() for t in (q, k, v, a, b))
    states = torch.randn(2 * tokens, HV, DIM, DIM, generator=gen).cuda() * 0.3
    copied = states.clone()
    out = fused_gdn_steps_(q, k, v, a, b, a_log, dt_bias, states, slots, DIM**-0.5)
    expected = fused_gdn_steps_(
        q, k, v, a.reshape(tokens, -1), b.reshape(tokens, -1), a_log, dt_bias, copied, slots, DIM**-0.5
    )
    assert torch.equal(out, expected) and torch.equal(states, copied)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_80b_decode_step_launches_one_kernel_per_op(pool_backend):
    """A bf16 decode step of the layer: in_proj_qkvz, in_proj_ba, the conv, the gated-delta-rule step,
    the gated norm, out_proj; no copies between them (13 kernels before the projections were read in
    place; 2 more per linear with FP8 weights: the activation quantization and the row scales)."""
    layer = _layer(HIDDEN, H, HV, DIM, torch.bfloat16)
    slots = [3, 1, 0, 2]
    pools = {
        "conv": torch.zeros(4, WIDTH - 1, layer.conv_dim, dtype=torch.bfloat16, device="cuda"),
        "recurrent": torch.zeros(4, HV, DIM, DIM, device="cuda"),
    }
    backend = pool_backend(pools, slots, [1, 1, 1, 1])
    x = torch.randn(4, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x, backend)  # compiles the kernels outside the profile
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            layer(x, backend)
            torch.cuda.synchronize()
    kernels = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{len(kernels)} kernels: {kernels}")
    # Six ops; cuBLAS may split a GEMM into two kernels (split-K and its reduction).
    assert len(kernels) <= 8, kernels
    assert not any("copy" in name or "CatArrayBatched" in name for name in kernels), kernels
