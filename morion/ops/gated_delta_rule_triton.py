"""The gated delta rule on CUDA, reading and updating slot-indexed states in place.

Three entry points, all taking the layer's raw per-head inputs (q, k before L2 normalisation; a, b before
the gate and the sigmoid) and a state pool `[num_slots, HV, K, V]` addressed by `state_indices`:

- `fused_gdn_steps_`: a few tokens per sequence (a speculative verify forward), our own Triton kernel;
  `fused_gdn_decode_` is its one-token case. Everything of a step is fused: q/k L2 norm, beta =
  sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the state decay, the delta update, the output,
  and the write-back of the state into its slot (after each token into that token's slot, the state
  kept in registers between tokens). It allocates only its output and never syncs with the host, so a
  CUDA graph can capture it.
- `fused_gdn_chunks_`: short chunks of any lengths (a prompt's last tokens after its last page boundary),
  token by token as decode steps them, our own Triton kernel: no autotuning, nothing shared between
  sequences, so a chunk's result is the same in any batch and any process.
- `gdn_prefill_`: any number of tokens per sequence, through fla-core's chunked kernel (varlen), with the
  initial states gathered from the pool and the final states scattered back.

Both compute what `recurrent_gated_delta_rule_reference` / `chunk_gated_delta_rule_reference` compute
with `use_qk_l2norm_in_kernel=True` (ops/gated_delta_rule.py): arithmetic in fp32, the state stored in the
pool's dtype (fp32 or bf16), the output in v's dtype.

A negative entry of `state_indices` marks a padding row of the decode batch (CUDA-graph batches are
padded up to a captured size): it is computed from a zero state and no slot is read or written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from morion.ops.fla_varlen import FLA_CHUNK_SIZE, fla_varlen
from morion.ops.pdl import launch_options, wait_for_previous_kernel

# Same epsilon as `l2_normalize` in ops/gated_delta_rule.py and fla's `l2norm_fwd`.
L2_NORM_EPS = 1e-6


@triton.jit
def _gdn_token(state, q, k, v, a, b, a_log, dt_bias, scale, eps):
    """One token of the gated delta rule on a [K, BV] state tile held in registers (fp32): the q/k L2 norms,
    the gate and beta, the decay, the delta update and the output. Returns (new state, out [BV]). Every
    kernel here steps tokens through this one function, so a token's arithmetic is the same whichever
    kernel (decode, verify, short chunks) runs it."""
    q, k, v = tl.cast(q, tl.float32), tl.cast(k, tl.float32), tl.cast(v, tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))

    # The gate, in fp32 whatever the input dtype: softplus as torch's (threshold 20); the exp
    # argument is clamped so the branch that `where` discards cannot overflow.
    a = tl.cast(a, tl.float32)
    b = tl.cast(b, tl.float32)
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(-tl.exp(a_log) * softplus)
    beta = 1.0 / (1.0 + tl.exp(-b))

    state = state * decay
    predicted = tl.sum(state * k[:, None], axis=0)  # S^T k: [BV]
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)  # S^T (scale * q)
    return state, out


@triton.jit
def _gdn_steps_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    pool_ptr,
    slots_ptr,
    out_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_ag,
    stride_ar,
    stride_bn,
    stride_bg,
    stride_br,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_on,
    stride_oh,
    scale,
    eps,
    K,
    V,
    STEPS: tl.constexpr,
    HEADS_PER_QK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: sequence n, value head hv, value columns [iv*BV, iv*BV + BV) of the state, over the
    sequence's STEPS tokens (rows n * STEPS + t). The state is read once from slot slots[n, 0], kept in
    registers, and written after token t to slot slots[n, t].

    The state tile [K, BV] is read and written by this program only (columns of one head of one slot),
    so the in-place update needs no synchronisation between programs, given distinct slots per row.
    """
    wait_for_previous_kernel(USE_PDL)
    n = tl.cast(tl.program_id(0), tl.int64)
    hv = tl.cast(tl.program_id(1), tl.int64)
    iv = tl.program_id(2)
    h = hv // HEADS_PER_QK  # grouped value heads: q/k head h serves value heads h*r .. h*r + r-1
    j = hv % HEADS_PER_QK  # a and b are read as [T, H, r]: value head hv at (h, j)

    offs_k = tl.arange(0, BK)
    offs_v = iv * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    head_offsets = hv * stride_ph + offs_k[:, None] * stride_pk + offs_v[None, :]
    tile_mask = mask_k[:, None] & mask_v[None, :]

    # int64: slot * stride_ps overflows int32 beyond ~4k slots of a 32x128x128 state.
    first = tl.cast(tl.load(slots_ptr + n * STEPS), tl.int64)
    state = tl.load(
        pool_ptr + tl.maximum(first, 0) * stride_ps + head_offsets, mask=tile_mask & (first >= 0), other=0.0
    )
    state = tl.cast(state, tl.float32)
    a_log = tl.cast(tl.load(a_log_ptr + hv), tl.float32)
    dt_bias = tl.cast(tl.load(dt_bias_ptr + hv), tl.float32)
    for t in tl.static_range(STEPS):
        row = n * STEPS + t
        q = tl.load(q_ptr + row * stride_qn + h * stride_qh + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + row * stride_kn + h * stride_kh + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + row * stride_vn + hv * stride_vh + offs_v, mask=mask_v, other=0.0)
        a = tl.load(a_ptr + row * stride_an + h * stride_ag + j * stride_ar)
        b = tl.load(b_ptr + row * stride_bn + h * stride_bg + j * stride_br)
        state, out = _gdn_token(state, q, k, v, a, b, a_log, dt_bias, scale, eps)

        # The state stored is the one the next token continues from, rounded like the pool's dtype.
        stored = tl.cast(state, pool_ptr.dtype.element_ty)
        state = tl.cast(stored, tl.float32)
        slot = tl.cast(tl.load(slots_ptr + n * STEPS + t), tl.int64)
        state_ptrs = pool_ptr + tl.maximum(slot, 0) * stride_ps + head_offsets
        tl.store(state_ptrs, stored, mask=tile_mask & (slot >= 0))
        tl.store(
            out_ptr + row * stride_on + hv * stride_oh + offs_v,
            tl.cast(out, out_ptr.dtype.element_ty),
            mask=mask_v,
        )


