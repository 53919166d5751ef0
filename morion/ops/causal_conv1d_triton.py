"""Causal depthwise conv1d on CUDA, carrying each sequence's window in a slot-indexed pool, in place.

The pool is token-major, as the model's cache keeps it: `conv_pool[slot]` is [W-1, C], row 0 the oldest
of the last W-1 pre-conv inputs, row W-2 the newest (zeros for a new sequence). Both ops compute what
`causal_conv1d_reference` / `causal_conv1d_update_reference` (ops/causal_conv1d.py) compute, without
bias: out[t, c] = act(sum_i weight[c, i] * input[t - W + 1 + i, c]), inputs before a sequence's first new
token coming from its window. Arithmetic is fp32; the output is in x's dtype, the window in the pool's.

The input x is [T, C] or a `GroupedChannels` view of a group-first projection (ops/causal_conv1d.py):
the kernels read each channel's column where the projection put it (`_input_columns`), so the layer
passes its in_proj output uncopied. Output, window and weight are in the conv's channel order.

- `causal_conv1d_steps_`: a few tokens per sequence (a speculative verify forward), the window after
  each token written to that token's slot; `causal_conv1d_update_` is its one-token case (decode).
  Capturable in a CUDA graph: no host sync, only the output is allocated. A negative slot index marks a
  padding row: it reads a zero window and writes no slot.
- `causal_conv1d_varlen_`: any number of tokens per sequence (prefill, packed by `cu_seqlens`). Two
  launches: the conv reads every old window, then a second kernel rewrites the windows, so no program
  can overwrite a window another program still has to read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.causal_conv1d import GroupedChannels
from morion.ops.pdl import launch_options, wait_for_previous_kernel


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _input_columns(offs_c, groups, stride_xg, KEY_WIDTH: tl.constexpr, VALUE_WIDTH: tl.constexpr):
    """Where conv channels offs_c lie in one token's input row (see `GroupedChannels`): channel c of
    segment s (q, k or v) at `local` within it is column (local // width) * stride_xg + start_s +
    local % width, width and start_s the segment's columns per group and offset within a group."""
    keys = groups * KEY_WIDTH
    in_q = offs_c < keys
    in_k = offs_c < 2 * keys
    local = offs_c - tl.where(in_q, 0, tl.where(in_k, keys, 2 * keys))
    width = tl.where(in_k, KEY_WIDTH, VALUE_WIDTH)
    start = tl.where(in_q, 0, tl.where(in_k, KEY_WIDTH, 2 * KEY_WIDTH))
    return (local // width) * stride_xg + start + local % width


@triton.jit
def _conv_steps_kernel(
    x_ptr,
    pool_ptr,
    weight_ptr,
    slots_ptr,
    out_ptr,
    C,
    groups,
    stride_xn,
    stride_xg,
    stride_ps,
    stride_pw,
    stride_wc,
    stride_wi,
    stride_on,
    W: tl.constexpr,
    STEPS: tl.constexpr,
    SILU: tl.constexpr,
    BC: tl.constexpr,
    KEY_WIDTH: tl.constexpr,
    VALUE_WIDTH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: sequence n, channels [ic*BC, ic*BC + BC), over its STEPS tokens (rows n * STEPS + t).
    Token t reads the window in slot slots[n, t - 1] (slots[n, 0] for t = 0) and writes the window rolled
    past it to slot slots[n, t] (t = 0: in place)."""
    wait_for_previous_kernel(USE_PDL)
    n = tl.cast(tl.program_id(0), tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    cols_x = _input_columns(offs_c, groups, stride_xg, KEY_WIDTH, VALUE_WIDTH)
    weight_ptrs = weight_ptr + offs_c * stride_wc
    source = tl.cast(tl.load(slots_ptr + n * STEPS), tl.int64)
    for t in tl.static_range(STEPS):
        row_in = n * STEPS + t
        target = tl.cast(tl.load(slots_ptr + row_in), tl.int64)
        read_mask = mask_c & (source >= 0)
        write_mask = mask_c & (target >= 0)
        source_ptrs = pool_ptr + tl.maximum(source, 0) * stride_ps + offs_c
        target_ptrs = pool_ptr + tl.maximum(target, 0) * stride_ps + offs_c
        acc = tl.zeros([BC], dtype=tl.float32)
        for i in tl.static_range(W - 1):
            # Row i is loaded before row i-1 of the target is written with it: each channel's rows are
            # read and written by the same thread, in this order, so the in-place shift (t = 0) is safe,
            # and token t + 1 reads what token t wrote.
            row = tl.load(source_ptrs + i * stride_pw, mask=read_mask, other=0.0)
            w = tl.cast(tl.load(weight_ptrs + i * stride_wi, mask=mask_c, other=0.0), tl.float32)
            acc += tl.cast(row, tl.float32) * w
            if i > 0:
                tl.store(target_ptrs + (i - 1) * stride_pw, row, mask=write_mask)
        x = tl.load(x_ptr + row_in * stride_xn + cols_x, mask=mask_c, other=0.0)
        w = tl.cast(tl.load(weight_ptrs + (W - 1) * stride_wi, mask=mask_c, other=0.0), tl.float32)
        acc += tl.cast(x, tl.float32) * w
        tl.store(target_ptrs + (W - 2) * stride_pw, tl.cast(x, pool_ptr.dtype.element_ty), mask=write_mask)
        if SILU:
            acc = _silu(acc)
        tl.store(out_ptr + row_in * stride_on + offs_c, tl.cast(acc, out_ptr.dtype.element_ty), mask=mask_c)
        source = target


# Arguments that vary with the batch (sequence and token counts, the page table's width) are not
# specialized on: Triton would compile a variant per value class (1, a multiple of 16, other) the first
# time a request brings one, stalling every running request for seconds (seen through the server on
# the H200: a 4.1 s TTFT); one variant serves every batch. runner/warmup.py compiles the rest.
@triton.jit(do_not_specialize=["T"])
def _conv_varlen_kernel(
    x_ptr,
    pool_ptr,
    weight_ptr,
    indices_ptr,
    cu_seqlens_ptr,
    seq_of_token_ptr,
    out_ptr,
    T,
    C,
    groups,
    stride_xt,
    stride_xg,
    stride_ps,
    stride_pw,
    stride_wc,
    stride_wi,
    stride_ot,
    W: tl.constexpr,
    SILU: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    KEY_WIDTH: tl.constexpr,
    VALUE_WIDTH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: flat tokens [it*BT, it*BT + BT) (possibly of several sequences) x BC channels.

    Reads the pool only (the old windows); `_conv_window_kernel` writes it afterwards.
    """
    wait_for_previous_kernel(USE_PDL)
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_t = offs_t < T
    mask_c = offs_c < C
    cols_x = _input_columns(offs_c, groups, stride_xg, KEY_WIDTH, VALUE_WIDTH)
    seq = tl.load(seq_of_token_ptr + offs_t, mask=mask_t, other=0)
    start = tl.load(cu_seqlens_ptr + seq, mask=mask_t, other=0)
    slot = tl.cast(tl.load(indices_ptr + seq, mask=mask_t, other=0), tl.int64)

    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        source = offs_t - (W - 1 - i)  # the input token that tap i sees
        in_x = source >= start
        from_x = tl.load(
            x_ptr + tl.cast(source, tl.int64)[:, None] * stride_xt + cols_x[None, :],
            mask=(mask_t & in_x)[:, None] & mask_c[None, :],
            other=0.0,
        )
        # Before the sequence's first new token: row W-1 + (source - start) of its old window.
        row = (W - 1) + source - start
        from_window = tl.load(
            pool_ptr
            + slot[:, None] * stride_ps
            + tl.cast(row, tl.int64)[:, None] * stride_pw
            + offs_c[None, :],
            mask=(mask_t & (source < start))[:, None] & mask_c[None, :],
            other=0.0,
        )
        value = tl.where(in_x[:, None], tl.cast(from_x, tl.float32), tl.cast(from_window, tl.float32))
        w = tl.cast(
            tl.load(weight_ptr + offs_c * stride_wc + i * stride_wi, mask=mask_c, other=0.0), tl.float32
        )
        acc += value * w[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(
        out_ptr + tl.cast(offs_t, tl.int64)[:, None] * stride_ot + offs_c[None, :],
        tl.cast(acc, out_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_c[None, :],
    )


@triton.jit
def _conv_window_kernel(
    x_ptr,
    pool_ptr,
    indices_ptr,
    cu_seqlens_ptr,
    C,
    groups,
    stride_xt,
    stride_xg,
    stride_ps,
    stride_pw,
    W: tl.constexpr,
    BC: tl.constexpr,
    KEY_WIDTH: tl.constexpr,
    VALUE_WIDTH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: sequence n, BC channels. New row j = input token end - (W-1) + j, taken from x when
    it is one of this call's tokens, else from old row j + length (fewer than W-1 new tokens).

    In place: row j is written at step j and rows j + length > j are read, so no row is read after it
    was written (same thread per channel, program order). A sequence without tokens is left alone.
    """
    wait_for_previous_kernel(USE_PDL)
    n = tl.cast(tl.program_id(0), tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    cols_x = _input_columns(offs_c, groups, stride_xg, KEY_WIDTH, VALUE_WIDTH)
    start = tl.load(cu_seqlens_ptr + n)
    end = tl.load(cu_seqlens_ptr + n + 1)
    length = end - start
    slot = tl.cast(tl.load(indices_ptr + n), tl.int64)
    live = (length > 0) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    window_ptrs = pool_ptr + slot * stride_ps + offs_c
    for j in tl.static_range(W - 1):
        source = end - (W - 1) + j
        from_x = tl.load(
            x_ptr + tl.cast(source, tl.int64) * stride_xt + cols_x,
            mask=mask_c & live & (source >= start),
            other=0.0,
        )
        from_window = tl.load(
            window_ptrs + tl.cast(j + length, tl.int64) * stride_pw,
            mask=mask_c & live & (source < start),
            other=0.0,
        )
        value = tl.where(source >= start, tl.cast(from_x, pool_ptr.dtype.element_ty), from_window)
        tl.store(window_ptrs + j * stride_pw, value, mask=mask_c & live)


def _check(
    x: torch.Tensor | GroupedChannels, conv_pool: torch.Tensor, weight: torch.Tensor, activation: str | None
) -> tuple[GroupedChannels, int, bool]:
    """The input as grouped channels (a plain one with unit stride on C), the width, whether SiLU."""
    channels, width = weight.shape
    if width < 2:
        raise ValueError(f"conv width {width}: a carried window needs W >= 2")
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise ValueError(f"x {tuple(x.shape)}, expected [tokens, {channels}]")
        x = x if x.stride(-1) == 1 else x.contiguous()
    grouped = GroupedChannels.of(x)
    inputs = grouped.x
    used = 2 * grouped.key_width + grouped.value_width
    if inputs.dim() != 3 or grouped.channels != channels or used > inputs.shape[2] or inputs.stride(-1) != 1:
        raise ValueError(
            f"x {tuple(inputs.shape)} (per group {grouped.key_width} q, {grouped.key_width} k, "
            f"{grouped.value_width} v, unit stride) does not give the conv's {channels} channels"
        )
    if conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (width - 1, channels):
        raise ValueError(f"conv_pool {tuple(conv_pool.shape)}, expected [S, {width - 1}, {channels}]")
    if conv_pool.stride(-1) != 1:
        raise ValueError("conv_pool needs unit stride over channels (it is updated in place, so not copied)")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r} (supported: None, silu, swish)")
    return grouped, width, activation is not None


def _layout(grouped: GroupedChannels) -> tuple[tuple[int, int, int], dict[str, int]]:
    """(groups, token stride, group stride) and the constexprs that `_input_columns` takes."""
    x = grouped.x
    widths = {"KEY_WIDTH": grouped.key_width, "VALUE_WIDTH": grouped.value_width}
    return (x.shape[1], x.stride(0), x.stride(1)), widths


def causal_conv1d_update_(
    x: torch.Tensor | GroupedChannels,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    *,
    block_c: int = 256,
) -> torch.Tensor:
    """The decode step: x [N, C] (one token per sequence; or grouped, see the module docstring) continues
    window `conv_pool[state_indices[n]]` ([S, W-1, C]), which is shifted in place to end with x:
    `causal_conv1d_steps_` with one token per sequence. weight: [C, W]; state_indices: [N] int32.
    Returns [N, C] in x's dtype."""
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices {tuple(state_indices.shape)}, expected [N]")
    return causal_conv1d_steps_(x, conv_pool, weight, state_indices[:, None], activation, block_c=block_c)


def causal_conv1d_steps_(
    x: torch.Tensor | GroupedChannels,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
    *,
    block_c: int = 256,
) -> torch.Tensor:
    """T tokens per sequence in one launch (a speculative verify forward; T = 1 is a decode step): x
    [N * T, C] (or grouped), sequence n's tokens in rows n * T .. n * T + T - 1, continue the window in
    `conv_pool[slots[n, 0]]`; the window after token t is written to `conv_pool[slots[n, t]]` (column 0:
    in place). slots: [N, T] int32, distinct within a row (negative = padding row: zero window, no slot
    written). weight: [C, W]. Returns [N * T, C] in x's dtype."""
    grouped, width, silu = _check(x, conv_pool, weight, activation)
    rows, channels = grouped.x.shape[0], weight.shape[0]
    if slots.dim() != 2 or slots.shape[0] * slots.shape[1] != rows:
        raise ValueError(f"slots {tuple(slots.shape)} must be [N, T] with N * T = {rows} rows")
    slots = slots.contiguous()  # the kernel reads slot (n, t) at offset n * T + t
    out = torch.empty(rows, channels, dtype=grouped.x.dtype, device=grouped.x.device)
    if rows == 0:
        return out
    block_c = min(block_c, triton.next_power_of_2(channels))
    grid = (slots.shape[0], triton.cdiv(channels, block_c))
    (groups, stride_xn, stride_xg), widths = _layout(grouped)
    _conv_steps_kernel[grid](
        grouped.x, conv_pool, weight, slots, out, channels, groups,
        stride_xn, stride_xg, conv_pool.stride(0), conv_pool.stride(1), weight.stride(0), weight.stride(1),
        out.stride(0),
        W=width, STEPS=slots.shape[1], SILU=silu, BC=block_c, **widths, **launch_options(),
    )  # fmt: skip
    return out


def causal_conv1d_varlen_(
    x: torch.Tensor | GroupedChannels,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
    *,
    block_t: int = 32,
    block_c: int = 128,
) -> torch.Tensor:
    """The prefill step: x [T, C] (or grouped) packs N sequences (`cu_seqlens` [N+1] int32: 0, end_0,
    ..., T); each continues window `conv_pool[state_indices[n]]` and leaves there its last W-1 inputs (old
    window rows filling in when it has fewer than W-1 new tokens; untouched when it has none). Slots must
    be distinct. Returns [T, C] in x's dtype."""
    grouped, width, silu = _check(x, conv_pool, weight, activation)
    tokens, channels = grouped.x.shape[0], weight.shape[0]
    num_seqs = state_indices.shape[0]
    if cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} does not fit {num_seqs} state indices")
    # The kernels read index n at offset n.
    state_indices, cu_seqlens = state_indices.contiguous(), cu_seqlens.contiguous()
    out = torch.empty(tokens, channels, dtype=grouped.x.dtype, device=grouped.x.device)
    if num_seqs == 0:
        return out
    # Sequence of each flat token: the number of sequence ends at or before it (skips empty sequences).
    seq_of_token = torch.searchsorted(
        cu_seqlens[1:].contiguous(),
        torch.arange(tokens, dtype=cu_seqlens.dtype, device=out.device),
        right=True,
        out_int32=True,
    )
    block_c = min(block_c, triton.next_power_of_2(channels))
    (groups, stride_xt, stride_xg), widths = _layout(grouped)
    if tokens:  # block_t stays fixed whatever T is: one compiled variant for every prefill
        _conv_varlen_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
            grouped.x, conv_pool, weight, state_indices, cu_seqlens, seq_of_token, out, tokens, channels,
            groups, stride_xt, stride_xg, conv_pool.stride(0), conv_pool.stride(1), weight.stride(0),
            weight.stride(1), out.stride(0),
            W=width, SILU=silu, BT=block_t, BC=block_c, **widths, **launch_options(),
        )  # fmt: skip
    # Same stream, after the conv: every old window has been read before any is rewritten.
    _conv_window_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        grouped.x, conv_pool, state_indices, cu_seqlens, channels, groups,
        stride_xt, stride_xg, conv_pool.stride(0), conv_pool.stride(1),
        W=width, BC=block_c, **widths, **launch_options(),
    )  # fmt: skip
    return out
