"""Qwen3.8-Flash-Next's hyper-connection mix (layers/hyper_connection.py) in two Triton kernels, for
small token counts (decode, speculative verify, short chunks: T <= MAX_TOKENS).

In eager torch one mix is about fifteen kernels (the grouped norm's fp32 ops, two GEMMs, silu, divides,
sigmoid, products, a mean, the narrow inject linear); at T = 1 each is launch- or latency-bound. Here,
with streams [T, n * H], W_down [R, n * H], W_up [n * H, R], W_inject [n, n * H]:

1. `_down_kernel`, grid (row blocks of [W_down; W_inject], stream s, token block): split-K by stream.
   A program sums its BLOCK_T tokens' squares over stream s (rstd[t, s]), then streams the H columns of
   stream s once more, normalising them on the fly (rounded to the dtype, as the eager norm's output),
   and multiplies them by its BLOCK_N weight rows: partial[s, t, row], fp32. The programs of row block 0
   write rstd [T, n] for kernel 2.
2. `_up_mix_kernel`, grid (blocks of BLOCK_C hidden columns, token block): act = silu(down / n), down
   the sum of the n partials in stream order; then for its columns c of every stream s the rows
   s * H + c of W_up: up, sigmoid, times normed (recomputed from streams and rstd, the same bits as in
   kernel 1) and the mean over the streams: mixed [T, H]. The programs of column block 0 also finish
   the inject weights 2 * sigmoid(inject / n) [T, n] from their partials.

Every weight byte is read once per token block (a call at T <= BLOCK_T reads each once), spread over
hundreds of programs that each stream a few tens of KiB, rather than one program per token row. A plain
loop over K (or R) keeps one step's loads in flight per program, each step waiting for its own: at 2 to
5 programs an SM that is ~10 KiB in flight, where Hopper's HBM needs ~40 KiB an SM. Tiles with stages > 1
pipeline the loops (cp.async into shared memory, `STAGES - 1` steps ahead; kernel 2's n partial loads
then unrolled into the loop body, which Triton pipelines only without a nested loop): at Flash-Next's
shape 6 stages put a program's whole weight slice in flight at once. The tuner chooses (ops/hc_tune.py). The
token block is small (2 rows) because masked rows still cost FMAs and registers on the CUDA cores (the
3-D products are [rows, weight rows, step]); the price is a re-read of the weights (mostly from L2) per
block, which makes the eager path faster beyond 32 tokens. On the H200 at Flash-Next's shape (shipped tiles,
CUDA graphs, PDL off) one mix took 20.5 / 20.0 / 18.9 / 27.3 us at T = 1 / 2 / 4 / 8 with 4-row blocks,
14.4 / 13.9 / 17.5 / 29.4 us with 2, the same bits at each T; 1-row blocks were 12.4 us at T = 1 but 22.9
at T = 4 and changed bits (`results/2026-12-04-h200-session-notes-86da1b1.md`). Measured unhelpful there:
an L2 prefetch of each program's weight rows before its PDL wait (23.3 us against 20.5 without PDL): the
mix is not bound by its weights' 13 MB (~3 us at HBM pace) but by its programs' chains of dependent loads
and their arithmetic. Also slower: the second kernel's last program of each token block (an atomic arrival
count) quantizing the block's rows for the FP8 layers after it, which saved the rows kernel but took
kernel 2 from 15 to 23 us on an H100 (`results/2026-12-05-h100-flash-next-12l-decode-ab-*.md`).

Rounding points: those of the eager code in the weights' dtype. normed is computed in fp32 and rounded
once; each GEMV sums in fp32 and rounds once (as F.linear does); `/ n`, silu, sigmoid, gate * normed and
2 * sigmoid each round to the dtype; the mean sums the n products in fp32 and rounds once. Divisions by
n and H are products with the fp32 reciprocal, as torch does for CUDA tensors divided by a number and in
its mean (exact for n = 4). Left different: the GEMVs' summation order (cuBLAS's differs too between
shapes) and the exp of silu and sigmoid, whose last fp32 bits may differ from torch's on the GPU (as in
ops/fp8.py's `quantize_fp8_sigmoid_gated`): a rounding may flip, so a result is within about an ulp
of the products it averages; fp32 runs agree to about 1e-6. Measured on the H200 in bf16 at Flash-Next's
shape with random weights: bit-identical to eager at T = 1 to 16; at T = 64 (cuBLAS sums in another
order there) 0.04% of the outputs differ, by at most 2^-8.

Invariants:
- Batch invariant: a token row's result does not depend on T or on the other rows. The tiles are fixed
  (BLOCK_T rows, whatever T is), a row never meets another row in a reduction, and the split-K partials
  are summed in a fixed order by one program, without atomics.
- Capturable: grids and buffers depend only on T and the weights' shapes; nothing is read back on the
  host. T is not specialized on, so every CUDA-graph bucket runs the same compiled kernels.
- PDL (ops/pdl.py): each program waits for the kernel before it first of all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.hc_tiles import DEFAULT_MIX_TILES, MixTiles, mix_shape, tuned_mix_tiles
from morion.ops.moe_decode_triton import slot_sum
from morion.ops.moe_tiles import device_name
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.row_kernels_triton import rounded
from morion.ops.slot_partials import SlotPartials

# The engine's batch-invariant range (the fused MoE kernels' AUTO_TRITON_MAX_TOKENS, docs/architecture.md):
# up to here a token's mix is the same bits in every decode batch; past it the eager code takes over, which
# sums in another order. Measured on the H200 at Flash-Next's shape, in CUDA graphs, one mix took 26 us
# fused against 67 us eager at T = 1 to 4, 42 against 71 at T = 16, 71 against 73 at T = 32, but 130
# against 79 at T = 64 (each token block re-reads the weights; see the module docstring): batches of 33
# to 64 rows pay that for invariance until the kernels take larger token tiles.
MAX_TOKENS = 64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_T = 2  # token rows per program: decode batches are small, masked rows cost FMAs (module docstring)
# The other tiles are the device's tuned ones (ops/hc_tiles.py); the defaults: 4 rows of [W_down; W_inject]
# per kernel-1 program, (R / 4 + 1) * n = 324 programs at Flash-Next's shape, K in steps of 512; 16 hidden
# columns per kernel-2 program (n * 16 rows of W_up, 40 KiB), 160 programs, R in steps of 32; both loops
# unpipelined.


@triton.jit
def _normed(x, rstd, w_norm, dtype):
    """GroupedRMSNorm of fp32 x given its stream's rstd: x * rstd * (1 + w) in fp32, rounded once. Both
    kernels go through here, so kernel 2 recomputes the very bits that kernel 1 multiplied."""
    return rounded((x * rstd) * (1.0 + w_norm), dtype)


@triton.jit
def sigmoid_rn(x):
    # 1 / (1 + e^-x) with an IEEE division, as torch's sigmoid (row_kernels_triton does the same).
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-x))


@triton.jit
def stream_lanes(hidden, hc_count, HC_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """A program's n * BLOCK_C lanes over hidden column block program_id(0): lane i is column c of stream
    s, W_up's row and the streams' column s * H + c. -> (stream, up_rows, lanes_ok)."""
    lanes = tl.arange(0, HC_BLOCK * BLOCK_C)
    stream = lanes // BLOCK_C
    col = tl.program_id(0) * BLOCK_C + lanes % BLOCK_C
    return stream, stream * hidden + col, (stream < hc_count) & (col < hidden)


@triton.jit(do_not_specialize=["num_tokens"])
def _down_kernel(
    streams_ptr, norm_w_ptr, down_w_ptr, inject_w_ptr, partial_ptr, rstd_ptr,
    num_tokens, hidden, lowrank, hc_count, out_rows, stride_streams, inv_hidden, eps,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    block = tl.program_id(0)
    stream = tl.program_id(1)
    tokens = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens_ok = tokens < num_tokens
    depth = tl.arange(0, BLOCK_K)
    row_ptrs = streams_ptr + tokens[:, None] * stride_streams + stream * hidden
    dtype = streams_ptr.dtype.element_ty

    squares = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for start in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        k = start + depth
        mask = tokens_ok[:, None] & (k[None, :] < hidden)
        x = tl.cast(tl.load(row_ptrs + k[None, :], mask=mask, other=0.0), tl.float32)
        squares += x * x
    # As torch's mean on CUDA: the fp32 sum times the fp32 reciprocal of H.
    rstd = tl.rsqrt(tl.sum(squares, axis=1) * inv_hidden + eps)
    if block == 0:
        tl.store(rstd_ptr + tokens * hc_count + stream, rstd, mask=tokens_ok)

    # Row blocks of W_down first, then those of W_inject (none for the final mixer): one output space of
    # out_rows = R (+ n) columns in the partials.
    down_blocks = tl.cdiv(lowrank, BLOCK_N)
    if block < down_blocks:
        w_ptr = down_w_ptr
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ok = rows < lowrank
        cols = rows
    else:
        w_ptr = inject_w_ptr
        rows = (block - down_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ok = rows < hc_count
        cols = lowrank + rows
    width = hidden * hc_count
    acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        k = start + depth
        k_ok = k < hidden
        x = tl.load(row_ptrs + k[None, :], mask=tokens_ok[:, None] & k_ok[None, :], other=0.0)
        w_norm = tl.cast(tl.load(norm_w_ptr + stream * hidden + k, mask=k_ok, other=0.0), tl.float32)
        normed = _normed(tl.cast(x, tl.float32), rstd[:, None], w_norm[None, :], dtype)
        w = tl.load(
            w_ptr + rows[:, None] * width + stream * hidden + k[None, :],
            mask=rows_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += normed[:, None, :] * tl.cast(w, tl.float32)[None, :, :]
    partial = tl.sum(acc, axis=2)
    offsets = (stream * num_tokens + tokens[:, None]) * out_rows + cols[None, :]
    tl.store(partial_ptr + offsets, partial, mask=tokens_ok[:, None] & rows_ok[None, :])


@triton.jit
def _summed_partials(
    partial_ptr, tokens, cols, mask, num_tokens, hc_count, out_rows, UNROLLED: tl.constexpr
):  # fmt: skip
    """The n streams' partial sums of output columns `cols` [1, C] for `tokens` [BLOCK_T, 1], added in
    stream order in fp32: the GEMV's result before its rounding. UNROLLED (a power of two >= n, or 0 for
    a loop over n): the n loads as straight-line code, where a loop pipelined around this call issues
    them ahead with its own (Triton does not pipeline a loop holding another loop); the streams past n
    add masked zeros, the same sums."""
    total = tl.zeros(mask.shape, dtype=tl.float32)
    if UNROLLED:
        for stream in tl.static_range(UNROLLED):
            offsets = (stream * num_tokens + tokens) * out_rows + cols
            total += tl.load(partial_ptr + offsets, mask=mask & (stream < hc_count), other=0.0)
    else:
        for stream in range(0, hc_count):
            offsets = (stream * num_tokens + tokens) * out_rows + cols
            total += tl.load(partial_ptr + offsets, mask=mask, other=0.0)
    return total


@triton.jit(do_not_specialize=["num_tokens"])
def _up_mix_kernel(
    streams_ptr, norm_w_ptr, up_w_ptr, partial_ptr, rstd_ptr, mixed_ptr, inject_ptr,
    num_tokens, hidden, lowrank, hc_count, out_rows, stride_streams, inv_count,
    HAS_INJECT: tl.constexpr, HC_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    dtype = mixed_ptr.dtype.element_ty
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens_ok = tokens < num_tokens
    stream, up_rows, lanes_ok = stream_lanes(hidden, hc_count, HC_BLOCK, BLOCK_C)
    depth = tl.arange(0, BLOCK_R)

    # The normed streams that the gate multiplies come first: their loads do not depend on the loop, so
    # they are in flight while it runs rather than after it (on the H200 within the noise of a mix's time).
    mask = tokens_ok[:, None] & lanes_ok[None, :]
    x = tl.cast(
        tl.load(streams_ptr + tokens[:, None] * stride_streams + up_rows[None, :], mask=mask, other=0.0),
        tl.float32,
    )
    rstd = tl.load(rstd_ptr + tokens[:, None] * hc_count + stream[None, :], mask=mask, other=0.0)
    w_norm = tl.cast(tl.load(norm_w_ptr + up_rows, mask=lanes_ok, other=0.0), tl.float32)
    normed = _normed(x, rstd, w_norm[None, :], dtype)

    acc = tl.zeros((BLOCK_T, HC_BLOCK * BLOCK_C, BLOCK_R), dtype=tl.float32)
    for start in tl.range(0, lowrank, BLOCK_R, num_stages=STAGES):
        r = start + depth
        r_ok = r < lowrank
        down = _summed_partials(
            partial_ptr, tokens[:, None], r[None, :], tokens_ok[:, None] & r_ok[None, :],
            num_tokens, hc_count, out_rows, HC_BLOCK if STAGES > 1 else 0,
        )  # fmt: skip
        scaled = rounded(rounded(down, dtype) * inv_count, dtype)
        act = rounded(tl.math.div_rn(scaled, 1.0 + tl.exp(-scaled)), dtype)  # silu, as torch's
        w = tl.load(
            up_w_ptr + up_rows[:, None] * lowrank + r[None, :],
            mask=lanes_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        acc += act[:, None, :] * tl.cast(w, tl.float32)[None, :, :]
    gate = rounded(sigmoid_rn(rounded(tl.sum(acc, axis=2), dtype)), dtype)
    products = tl.where(mask, rounded(gate * normed, dtype), 0.0)
    mixed = tl.sum(tl.reshape(products, (BLOCK_T, HC_BLOCK, BLOCK_C)), axis=1) * inv_count
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    out_mask = tokens_ok[:, None] & (cols[None, :] < hidden)
    tl.store(mixed_ptr + tokens[:, None] * hidden + cols[None, :], tl.cast(mixed, dtype), mask=out_mask)

    if HAS_INJECT and tl.program_id(0) == 0:  # one program per token block finishes the inject weights
        j = tl.arange(0, HC_BLOCK)
        inject_mask = tokens_ok[:, None] & (j[None, :] < hc_count)
        logits = _summed_partials(
            partial_ptr,
            tokens[:, None],
            lowrank + j[None, :],
            inject_mask,
            num_tokens,
            hc_count,
            out_rows,
            0,
        )
        scaled = rounded(rounded(logits, dtype) * inv_count, dtype)
        weights = 2.0 * rounded(sigmoid_rn(scaled), dtype)
        tl.store(
            inject_ptr + tokens[:, None] * hc_count + j[None, :],
            tl.cast(weights, dtype),
            mask=inject_mask,
        )


def supports(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    inject: torch.Tensor | None,
    hc_count: int,
) -> bool:
    """Whether the kernels take this mix: streams [T <= MAX_TOKENS, n * H] with unit stride on the width,
    contiguous weights of the streams' dtype (one of DTYPES) and of the mix's shapes."""
    lowrank, width = down.shape
    weights = (down, up) if inject is None else (down, up, inject)
    return (
        width % hc_count == 0
        and streams.dim() == 2
        and streams.shape[0] <= MAX_TOKENS
        and streams.shape[1] == width
        and streams.stride(1) == 1
        and streams.dtype in DTYPES
        and norm_weight.shape == (width,)
        and norm_weight.is_contiguous()
        and up.shape == (width, lowrank)
        and (inject is None or inject.shape == (hc_count, width))
        and all(w.dtype == streams.dtype and w.is_contiguous() for w in weights)
    )


def mix(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    inject: torch.Tensor | None,
    hc_count: int,
    eps: float,
    tiles: MixTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`HyperConnection.mix` for shapes `supports` takes: streams [T, n * H] -> (block input [T, H],
    inject weights [T, n], or None for the final mixer, which has no inject weights). `tiles`: the
    kernels' tiles (default: the device's tuned ones for this shape, ops/hc_tiles.py)."""
    if tiles is None:  # tuned files are per GPU; the interpreter (CPU) runs the defaults
        tiles = DEFAULT_MIX_TILES
        if streams.is_cuda:
            tiles = tuned_mix_tiles(device_name(streams.device.index), mix_shape(down, hc_count))
    num_tokens, width = streams.shape
    hidden, lowrank = width // hc_count, down.shape[0]
    device, dtype = streams.device, streams.dtype
    mixed = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    weights = None if inject is None else torch.empty(num_tokens, hc_count, dtype=dtype, device=device)
    if num_tokens == 0:
        return mixed, weights
    # The down GEMV's columns: R of W_down, then n of W_inject; per stream, fp32.
    out_rows = lowrank + (0 if inject is None else hc_count)
    partial = torch.empty(hc_count, num_tokens, out_rows, dtype=torch.float32, device=device)
    rstd = torch.empty(num_tokens, hc_count, dtype=torch.float32, device=device)
    token_blocks = triton.cdiv(num_tokens, _BLOCK_T)
    block_n = tiles.down_block_n
    row_blocks = triton.cdiv(lowrank, block_n) + (0 if inject is None else triton.cdiv(hc_count, block_n))
    _down_kernel[(row_blocks, hc_count, token_blocks)](
        streams, norm_weight, down, down if inject is None else inject, partial, rstd,
        num_tokens, hidden, lowrank, hc_count, out_rows, streams.stride(0), 1.0 / hidden, eps,
        BLOCK_T=_BLOCK_T, BLOCK_N=block_n, BLOCK_K=tiles.down_block_k, STAGES=tiles.down_stages,
        **launch_options(),
        num_warps=tiles.down_warps,
    )  # fmt: skip
    _up_mix_kernel[(triton.cdiv(hidden, tiles.up_block_c), token_blocks)](
        streams, norm_weight, up, partial, rstd, mixed, mixed if weights is None else weights,
        num_tokens, hidden, lowrank, hc_count, out_rows, streams.stride(0), 1.0 / hc_count,
        HAS_INJECT=inject is not None, HC_BLOCK=triton.next_power_of_2(hc_count),
        BLOCK_T=_BLOCK_T, BLOCK_C=tiles.up_block_c, BLOCK_R=tiles.up_block_r, STAGES=tiles.up_stages,
        **launch_options(),
        num_warps=tiles.up_warps,
    )  # fmt: skip
    return mixed, weights