@triton.jit
def _gdn_chunks_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    pool_ptr,
    indices_ptr,
    cu_seqlens_ptr,
    out_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_ag,
    stride_ar,
    stride_bn,
    stride_bg,
    stride_br,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_on,
    stride_oh,
    scale,
    eps,
    K,
    V,
    HEADS_PER_QK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: sequence n, value head hv, value columns [iv*BV, iv*BV + BV), over the sequence's rows
    cu_seqlens[n] .. cu_seqlens[n+1] token by token, from and back into slot indices[n]. The state is
    rounded to the pool's dtype after every token, as a decode step stores it, so a chunk's result is
    that of its tokens decoded one by one."""
    wait_for_previous_kernel(USE_PDL)
    n = tl.program_id(0)
    hv = tl.cast(tl.program_id(1), tl.int64)
    iv = tl.program_id(2)
    h = hv // HEADS_PER_QK
    j = hv % HEADS_PER_QK

    offs_k = tl.arange(0, BK)
    offs_v = iv * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    tile_mask = mask_k[:, None] & mask_v[None, :]
    slot = tl.cast(tl.load(indices_ptr + n), tl.int64)
    state_ptrs = pool_ptr + slot * stride_ps + hv * stride_ph + offs_k[:, None] * stride_pk + offs_v[None, :]
    state = tl.cast(tl.load(state_ptrs, mask=tile_mask, other=0.0), tl.float32)
    a_log = tl.cast(tl.load(a_log_ptr + hv), tl.float32)
    dt_bias = tl.cast(tl.load(dt_bias_ptr + hv), tl.float32)
    start = tl.load(cu_seqlens_ptr + n)
    end = tl.load(cu_seqlens_ptr + n + 1)
    for t in range(start, end):
        row = tl.cast(t, tl.int64)
        q = tl.load(q_ptr + row * stride_qn + h * stride_qh + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + row * stride_kn + h * stride_kh + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + row * stride_vn + hv * stride_vh + offs_v, mask=mask_v, other=0.0)
        a = tl.load(a_ptr + row * stride_an + h * stride_ag + j * stride_ar)
        b = tl.load(b_ptr + row * stride_bn + h * stride_bg + j * stride_br)
        state, out = _gdn_token(state, q, k, v, a, b, a_log, dt_bias, scale, eps)
        state = tl.cast(tl.cast(state, pool_ptr.dtype.element_ty), tl.float32)
        tl.store(
            out_ptr + row * stride_on + hv * stride_oh + offs_v,
            tl.cast(out, out_ptr.dtype.element_ty),
            mask=mask_v,
        )
    tl.store(state_ptrs, tl.cast(state, pool_ptr.dtype.element_ty), mask=tile_mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _checked_step_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The shape rules both token-stepping entry points share (index values are not checked: that would
    sync); returns q, k, v, a, b, A_log, dt_bias as the kernels read them and the output [T, HV, V]."""
    rows, num_qk_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != rows or num_v_heads % num_qk_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    per_group = (num_qk_heads, num_v_heads // num_qk_heads)
    # [T, HV] views are read as [T, H, r] (a view of any strides); group-first ones come so already.
    a, b = (x.unflatten(1, per_group) if x.shape == (rows, num_v_heads) else x for x in (a, b))
    if a.shape != (rows, *per_group) or b.shape != a.shape:
        raise ValueError(
            f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [T, HV] = {(rows, num_v_heads)} "
            f"or [T, H, HV / H] = {(rows, *per_group)}"
        )
    if A_log.shape != (num_v_heads,) or dt_bias.shape != (num_v_heads,):
        raise ValueError(
            f"A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} must be [{num_v_heads}]"
        )
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (num_v_heads, key_dim, value_dim):
        raise ValueError(
            f"state_pool {tuple(state_pool.shape)}, expected [S, {num_v_heads}, {key_dim}, {value_dim}]"
        )
    if state_pool.stride(-1) != 1:
        raise ValueError("state_pool needs unit stride over V (it is updated in place, so it is not copied)")
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out = torch.empty(rows, num_v_heads, value_dim, dtype=v.dtype, device=v.device)
    return q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), out


