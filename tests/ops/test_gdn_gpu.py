"""The Gated DeltaNet CUDA fast path at Qwen3-Next's shape: H=16 key heads, HV=32 value heads,
K=V=128, conv_dim 8192, W=4, bf16 activations, fp32 or bf16 recurrent states.

    pytest -q -s tests/ops/test_gdn_gpu.py      # -s prints each measured error

About a minute on an H200, most of it fla's first-call autotune of its chunk kernels (all fla calls here
use the same shapes and dtypes, so it tunes once). What each test pins down:

- decode: our fused Triton step vs the fp32 recurrent reference, fp32 and bf16 state pools;
- conv: our update and varlen kernels vs the references (bf16 in and out);
- prefill: fla's varlen chunk kernel through `gdn_prefill_`, 3 sequences: a new one (zero state), an
  empty one (its slot must stay bit for bit) and one continuing from a non-zero state;
- CUDA graphs: a captured decode step (conv + GDN, then the whole layer) replayed with other slots
  equals eager execution, i.e. the path has no host sync and reads slots from device memory only;
- the whole GatedDeltaNet layer on CUDA (bf16) vs the same weights on the CPU reference path (fp32):
  prefill, decode steps, a continuing prefill, and graph-replayed decode steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from morion.layers.gated_delta_net import GatedDeltaNet
from morion.ops.causal_conv1d import causal_conv1d_reference, causal_conv1d_update_reference
from morion.ops.causal_conv1d_triton import causal_conv1d_update_, causal_conv1d_varlen_
from morion.ops.fla_varlen import FLA_CHUNK_SIZE, fla_varlen
from morion.ops.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)
from morion.ops.gated_delta_rule_triton import fused_gdn_decode_, gdn_prefill_

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

H, HV, K, V, W, HIDDEN = 16, 32, 128, 128, 4, 2048
CONV_DIM = 2 * H * K + HV * V
SCALE = K**-0.5
BF16 = torch.bfloat16
# Prefill batches: a new sequence (zero state), an empty one, one continuing from a non-zero state.
LENGTHS, SLOTS, NUM_SLOTS = [130, 0, 67], [5, 1, 3], 6


def device_randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float().to(actual.device)
    return ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float().to(actual.device)).abs().max().item()


def report(name: str, **errors: float) -> None:
    print(f"\n{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def gdn_inputs(tokens: int, seed: int):
    """bf16 q, k [T, H, K], v [T, HV, V] (views of one packed row, as the layer passes them), raw a, b
    [T, HV]; fp32 A_log, dt_bias [HV] spanning slow to fast decays."""
    packed = device_randn(tokens, CONV_DIM, seed=seed, dtype=BF16)
    q = packed[:, : H * K].view(tokens, H, K)
    k = packed[:, H * K : 2 * H * K].view(tokens, H, K)
    v = packed[:, 2 * H * K :].view(tokens, HV, V)
    a = device_randn(tokens, HV, seed=seed + 1, dtype=BF16)
    b = device_randn(tokens, HV, seed=seed + 2, scale=2.0, dtype=BF16)
    a_log = torch.linspace(-5.8, 0.0, HV, device=DEVICE)
    dt_bias = device_randn(HV, seed=seed + 3, scale=0.5)
    return q, k, v, a, b, a_log, dt_bias


def log_decay(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32, as the layer computes it."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def others_untouched(after: torch.Tensor, before: torch.Tensor, slots: list[int]) -> bool:
    rest = [s for s in range(before.shape[0]) if s not in slots]
    return torch.equal(after[rest], before[rest])


# -- ops ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_decode_at_qwen3_next_shape(state_dtype):
    slots = [13, 2, 7, 0, 15, 4, 9, 11]
    q, k, v, a, b, a_log, dt_bias = gdn_inputs(len(slots), seed=0)
    pool = device_randn(16, HV, K, V, seed=10, scale=0.3, dtype=state_dtype)
    before = pool.clone()
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    out = fused_gdn_decode_(q, k, v, a, b, a_log, dt_bias, pool, indices, SCALE)
    # The kernel takes sigmoid(b) in fp32.
    g, beta = log_decay(a, a_log, dt_bias), b.float().sigmoid()
    ref_out, ref_state = recurrent_gated_delta_rule_reference(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=SCALE,
        initial_state=before[slots].float(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ref_out = ref_out[:, 0]
    errors = dict(out_rel=rel_l2(out, ref_out), state_rel=rel_l2(pool[slots], ref_state))
    report(f"decode state {state_dtype}", **errors, state_max=max_abs(pool[slots], ref_state))
    assert out.dtype == BF16
    assert errors["out_rel"] < 1e-2  # bf16 rounding of the output only
    assert errors["state_rel"] < (1e-5 if state_dtype == torch.float32 else 1e-2)
    assert others_untouched(pool, before, slots)


def test_conv_at_qwen3_next_shape():
    """Update (8 sequences) and varlen (LENGTHS) on bf16 activations and windows; the references
    convolve in fp32 (weight.float()), as the kernels do, so only the output's rounding differs."""
    weight = device_randn(CONV_DIM, W, seed=20, scale=0.4, dtype=BF16)
    pool = device_randn(8, W - 1, CONV_DIM, seed=21, dtype=BF16)
    pool[SLOTS[0]].zero_()
    before = pool.clone()

    slots = [6, 0, 3, 7]
    x = device_randn(len(slots), CONV_DIM, seed=22, dtype=BF16)
    states = before[slots].transpose(1, 2).clone()
    out = causal_conv1d_update_(x, pool, weight, torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    ref = causal_conv1d_update_reference(x, states, weight.float(), activation="silu")
    update_err = max_abs(out, ref)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=1e-2), update_err
    assert torch.equal(pool[slots], states.transpose(1, 2))
    assert others_untouched(pool, before, slots)

    pool.copy_(before)
    x = device_randn(sum(LENGTHS), CONV_DIM, seed=23, dtype=BF16)
    indices = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    out = causal_conv1d_varlen_(x, pool, weight, indices, cu_seqlens_of(LENGTHS), "silu")
    varlen_err, start = 0.0, 0
    for slot, length in zip(SLOTS, LENGTHS, strict=True):
        if length == 0:
            assert torch.equal(pool[slot], before[slot])
            continue
        ref = causal_conv1d_reference(
            x[start : start + length].T[None], weight.float(), initial_states=before[slot].T[None],
            activation="silu",
        )  # fmt: skip
        varlen_err = max(varlen_err, max_abs(out[start : start + length], ref.out[0].T))
        assert torch.allclose(out[start : start + length].float(), ref.out[0].T.float(), atol=2e-2, rtol=1e-2)
        assert torch.equal(pool[slot], ref.final_states[0].T)
        start += length
    assert others_untouched(pool, before, SLOTS)
    report("conv", update_max=update_err, varlen_max=varlen_err)