@triton.jit
def _inject_kernel(
    streams_ptr, block_out_ptr, weights_ptr, out_ptr, hidden, width, hc_count,
    stride_streams, stride_block_out, stride_weights, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    streams = tl.cast(tl.load(streams_ptr + token * stride_streams + cols, mask=mask, other=0.0), tl.float32)
    if SLOTS == 0:
        block_out = tl.load(block_out_ptr + token * stride_block_out + cols % hidden, mask=mask, other=0.0)
    else:
        # block_out_ptr holds a MoE block's fp32 slot rows ([T, SLOTS, H], `SlotPartials`): added in slot
        # order and rounded once to the dtype, the values moe_decode_triton's sum kernel would store.
        block_out = tl.cast(slot_sum(block_out_ptr, token, hidden, cols % hidden, mask, SLOTS, BLOCK), dtype)
    weight = tl.load(
        weights_ptr + token * stride_weights + cols // hidden, mask=mask & (cols // hidden < hc_count)
    )
    # The eager rounding points: the product rounded to the dtype, then the sum.
    scaled = tl.cast(tl.cast(tl.cast(block_out, tl.float32) * tl.cast(weight, tl.float32), dtype), tl.float32)
    tl.store(out_ptr + token * width + cols, tl.cast(streams + scaled, dtype), mask=mask)


def inject_supports(
    streams: torch.Tensor, block_out: torch.Tensor | SlotPartials, weights: torch.Tensor
) -> bool:
    """Whether the inject kernel takes streams [T, n * H], block_out [T, H] (or a MoE block's fp32 slot
    rows summing to that, contiguous), weights [T, n] (one dtype, unit stride on the last dimension)."""
    if isinstance(block_out, SlotPartials):
        values = block_out.values
        block_ok = values.dtype == torch.float32 and values.is_contiguous() and values.shape[1] > 0
    else:
        block_ok = block_out.dim() == 2 and block_out.stride(-1) == 1
    return (
        block_ok
        and streams.dim() == weights.dim() == 2
        and streams.shape[0] == block_out.shape[0] == weights.shape[0]
        and streams.shape[1] == block_out.shape[1] * weights.shape[1]
        and streams.dtype == block_out.dtype == weights.dtype
        and streams.dtype in DTYPES
        and streams.stride(-1) == 1
        and weights.stride(-1) == 1
    )


def inject(
    streams: torch.Tensor, block_out: torch.Tensor | SlotPartials, weights: torch.Tensor
) -> torch.Tensor:
    """`layers.hyper_connection.inject` in one kernel (two eagerly), the same bits: an elementwise
    product and sum, each row its own, for any T. block_out may be a MoE block's `SlotPartials`, added
    up here as `SlotPartials.summed` would (the sum kernel it saves)."""
    tokens, width = streams.shape
    out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
    if tokens:
        if isinstance(block_out, SlotPartials):
            rows, stride, slots = block_out.values, 0, block_out.values.shape[1]  # walked in the kernel
        else:
            rows, stride, slots = block_out, block_out.stride(0), 0
        block = 1024
        _inject_kernel[(tokens, triton.cdiv(width, block))](
            streams, rows, weights, out, block_out.shape[1], width, weights.shape[1],
            streams.stride(0), stride, weights.stride(0), SLOTS=slots, BLOCK=block, **launch_options(),
            enable_fp_fusion=False,  # no multiply-add: torch rounds the product before the sum
        )  # fmt: skip
    return out