def _strides(q, k, v, a, b, state_pool, out) -> tuple[int, ...]:
    """The strides both kernels take, in their order."""
    return (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
    )  # fmt: skip


def _tiles(q: torch.Tensor, v: torch.Tensor, block_v: int) -> dict[str, int]:
    return {
        "HEADS_PER_QK": v.shape[1] // q.shape[1],
        "BK": triton.next_power_of_2(q.shape[2]),
        "BV": block_v,
    }


def fused_gdn_decode_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    **launch: int,
) -> torch.Tensor:
    """One gated-delta-rule step for N sequences, updating `state_pool[state_indices[n]]` in place:
    `fused_gdn_steps_` (and its launch options) with one token per sequence. state_indices: [N] int32
    (negative = padding row: no slot is read or written)."""
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices {tuple(state_indices.shape)}, expected [N]")
    slots = state_indices[:, None]
    return fused_gdn_steps_(q, k, v, a, b, A_log, dt_bias, state_pool, slots, scale, **launch)


def fused_gdn_steps_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """T gated-delta-rule steps for each of N sequences in one launch (a speculative verify forward; T = 1
    is a decode step): sequence n starts from the state in `state_pool[slots[n, 0]]` and the state after
    its token t is written to `state_pool[slots[n, t]]` (column 0: in place), so every intermediate state
    is kept and the one after any accepted prefix is already in a slot.

    q, k: [N * T, H, K]; v: [N * T, HV, V] (HV a multiple of H); a, b: [N * T, HV] or, as group-first
    projections lay them out, [N * T, H, HV / H] (raw gate and beta logits; any strides), sequence n's
    tokens in rows n * T .. n * T + T - 1; A_log, dt_bias: [HV]; state_pool: [S, HV, K, V] fp32 or bf16
    with unit stride over V; slots: [N, T] int32, distinct within a row (negative = padding row: no slot
    is read or written). Returns out [N * T, HV, V] in v's dtype. Shapes are checked; index values are
    not (that would sync).
    """
    rows = q.shape[0]
    if slots.dim() != 2 or slots.shape[0] * slots.shape[1] != rows:
        raise ValueError(f"slots {tuple(slots.shape)} must be [N, T] with N * T = {rows} rows")
    q, k, v, a, b, A_log, dt_bias, out = _checked_step_inputs(q, k, v, a, b, A_log, dt_bias, state_pool)
    num_v_heads, value_dim = v.shape[1:]
    slots = slots.contiguous()  # the kernel reads slot (n, t) at offset n * T + t
    if rows == 0:
        return out
    block_v = block_v or min(triton.next_power_of_2(value_dim), 16)
    grid = (slots.shape[0], num_v_heads, triton.cdiv(value_dim, block_v))
    _gdn_steps_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state_pool, slots, out,
        *_strides(q, k, v, a, b, state_pool, out), scale, L2_NORM_EPS, q.shape[2], value_dim,
        STEPS=slots.shape[1], **_tiles(q, v, block_v), **launch_options(), num_warps=num_warps,
    )  # fmt: skip
    return out