def test_varlen_metadata_equals_fla_s_own_on_the_device():
    from fla.ops.utils.index import prepare_chunk_indices

    cu_seqlens = cu_seqlens_of([*LENGTHS, 64, 1]).long()
    varlen = fla_varlen(cu_seqlens.cpu(), cu_seqlens.device)
    assert varlen.chunk_indices.is_cuda and torch.equal(varlen.cu_seqlens, cu_seqlens)
    assert torch.equal(varlen.chunk_indices, prepare_chunk_indices(cu_seqlens.clone(), FLA_CHUNK_SIZE))


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_fla_prefill_at_qwen3_next_shape(state_dtype):
    q, k, v, a, b, a_log, dt_bias = gdn_inputs(sum(LENGTHS), seed=30)
    pool = device_randn(NUM_SLOTS, HV, K, V, seed=31, scale=0.3, dtype=state_dtype)
    pool[SLOTS[0]].zero_()  # a new sequence
    before = pool.clone()
    cu_seqlens = cu_seqlens_of(LENGTHS)
    indices = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    out = gdn_prefill_(q, k, v, a, b, a_log, dt_bias, pool, indices, cu_seqlens, SCALE)
    # gdn_prefill_ hands fla beta in b's dtype, as the reference layer computes it.
    g, beta = log_decay(a, a_log, dt_bias), b.sigmoid()
    ref_out, ref_state = chunk_gated_delta_rule_reference(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE, initial_state=before[SLOTS].float(),
        output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    has_tokens = [i for i, length in enumerate(LENGTHS) if length]
    errors = dict(
        out_rel=rel_l2(out, ref_out[0]),
        state_rel=rel_l2(pool[[SLOTS[i] for i in has_tokens]], ref_state[has_tokens]),
    )
    report(f"fla prefill state {state_dtype}", **errors)
    assert out.shape == (sum(LENGTHS), HV, V) and out.dtype == BF16
    assert errors["out_rel"] < 2e-2 and errors["state_rel"] < 2e-2  # fla measured ~4e-3 on bf16 inputs
    assert torch.equal(pool[SLOTS[1]], before[SLOTS[1]])  # the empty sequence
    assert others_untouched(pool, before, SLOTS)


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_prefill_equals_fla_s_public_entry_bit_for_bit(state_dtype):
    """`gdn_prefill_` calls fla's forward below its public entry (for less Python a layer): the same
    kernels with the same arguments, so the same bits as `chunk_gated_delta_rule` with the in-kernel
    q/k L2 norm, output and final states alike."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, a, b, a_log, dt_bias = gdn_inputs(sum(LENGTHS), seed=40)
    pool = device_randn(NUM_SLOTS, HV, K, V, seed=41, scale=0.3, dtype=state_dtype)
    before = pool.clone()
    cu_seqlens = cu_seqlens_of(LENGTHS)
    indices = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    out = gdn_prefill_(q, k, v, a, b, a_log, dt_bias, pool, indices, cu_seqlens, SCALE)
    varlen = fla_varlen(cu_seqlens.cpu(), cu_seqlens.device)
    g, beta = log_decay(a, a_log, dt_bias), b.sigmoid()
    public_out, public_state = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE, initial_state=before[SLOTS].float(),
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=varlen.cu_seqlens,
        cu_seqlens_cpu=varlen.cu_seqlens_cpu, chunk_indices=varlen.chunk_indices, chunk_size=FLA_CHUNK_SIZE,
    )  # fmt: skip
    assert torch.equal(out, public_out[0])
    has_tokens = [i for i, length in enumerate(LENGTHS) if length]
    expected = public_state[has_tokens].to(state_dtype)
    assert torch.equal(pool[[SLOTS[i] for i in has_tokens]], expected)


def test_decode_step_replays_in_a_cuda_graph():
    """conv update -> GDN decode captured once, replayed with other slots (and new inputs) each time:
    bit for bit what the same kernels do eagerly on a copy of the pools."""
    rows, num_slots = 4, 12
    weight = device_randn(CONV_DIM, W, seed=40, scale=0.4, dtype=BF16)
    a_log, dt_bias = torch.linspace(-5.8, 0.0, HV, device=DEVICE), device_randn(HV, seed=41, scale=0.5)
    conv_pool = device_randn(num_slots, W - 1, CONV_DIM, seed=42, dtype=BF16)
    recurrent_pool = device_randn(num_slots, HV, K, V, seed=43, scale=0.3)
    x = torch.zeros(rows, CONV_DIM, dtype=BF16, device=DEVICE)
    ab = torch.zeros(rows, 2, HV, dtype=BF16, device=DEVICE)
    indices = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)

    def step(conv_pool: torch.Tensor, recurrent_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mixed = causal_conv1d_update_(x, conv_pool, weight, indices, "silu")
        q, k, v = mixed.split([H * K, H * K, HV * V], dim=-1)
        out = fused_gdn_decode_(
            q.view(rows, H, K), k.view(rows, H, K), v.view(rows, HV, V), ab[:, 0], ab[:, 1],
            a_log, dt_bias, recurrent_pool, indices, SCALE,
        )  # fmt: skip
        return mixed, out

    # Warm up (compile) on a side stream, on throwaway pools, before capturing.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(conv_pool.clone(), recurrent_pool.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_mixed, graph_out = step(conv_pool, recurrent_pool)

    for i, slots in enumerate(([3, 7, 0, 11], [11, 2, 5, 8], [8, 3, 10, 1])):
        indices.copy_(torch.tensor(slots, dtype=torch.int32))
        x.copy_(device_randn(rows, CONV_DIM, seed=50 + i, dtype=BF16))
        ab.copy_(device_randn(rows, 2, HV, seed=60 + i, scale=2.0, dtype=BF16))
        eager_conv, eager_recurrent = conv_pool.clone(), recurrent_pool.clone()
        eager_mixed, eager_out = step(eager_conv, eager_recurrent)
        graph.replay()
        assert torch.equal(graph_mixed, eager_mixed) and torch.equal(graph_out, eager_out)
        assert torch.equal(conv_pool, eager_conv) and torch.equal(recurrent_pool, eager_recurrent)


# -- the layer -----------------------------------------------------------------------------------------


def test_layer_on_cuda_matches_cpu_reference(pool_backend):
    """The same bf16-representable weights: the layer on CUDA in bf16 (fast path, fp32 recurrent states,
    bf16 conv windows) vs on the CPU in fp32 (reference path), batch after batch on one pool."""
    torch.manual_seed(0)
    reference = GatedDeltaNet(0, HIDDEN, H, HV, K, V, W, 1e-6)
    with torch.no_grad():
        reference.A_log.uniform_(-5.8, 0.0)
        reference.dt_bias.normal_(0.0, 0.5)
        reference.conv1d.weight.normal_(0.0, 0.4)
        reference.norm.weight.normal_(1.0, 0.2)
    reference = reference.to(BF16).float()  # so the bf16 copy holds exactly the same weights
    fast = copy.deepcopy(reference).to(DEVICE, BF16)

    gen = torch.Generator().manual_seed(70)
    reference_pools = {
        "conv": torch.randn(NUM_SLOTS, W - 1, CONV_DIM, generator=gen).to(BF16).float(),
        "recurrent": torch.randn(NUM_SLOTS, HV, K, V, generator=gen) * 0.3,
    }
    reference_pools["conv"][SLOTS[0]] = 0
    reference_pools["recurrent"][SLOTS[0]] = 0
    fast_pools = {
        "conv": reference_pools["conv"].to(DEVICE, BF16, copy=True),
        "recurrent": reference_pools["recurrent"].to(DEVICE, copy=True),
    }

    def compare(name: str, ref_out: torch.Tensor, out: torch.Tensor) -> None:
        errors = {"out_rel": rel_l2(out, ref_out)}
        errors.update({f"{c}_rel": rel_l2(fast_pools[c], reference_pools[c]) for c in fast_pools})
        report(name, **errors)
        assert errors["out_rel"] < 3e-2, errors
        assert errors["recurrent_rel"] < 3e-2 and errors["conv_rel"] < 1e-2, errors

    with torch.inference_mode():
        for i, lengths in enumerate((LENGTHS, [1, 1, 1], [1, 1, 1], [64, 1, 2])):
            x = torch.randn(sum(lengths), HIDDEN, generator=gen).to(BF16).float()
            ref_out = reference(x, pool_backend(reference_pools, SLOTS, lengths))
            out = fast(x.to(DEVICE, BF16), pool_backend(fast_pools, SLOTS, lengths))
            compare(f"layer step {i} {lengths}", ref_out, out)

        # A decode step captured once and replayed with the batch order (hence the slots) permuted.
        static_x = torch.zeros(3, HIDDEN, dtype=BF16, device=DEVICE)
        backend = pool_backend(fast_pools, SLOTS, [1, 1, 1])
        saved = {c: p.clone() for c, p in fast_pools.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fast(static_x, backend)
        torch.cuda.current_stream().wait_stream(side)
        for component, pool in fast_pools.items():
            pool.copy_(saved[component])  # undo the warm-up step
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fast(static_x, backend)
        for i, slots in enumerate(([3, 5, 1], [1, 3, 5])):
            x = torch.randn(3, HIDDEN, generator=gen).to(BF16).float()
            backend.state_indices.copy_(torch.tensor(slots, dtype=torch.int32))
            static_x.copy_(x)
            graph.replay()
            ref_out = reference(x, pool_backend(reference_pools, slots, [1, 1, 1]))
            compare(f"layer graph replay {i} slots {slots}", ref_out, static_out)
