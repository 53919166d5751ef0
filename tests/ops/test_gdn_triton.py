"""Our Triton Gated DeltaNet kernels (decode step, conv update, varlen conv) vs the pure-torch references.

Without a GPU they run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1): fp32 and
fp16 only, tiny shapes, grids of a few dozen programs. With a GPU the same tests run compiled, plus the
bf16-state cases. Every test checks the slot discipline too: the rows named by `state_indices` hold the
new states and every other row of the pool is bit-for-bit unchanged.
"""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from morion.layers.gated_delta_net import GatedDeltaNet
from morion.ops.causal_conv1d import causal_conv1d_reference, causal_conv1d_update_reference
from morion.ops.causal_conv1d_triton import (
    causal_conv1d_steps_,
    causal_conv1d_update_,
    causal_conv1d_varlen_,
)
from morion.ops.fla_varlen import fla_varlen
from morion.ops.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    l2_normalize,
    recurrent_gated_delta_rule_reference,
)
from morion.ops.gated_delta_rule_triton import (
    fused_gdn_chunks_,
    fused_gdn_decode_,
    fused_gdn_steps_,
    gdn_prefill_,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH = 4
STATE_DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def untouched(after: torch.Tensor, before: torch.Tensor, slots: list[int]) -> bool:
    others = [s for s in range(before.shape[0]) if s not in slots]
    return torch.equal(after[others], before[others])


# -- the decode step -------------------------------------------------------------------------------


def decode_inputs(num_seqs: int, heads: int, v_heads: int, k_dim: int, v_dim: int, dtype, seed: int = 0):
    """q, k, v as views of one packed row (the layer passes strided views, not copies); raw a, b."""
    gen = torch.Generator().manual_seed(seed)
    packed = randn(num_seqs, 2 * heads * k_dim + v_heads * v_dim, gen=gen, dtype=dtype)
    q = packed[:, : heads * k_dim].view(num_seqs, heads, k_dim)
    k = packed[:, heads * k_dim : 2 * heads * k_dim].view(num_seqs, heads, k_dim)
    v = packed[:, 2 * heads * k_dim :].view(num_seqs, v_heads, v_dim)
    a = randn(num_seqs, v_heads, gen=gen, scale=2.0, dtype=dtype)
    b = randn(num_seqs, v_heads, gen=gen, scale=2.0, dtype=dtype)
    a_log = (torch.rand(v_heads, generator=gen) * 4 - 3).to(DEVICE)  # decays from ~0.99 to ~0.1
    dt_bias = randn(v_heads, gen=gen, scale=0.5)
    return q, k, v, a, b, a_log, dt_bias


def reference_decode(q, k, v, a, b, a_log, dt_bias, states, scale):
    """(out [N, HV, V], new states [N, HV, K, V] fp32) from the recurrent reference, gate as the layer."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    out, final = recurrent_gated_delta_rule_reference(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
        initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[:, 0], final


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads, v_heads, k_dim, v_dim, block_v",
    # 2 value heads per key head and 2 V blocks; 3 per key head with K not a power of two and Dk != Dv.
    [(2, 4, 16, 32, 16), (1, 3, 24, 16, None)],
)
def test_decode_step_matches_reference(dtype, heads, v_heads, k_dim, v_dim, block_v):
    q, k, v, a, b, a_log, dt_bias = decode_inputs(3, heads, v_heads, k_dim, v_dim, dtype)
    a[0, 0], a[1, 0] = 30.0, -30.0  # both sides of softplus's linear threshold
    gen = torch.Generator().manual_seed(1)
    pool = randn(7, v_heads, k_dim, v_dim, gen=gen, scale=0.5)
    before = pool.clone()
    slots = [5, 0, 3]
    scale = k_dim**-0.5
    out = fused_gdn_decode_(
        q, k, v, a, b, a_log, dt_bias, pool, torch.tensor(slots, dtype=torch.int32, device=DEVICE), scale,
        block_v=block_v,
    )  # fmt: skip
    ref_out, ref_state = reference_decode(q, k, v, a, b, a_log, dt_bias, before[slots], scale)
    assert out.dtype == v.dtype and out.shape == (3, v_heads, v_dim)
    out_atol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: the output's own rounding
    torch.testing.assert_close(out.float(), ref_out.float(), atol=out_atol, rtol=0)
    torch.testing.assert_close(pool[slots], ref_state, atol=1e-5, rtol=0)
    assert untouched(pool, before, slots)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_short_chunks_equal_their_tokens_decoded_one_by_one(state_dtype):
    """Chunks of 3, 1, 0 and 5 tokens packed in one launch: each output and final state is bitwise what
    decoding the chunk's tokens one step at a time gives (the arithmetic a cold run's decode would do),
    whatever the other chunks are; other slots stay untouched; and it matches the reference."""
    heads, v_heads, k_dim, v_dim = 2, 4, 16, 16
    lengths, slots = [3, 1, 0, 5], [4, 1, 2, 6]
    tokens = sum(lengths)
    q, k, v, a, b, a_log, dt_bias = decode_inputs(tokens, heads, v_heads, k_dim, v_dim, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    pool = randn(8, v_heads, k_dim, v_dim, gen=gen, scale=0.5, dtype=state_dtype)
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    scale = k_dim**-0.5
    out = fused_gdn_chunks_(q, k, v, a, b, a_log, dt_bias, pool, indices, cu, scale)
    assert untouched(pool, before, [s for s, n in zip(slots, lengths, strict=True) if n])
    stepped = before.clone()
    for n, (start, length) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
        slot = torch.tensor([slots[n]], dtype=torch.int32, device=DEVICE)
        for row in range(start, start + length):
            r = [row]
            one = fused_gdn_decode_(q[r], k[r], v[r], a[r], b[r], a_log, dt_bias, stepped, slot, scale)
            assert torch.equal(out[r], one)
        assert torch.equal(pool[slots[n]], stepped[slots[n]])
    alone = before.clone()
    fused_gdn_chunks_(q[:3], k[:3], v[:3], a[:3], b[:3], a_log, dt_bias, alone, indices[:1], cu[:2], scale)
    assert torch.equal(alone[slots[0]], pool[slots[0]])  # the first chunk without the others
    if state_dtype == torch.float32:
        g = -a_log.exp() * F.softplus(a + dt_bias)
        ref_out, ref_state = recurrent_gated_delta_rule_reference(
            q[None, 4:], k[None, 4:], v[None, 4:], g[None, 4:], b[None, 4:].sigmoid(), scale=scale,
            initial_state=before[[6]], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[4:], ref_out[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(pool[[6]], ref_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_decode_steps_carry_the_state_in_its_slot(state_dtype):
    """6 steps of 2 sequences, their batch order swapped every other step: each state follows its slot.
    Equals the reference run over the 6 tokens at once (bf16 states: rounded after every step)."""
    heads, v_heads, k_dim, v_dim, steps = 2, 4, 16, 16, 6
    q, k, v, a, b, a_log, dt_bias = decode_inputs(2 * steps, heads, v_heads, k_dim, v_dim, torch.float32)
    gen = torch.Generator().manual_seed(2)
    pool = randn(3, v_heads, k_dim, v_dim, gen=gen, scale=0.5, dtype=state_dtype)
    before = pool.clone()
    slots = [2, 0]  # sequence 0 lives in slot 2, sequence 1 in slot 0
    outs = torch.empty(2, steps, v_heads, v_dim, device=DEVICE)
    for t in range(steps):
        order = [0, 1] if t % 2 == 0 else [1, 0]
        rows = [2 * t + s for s in order]  # token t of sequence s is input row 2t + s
        indices = torch.tensor([slots[s] for s in order], dtype=torch.int32, device=DEVICE)
        out = fused_gdn_decode_(
            q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, pool, indices, k_dim**-0.5
        )
        outs[order, t] = out
    if state_dtype == torch.float32:
        per_token = [torch.arange(s, 2 * steps, 2) for s in (0, 1)]  # [2, steps] input rows
        g = -a_log.exp() * F.softplus(a + dt_bias)
        ref_out, ref_state = recurrent_gated_delta_rule_reference(
            *(torch.stack([x[r] for r in per_token]) for x in (q, k, v, g, b.sigmoid())),
            scale=k_dim**-0.5, initial_state=before[slots], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(outs, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(pool[slots], ref_state, atol=1e-5, rtol=0)
    else:
        # Step by step through the reference, rounding the state to bf16 as the pool does.
        state = before[slots].float()
        for t in range(steps):
            rows = [2 * t, 2 * t + 1]
            ref_out, state = reference_decode(
                q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, state, k_dim**-0.5
            )
            state = state.to(torch.bfloat16).float()
            torch.testing.assert_close(outs[:, t], ref_out, atol=2e-3, rtol=0)
        # Each step's arithmetic is fp32 in both; the stored states may differ by one bf16 ulp.
        torch.testing.assert_close(pool[slots].float(), state, atol=1e-2, rtol=1e-2)
    assert untouched(pool, before, slots)


def test_padding_rows_touch_no_slot():
    """A negative slot index is a padding row of a CUDA-graph batch: computed from a zero state, written
    nowhere. Conv update and decode step alike."""
    q, k, v, a, b, a_log, dt_bias = decode_inputs(2, 2, 4, 16, 16, torch.float32)
    gen = torch.Generator().manual_seed(3)
    pool = randn(2, 4, 16, 16, gen=gen)
    before = pool.clone()
    indices = torch.tensor([-1, 1], dtype=torch.int32, device=DEVICE)
    out = fused_gdn_decode_(q, k, v, a, b, a_log, dt_bias, pool, indices, 0.25)
    ref_out, ref_state = reference_decode(
        q, k, v, a, b, a_log, dt_bias, torch.stack((torch.zeros_like(before[1]), before[1])), 0.25
    )
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool[1], ref_state[1], atol=1e-5, rtol=0)
    assert torch.equal(pool[0], before[0])

    x, weight = randn(2, 24, gen=gen), randn(24, WIDTH, gen=gen)
    conv_pool = randn(2, WIDTH - 1, 24, gen=gen)
    conv_before = conv_pool.clone()
    out = causal_conv1d_update_(x, conv_pool, weight, indices, "silu", block_c=16)
    states = torch.stack((torch.zeros_like(conv_before[1]), conv_before[1])).transpose(1, 2).clone()
    ref_out = causal_conv1d_update_reference(x, states, weight, activation="silu")
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(conv_pool[1], states[1].T, atol=0, rtol=0)
    assert torch.equal(conv_pool[0], conv_before[0])


def test_strided_slot_indices_address_the_right_slots():
    """A column of a [B, n] index table (a speculative verify's slots) is strided: each kernel must read
    index n of the view, not element n of the storage."""
    q, k, v, a, b, a_log, dt_bias = decode_inputs(2, 2, 4, 16, 16, torch.float32)
    gen = torch.Generator().manual_seed(5)
    table = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32, device=DEVICE)  # column 1 = slots 3, 1
    pool = randn(4, 4, 16, 16, gen=gen)
    expected = pool.clone()
    fused_gdn_decode_(q, k, v, a, b, a_log, dt_bias, expected, table[:, 1].contiguous(), 0.25)
    fused_gdn_decode_(q, k, v, a, b, a_log, dt_bias, pool, table[:, 1], 0.25)
    assert torch.equal(pool, expected)
    x, weight = randn(2, 24, gen=gen), randn(24, WIDTH, gen=gen)
    conv_pool = randn(4, WIDTH - 1, 24, gen=gen)
    conv_expected = conv_pool.clone()
    causal_conv1d_update_(x, conv_expected, weight, table[:, 1].contiguous(), "silu", block_c=16)
    causal_conv1d_update_(x, conv_pool, weight, table[:, 1], "silu", block_c=16)
    assert torch.equal(conv_pool, conv_expected)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_verify_steps_keep_the_state_after_every_token(state_dtype):
    """A verify forward of 3 tokens per sequence in one launch of each kernel: the window and state
    after token t land in slot slots[n, t] (column 0 in place), equal to running the one-token kernels
    column by column with the previous column's slot copied forward; a padding row (-1) writes nothing;
    every other slot is untouched."""
    heads, v_heads, k_dim, v_dim, channels, steps = 2, 4, 16, 16, 24, 3
    slots = torch.tensor([[2, 5, 0], [-1, -1, -1], [4, 1, 6]], dtype=torch.int32, device=DEVICE)
    rows = slots.shape[0] * steps
    q, k, v, a, b, a_log, dt_bias = decode_inputs(rows, heads, v_heads, k_dim, v_dim, torch.float32)
    x, weight, conv_pool = conv_inputs(rows, channels, 8, torch.float32, seed=4)
    gen = torch.Generator().manual_seed(6)
    pool = randn(8, v_heads, k_dim, v_dim, gen=gen, scale=0.5, dtype=state_dtype)
    expected_pool, expected_conv = pool.clone(), conv_pool.clone()
    expected_out = torch.empty(slots.shape[0], steps, v_heads, v_dim, device=DEVICE)
    expected_x = torch.empty(slots.shape[0], steps, channels, device=DEVICE)
    by_token = torch.arange(rows, device=DEVICE).view(-1, steps)
    live = slots[:, 0] >= 0
    for t in range(steps):
        column, token_rows = slots[:, t].contiguous(), by_token[:, t]
        if t:
            source, target = slots[live, t - 1].long(), slots[live, t].long()
            expected_pool[target], expected_conv[target] = expected_pool[source], expected_conv[source]
        expected_x[:, t] = causal_conv1d_update_(
            x[token_rows], expected_conv, weight, column, "silu", block_c=16
        )
        expected_out[:, t] = fused_gdn_decode_(
            *(tensor[token_rows] for tensor in (q, k, v, a, b)), a_log, dt_bias, expected_pool, column, 0.25
        )
    before_pool, before_conv = pool.clone(), conv_pool.clone()
    convolved = causal_conv1d_steps_(x, conv_pool, weight, slots, "silu", block_c=16)
    out = fused_gdn_steps_(q, k, v, a, b, a_log, dt_bias, pool, slots, 0.25)
    # Live rows only: a padding row's outputs are unspecified (the one-token kernels restart it from zeros
    # every column, the fused ones carry its state).
    convolved, out = convolved.view_as(expected_x)[live], out.view_as(expected_out)[live]
    torch.testing.assert_close(convolved, expected_x[live], atol=1e-6, rtol=0)
    torch.testing.assert_close(out, expected_out[live], atol=1e-5, rtol=0)
    written = slots[live].flatten().tolist()
    torch.testing.assert_close(conv_pool[written], expected_conv[written], atol=1e-6, rtol=0)
    torch.testing.assert_close(pool[written].float(), expected_pool[written].float(), atol=1e-5, rtol=0)
    assert untouched(pool, before_pool, written) and untouched(conv_pool, before_conv, written)


# -- the conv ----------------------------------------------------------------------------------------


def conv_inputs(tokens: int, channels: int, num_slots: int, dtype, seed: int = 0):
    """x [T, C] and pool in `dtype`, weight fp32 (the reference convolves in the weight's dtype, and
    CPU torch has no fp16 conv1d; the kernels compute in fp32 whatever the dtypes)."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(tokens, channels, gen=gen, dtype=dtype)
    weight = randn(channels, WIDTH, gen=gen, scale=0.5)
    pool = randn(num_slots, WIDTH - 1, channels, gen=gen, dtype=dtype)
    return x, weight, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_update_matches_reference_over_steps(dtype, activation):
    channels, slots, steps = 24, [4, 1, 2], 4
    x, weight, pool = conv_inputs(steps * 3, channels, 5, dtype)
    before = pool.clone()
    states = before[slots].transpose(1, 2).clone()  # the reference's channel-first [N, C, W-1]
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    for t in range(steps):
        rows = slice(3 * t, 3 * t + 3)
        out = causal_conv1d_update_(x[rows], pool, weight, indices, activation, block_c=16)
        ref_out = causal_conv1d_update_reference(x[rows], states, weight, activation=activation)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)
        assert torch.equal(pool[slots], states.transpose(1, 2))  # the window is moved, never rounded
    assert untouched(pool, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_varlen_matches_reference(dtype, activation):
    """5 sequences of 5, 0, 1, 2 and 9 tokens in 4-token blocks that straddle sequences: an empty one
    keeps its window; those shorter than W-1 keep part of their old window."""
    lengths, slots, channels = [5, 0, 1, 2, 9], [3, 6, 0, 5, 1], 24
    x, weight, pool = conv_inputs(sum(lengths), channels, 7, dtype)
    before = pool.clone()
    bounds = torch.tensor(lengths).cumsum(0).tolist()
    cu_seqlens = torch.tensor([0, *bounds], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    out = causal_conv1d_varlen_(x, pool, weight, indices, cu_seqlens, activation, block_t=4, block_c=16)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    for slot, start, length in zip(slots, [0, *bounds], lengths, strict=False):
        if length == 0:
            assert torch.equal(pool[slot], before[slot])
            continue
        ref = causal_conv1d_reference(
            x[start : start + length].T[None],
            weight,
            initial_states=before[slot].T[None],
            activation=activation,
        )
        torch.testing.assert_close(
            out[start : start + length].float(), ref.out[0].T.float(), atol=atol, rtol=0
        )
        assert torch.equal(pool[slot], ref.final_states[0].T)
    assert untouched(pool, before, slots)


def test_conv_chunks_and_decode_continue_one_another():
    """One sequence fed as varlen chunks of 3 and 1 tokens, a decode step, then 5 tokens equals the whole
    10 tokens in one call: the window hand-over between the two kernels is exact."""
    x, weight, pool = conv_inputs(10, 24, 2, torch.float32)
    pool[1].zero_()  # a new sequence in slot 1
    whole_pool = pool.clone()
    index = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    whole = causal_conv1d_varlen_(
        x, whole_pool, weight, index, torch.tensor([0, 10], dtype=torch.int32, device=DEVICE), "silu"
    )
    pieces = []
    for start, end in [(0, 3), (3, 4), (4, 5), (5, 10)]:
        if end - start == 1 and start == 4:
            pieces.append(causal_conv1d_update_(x[start:end], pool, weight, index, "silu"))
            continue
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        pieces.append(causal_conv1d_varlen_(x[start:end], pool, weight, index, cu, "silu"))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-6, rtol=0)
    assert torch.equal(pool, whole_pool)


# -- the prefill wrapper and the layer's fast path -----------------------------------------------------


def chunk_pairs(bounds: list[int], chunk_size: int) -> list[list[int]]:
    """(sequence, chunk) for every chunk of every sequence, in order: what fla's `chunk_indices` holds."""
    spans = itertools.pairwise(bounds)
    return [[n, c] for n, (start, end) in enumerate(spans) for c in range(-(-(end - start) // chunk_size))]


def test_varlen_metadata_is_fla_s_built_once_per_bounds():
    """fla_varlen: fla's chunk indices (empty sequences, partial and whole chunks; fla's own function is
    compared on the GPU, test_gdn_gpu.py), the same tensors for the same bounds whatever tensor holds
    them, new ones for new bounds."""
    bounds = torch.tensor([0, 5, 5, 200, 328, 329], dtype=torch.int32)
    first = fla_varlen(bounds, torch.device("cpu"))
    assert first.cu_seqlens.dtype == torch.int64 and torch.equal(first.cu_seqlens, bounds.long())
    assert first.chunk_indices.tolist() == [[0, 0], [2, 0], [2, 1], [2, 2], [2, 3], [3, 0], [3, 1], [4, 0]]
    assert fla_varlen(bounds.clone(), torch.device("cpu")) is first
    other = fla_varlen(torch.tensor([0, 64, 65]), torch.device("cpu"))
    assert other is not first and other.chunk_indices.tolist() == [[0, 0], [1, 0]]


@pytest.fixture
def reference_fla(monkeypatch):
    """Stands fla's forward (`l2norm_fwd` and `chunk_gated_delta_rule_fwd`, which `gdn_prefill_` calls
    directly; they do not run in the interpreter as shipped) in with the references, so the rest of
    `gdn_prefill_` (gate, gather, scatter, empty sequences) and the layer's prefill wiring run here; fla
    itself is checked on the GPU (test_gdn_gpu.py)."""
    calls = []

    def l2norm_fwd(x):
        assert x.is_contiguous()  # fla's kernels index rows of a contiguous layout
        return l2_normalize(x.float()).to(x.dtype), None

    def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                                   cu_seqlens, chunk_indices, chunk_size):  # fmt: skip
        assert all(x.is_contiguous() for x in (q, k, v, g, beta, initial_state))
        assert cu_seqlens.dtype == torch.int64 and g.dtype == torch.float32
        assert chunk_indices.tolist() == chunk_pairs(cu_seqlens.tolist(), chunk_size)
        calls.append(cu_seqlens)
        out, final = chunk_gated_delta_rule_reference(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=False,
        )  # fmt: skip
        return g, out, None, final, initial_state, None

    norm = types.ModuleType("fla.modules.norm.l2norm")
    norm.l2norm_fwd = l2norm_fwd
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    chunk.chunk_gated_delta_rule_fwd = chunk_gated_delta_rule_fwd
    monkeypatch.setitem(sys.modules, "fla.modules.norm.l2norm", norm)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule.chunk", chunk)
    return calls


@pytest.mark.skipif(DEVICE == "cuda", reason="test_gdn_gpu.py runs the real fla kernel")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_wrapper_continues_each_slot(reference_fla, state_dtype):
    """3 sequences of 5, 0 and 3 tokens: each continues its slot's state, the empty one keeps its slot
    bit for bit (bf16 included), the slots outside the batch are untouched."""
    lengths, slots = [5, 0, 3], [2, 0, 3]
    q, k, v, a, b, a_log, dt_bias = decode_inputs(sum(lengths), 2, 4, 16, 16, torch.float32)
    gen = torch.Generator().manual_seed(6)
    pool = randn(4, 4, 16, 16, gen=gen, scale=0.5, dtype=state_dtype)
    before = pool.clone()
    cu_seqlens = torch.tensor([0, 5, 5, 8], dtype=torch.int32)
    out = gdn_prefill_(q, k, v, a, b, a_log, dt_bias, pool, torch.tensor(slots, dtype=torch.int32),
                       cu_seqlens, 16**-0.5)  # fmt: skip
    g = -a_log.exp() * F.softplus(a + dt_bias)
    ref_out, ref_state = recurrent_gated_delta_rule_reference(
        q[None], k[None], v[None], g[None], b.sigmoid()[None], scale=16**-0.5,
        initial_state=before[slots].float(), output_final_state=True, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(pool[[2, 3]], ref_state[[0, 2]].to(state_dtype), atol=1e-5, rtol=0)
    assert torch.equal(pool[0], before[0])  # the empty sequence's slot
    assert untouched(pool, before, slots)
    assert len(reference_fla) == 1


@pytest.mark.skipif(
    DEVICE == "cuda", reason="on a GPU, test_gdn_gpu.py runs the layer against the CPU reference"
)
def test_layer_fast_path_matches_reference_path(reference_fla, pool_backend):
    """`GatedDeltaNet._mix_cuda` (the in-place kernels; it needs no CUDA itself, only fla, stood in
    for here) against the reference path on one pool: a prefill of 20, 0, 2 and 1 tokens (fla's chunked
    kernel; the 2- and 1-token ones keep part of their conv window), 3 decode steps, then short chunks
    continuing all four (our token-by-token kernel)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(0, 32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                          conv_kernel_size=WIDTH, rms_norm_eps=1e-6)  # fmt: skip
    with torch.no_grad():
        layer.A_log.uniform_(-3.0, 0.5)
        layer.dt_bias.normal_(0.0, 0.5)
        layer.conv1d.weight.normal_(0.0, 0.4)
        layer.norm.weight.normal_(1.0, 0.2)
    gen = torch.Generator().manual_seed(4)
    reference_pools = {
        "conv": torch.randn(6, WIDTH - 1, layer.conv_dim, generator=gen),
        "recurrent": torch.randn(6, 4, 16, 16, generator=gen) * 0.5,
    }
    fast_pools = {c: p.clone() for c, p in reference_pools.items()}
    slots = [4, 0, 2, 5]
    with torch.no_grad():
        for lengths in ([20, 0, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [3, 1, 0, 4]):
            x = torch.randn(sum(lengths), 32, generator=gen)
            ref_out = layer(x, pool_backend(reference_pools, slots, lengths))
            out = layer._forward_mixing(layer._mix_cuda, x, pool_backend(fast_pools, slots, lengths))
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
            for component, pool in fast_pools.items():
                torch.testing.assert_close(pool, reference_pools[component], atol=1e-5, rtol=0)
    assert len(reference_fla) == 1  # the prefill only
    # A second forward of the same bounds hands fla the very same metadata (its memo hits; no rebuild).
    with torch.no_grad():
        lengths = [20, 0, 2, 1]
        x = torch.randn(23, 32, generator=gen)
        layer._forward_mixing(layer._mix_cuda, x, pool_backend(fast_pools, slots, lengths))
    assert len(reference_fla) == 2 and reference_fla[1] is reference_fla[0]