def fused_gdn_chunks_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Short chunks (a prompt's tail, a few tokens each) of N packed sequences, token by token in one
    launch: each sequence continues from `state_pool[state_indices[n]]`, which then holds the state after
    its last token. Shapes as `gdn_prefill_` (state_indices distinct, non-negative; cu_seqlens [N+1] int32
    or int64 on the device). Each token takes the same arithmetic as in a decode step, and nothing
    depends on the other sequences or on autotuning: the same chunk gives the same bits in any batch
    and any process (a restored prefix answers as the cold run did). Cost grows with the longest chunk:
    for chunks of up to a page, not for prefill."""
    num_seqs = state_indices.shape[0]
    if cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} does not fit {num_seqs} state indices")
    q, k, v, a, b, A_log, dt_bias, out = _checked_step_inputs(q, k, v, a, b, A_log, dt_bias, state_pool)
    num_v_heads, value_dim = v.shape[1:]
    state_indices, cu_seqlens = state_indices.contiguous(), cu_seqlens.contiguous()
    if num_seqs == 0:
        return out
    block_v = block_v or min(triton.next_power_of_2(value_dim), 16)
    grid = (num_seqs, num_v_heads, triton.cdiv(value_dim, block_v))
    _gdn_chunks_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state_pool, state_indices, cu_seqlens, out,
        *_strides(q, k, v, a, b, state_pool, out), scale, L2_NORM_EPS, q.shape[2], value_dim,
        **_tiles(q, v, block_v), **launch_options(), num_warps=num_warps,
    )  # fmt: skip
    return out


def gdn_prefill_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over N packed sequences through fla-core's chunked kernel.

    q, k: [T, H, K]; v: [T, HV, V]; a, b: [T, HV] or [T, H, HV / H]; A_log, dt_bias: [HV]; state_pool:
    [S, HV, K, V]; state_indices: [N] (distinct, non-negative); cu_seqlens: [N+1] on the device (0,
    end_0, ..., T); cu_seqlens_cpu: the same on the host if the caller has it (saves a device-to-host
    copy, a host sync, per call). Each sequence continues from its slot's state, which then holds the
    state after its tokens; a sequence with no tokens keeps its slot exactly as it was. Returns out
    [T, HV, V] in q's dtype.
    """
    # Lazy: fla imports Triton and probes the device at import; the CPU path never needs it.
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    num_seqs = state_indices.shape[0]
    if cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} does not fit {num_seqs} state indices")
    # As the reference layer: the log-decay in fp32 (bf16 loses the decay's precision), beta in b's dtype.
    num_v_heads = v.shape[1]
    g = -A_log.float().exp() * F.softplus(a.float().reshape(-1, num_v_heads) + dt_bias.float())
    beta = b.sigmoid().reshape(-1, num_v_heads)
    rows = state_indices.long()
    initial = state_pool[rows].float()
    # The forward's varlen metadata, the same tensors for every layer (ops/fla_varlen.py): keyed by the
    # bounds' values, never by a caller's buffer, whose contents may change while fla memoises by identity.
    varlen = fla_varlen(cu_seqlens.cpu() if cu_seqlens_cpu is None else cu_seqlens_cpu, cu_seqlens.device)
    # fla's forward without its public entry's layers (backend dispatch, torch.compiler.disable, the
    # contiguity guard, autocast, autograd.Function): the kernels and arguments of
    # `chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)` in fla-core 0.6.0 (pinned), for
    # ~0.2 ms less Python per layer (36 layers of a prefill, on the engine thread's critical path:
    # results/2026-12-04-h200-session-notes-8cbb9bd.md). The guard's job, contiguous inputs, is done here.
    q_normed, _ = l2norm_fwd(q[None].contiguous())
    k_normed, _ = l2norm_fwd(k[None].contiguous())
    _, out, _, final, _, _ = chunk_gated_delta_rule_fwd(
        q_normed, k_normed, v[None].contiguous(), g[None].contiguous(), beta[None].contiguous(),
        scale=scale, initial_state=initial.contiguous(), output_final_state=True,
        cu_seqlens=varlen.cu_seqlens, chunk_indices=varlen.chunk_indices, chunk_size=FLA_CHUNK_SIZE,
    )  # fmt: skip
    out = out.to(q.dtype)
    # Empty sequences keep their initial state bit for bit (a device-side select: no host sync).
    has_tokens = (varlen.cu_seqlens[1:] > varlen.cu_seqlens[:-1]).view(num_seqs, 1, 1, 1)
    final = torch.where(has_tokens, final, initial)
    state_pool[rows] = final.to(state_pool.dtype)
    return out[0]
