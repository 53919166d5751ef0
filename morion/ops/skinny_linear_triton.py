"""Linear layers at decode sizes (M <= MAX_ROWS rows) as one Triton kernel that streams the weight once.

    out[m, n] = round((sum over k of x[m, k] * w[n, k]) * x_scale[m] * w_scale + bias[n])

with x and w both e4m3 (x quantized per row, w with one fp32 scale: `Fp8Linear`) or both in the model
dtype (no scales: the router, Gated DeltaNet's in_proj_ba). FP8 rows come quantized, once per input, by
the row kernels (`ops.fp8.quantize_fp8`, or a norm or gate fused with the quantization:
`gated_norm_fp8_triton`, `quantize_fp8_sigmoid_gated`), never here. This kernel once quantized
model-dtype rows itself: each of its N / BLOCK_N programs read its rows over all of K for their amax
before its first product, and with the tuned tiles installed the served decode step got slower (80B
4.89 -> 7.96 ms, Flash-Next 10.2 -> 16.8 ms on the H200), where the tuner, timing e4m3 rows, had found
every FP8 shape faster than cuBLAS. The FP8 path through cuBLASLt is two kernels:
`torch._scaled_mm` with per-tensor scales (its per-row recipe is no faster than bf16 at decode sizes:
kernels-and-libraries.md §4), then the row scales multiplied into its bf16 output: 121 of the 80B
preset's ~1,050 kernels per decode step (`results/2026-12-02-h200-profile-80b-full.md`), rounded twice.
Here the scales meet the fp32 sum in the epilogue and the result is rounded once, as the reference
(`ops.fp8.fp8_linear_quantized_reference`) rounds it.

A program owns BLOCK_N output columns and BLOCK_M rows and walks K in BLOCK_K steps; the grid is
(N / BLOCK_N, M / BLOCK_M), so every weight byte is read once per call at M <= BLOCK_M and the tile
shapes come from the device's tuned file for (N, K, dtype) (ops/skinny_tiles.py). Where no file exists
an FP8 linear keeps cuBLAS (a shape runs here only where the device measured it faster), and a
model-dtype product runs here anyway, in the GEMV mode (`skinny_tiles.INVARIANT_GEMV`), for its
batch invariance.

Invariants:
- Batch invariant: a row's result does not depend on M or on the other rows: the tiles are fixed per
  shape (never chosen by M), each row's products meet only its own accumulator (`tl.dot` keeps rows
  apart, as does the GEMV mode), and K is summed in one fixed order: in one program, or with the tile's
  split K (`Tiles.split_k` = S > 1, where the tuner measured it faster) in S fixed slices of whole
  BLOCK_K tiles, one program each, whose fp32 partials [S, M, N] a second kernel adds in slice order
  before the epilogue (ops/moe_split_k.py's helpers, as the fused MoE decode kernels split K). A narrow
  product at one row otherwise runs N / BLOCK_N programs, a fraction of the GPU's SMs, each waiting on
  its loads over all of K. Measured on an H100 (`results/2026-12-05-h100-skinny-tune-split-2a32541/`):
  split 4 took the 80B's 2048x4096 from 8.3 to 7.4 us a call and its narrow products by 0.5-0.6 us, far
  from their byte floors (2.5 us for 2048x4096); the 12-layer 80B's decode with those four files ran no
  faster than with cuBLAS and the untuned GEMV in their place (C1 521 against 523 tok/s): in a decode
  step the sum kernel's launch costs about what the split saves in the tuner's back-to-back calls.
- Capturable: no host sync; M is not specialized on (`do_not_specialize`), so every CUDA-graph bucket
  runs the one compiled variant.
- PDL (ops/pdl.py): each program waits for the kernel before it first of all, but for `--pdl prefetch`'s
  L2 prefetch of its own weight columns (at most `pdl.PREFETCH_MAX_BYTES` a call), which no kernel writes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from morion.ops.moe_decode_triton import _mma, _mma_options, _rows_first, _zero_acc
from morion.ops.moe_split_k import (
    SPLIT_SUM_BLOCK,
    k_slice,
    split_partials,
    split_sum_program,
    store_partial,
    sum_slices,
)
from morion.ops.moe_tiles import Tiles
from morion.ops.pdl import launch_options, prefetch_columns_to_l2, prefetch_line, wait_for_previous_kernel

# Decode and short-chunk forwards (the same bound as the fused MoE kernels' AUTO_TRITON_MAX_TOKENS):
# up to here a token's projections are the same bits in every batch; larger forwards take cuBLAS.
MAX_ROWS = 64


@triton.jit
def _skinny_sums(
    pid_n, pid_m, x_ptr, w_ptr, M, N, K, k_begin, k_end, stride_x, stride_w,
    DOT_PRECISION: tl.constexpr, MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fp32 sums [BLOCK_M, BLOCK_N] of rows pid_m * BLOCK_M.. and output columns pid_n * BLOCK_N.. over
    K columns k_begin .. k_end - 1 (whole BLOCK_K tiles but for K's last), in K order; with those rows
    and columns."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < M
    cols_ok = cols < N
    depth = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tl.cast(rows, tl.int64)[:, None] * stride_x
    w_cols = w_ptr + tl.cast(cols, tl.int64)[None, :] * stride_w
    acc = _zero_acc(BLOCK_M, BLOCK_N, MMA)
    for start in range(k_begin, k_end, BLOCK_K):
        k = start + depth
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
        acc = _mma(a, w, acc, MMA, DOT_PRECISION)
    return _rows_first(acc, MMA), rows, cols


@triton.jit
def _skinny_epilogue(
    acc, rows, cols, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_out,
    SCALED: tl.constexpr, COLUMN_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The sums of all K [rows, cols] (fp32) times the row and weight scales, plus the bias, rounded once
    into out."""
    rows_ok = rows < M
    cols_ok = cols < N
    if SCALED:
        x_scale = tl.load(x_scale_ptr + rows, mask=rows_ok, other=0.0)
        if COLUMN_SCALES:  # merged layers (layers/merged_linears.py): each column its own layer's scale
            w_scale = tl.load(w_scale_ptr + cols, mask=cols_ok, other=0.0)
            acc = acc * x_scale[:, None] * w_scale[None, :]
        else:
            acc = acc * x_scale[:, None] * tl.load(w_scale_ptr)
    if HAS_BIAS:
        acc = acc + tl.cast(tl.load(bias_ptr + cols, mask=cols_ok, other=0.0), tl.float32)[None, :]
    out = out_ptr + tl.cast(rows, tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, tl.cast(acc, out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _skinny_tile(
    pid_n, pid_m, x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w,
    stride_out,
    SCALED: tl.constexpr, COLUMN_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Output columns pid_n * BLOCK_N.. of rows pid_m * BLOCK_M..: one program's work after its wait, in
    a launch without split K or for either product of a paired one."""
    acc, rows, cols = _skinny_sums(
        pid_n, pid_m, x_ptr, w_ptr, M, N, K, 0, K, stride_x, stride_w, DOT_PRECISION, MMA, BLOCK_M, BLOCK_N,
        BLOCK_K,
    )  # fmt: skip
    _skinny_epilogue(
        acc, rows, cols, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_out, SCALED, COLUMN_SCALES,
        HAS_BIAS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K, stride_x, stride_w,
    stride_out,
    SCALED: tl.constexpr, COLUMN_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_LINE: tl.constexpr, PREFETCH_STEP: tl.constexpr,
):  # fmt: skip
    """Grid (column blocks, row blocks, SPLIT_K). SPLIT_K = 1: the product, scaled and rounded. Else slice
    program_id(2) of K (`k_slice`): its unscaled fp32 sums into partial [SPLIT_K, M, N], for
    `_skinny_split_sum_kernel` to add up in slice order and finish."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin, k_end = k_slice(K, SPLIT_K, BLOCK_K)
    prefetch_columns_to_l2(
        w_ptr + k_begin, cols, cols < N, k_end - k_begin, stride_w, PREFETCH_LINE, PREFETCH_STEP
    )
    wait_for_previous_kernel(USE_PDL)
    acc, rows, cols = _skinny_sums(
        tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, M, N, K, k_begin, k_end, stride_x, stride_w,
        DOT_PRECISION, MMA, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if SPLIT_K == 1:
        _skinny_epilogue(
            acc, rows, cols, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_out, SCALED,
            COLUMN_SCALES, HAS_BIAS,
        )  # fmt: skip
    else:
        store_partial(partial_ptr, acc, rows, rows < M, cols, cols < N, M, N, 0)


@triton.jit(do_not_specialize=["M"])
def _skinny_split_sum_kernel(
    partial_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_out,
    SCALED: tl.constexpr, COLUMN_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (M, column blocks of BLOCK_N): a row's SPLIT_K partial sums added in slice order, then the
    epilogue of the launch without split K: the same bits in every batch and every run."""
    wait_for_previous_kernel(USE_PDL)
    rows, _, cols, cols_ok = split_sum_program(M, N, BLOCK_N)
    acc = sum_slices(partial_ptr, rows, cols, cols_ok, M, N, SPLIT_K, BLOCK_N)
    _skinny_epilogue(
        acc, rows, cols, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_out, SCALED, COLUMN_SCALES,
        HAS_BIAS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _skinny_pair_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, N, K, stride_x, stride_w, stride_out,
    x2_ptr, x2_scale_ptr, w2_ptr, w2_scale_ptr, bias2_ptr, out2_ptr, N2, stride_x2, stride_w2, stride_out2,
    M,
    SCALED: tl.constexpr, COLUMN_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH_LINE: tl.constexpr, PREFETCH_STEP: tl.constexpr,
    SCALED2: tl.constexpr, COLUMN_SCALES2: tl.constexpr, HAS_BIAS2: tl.constexpr,
    DOT_PRECISION2: tl.constexpr, MMA2: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    BLOCK_K2: tl.constexpr, PREFETCH_LINE2: tl.constexpr, PREFETCH_STEP2: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Two products of one input in one launch (`skinny_linear_pair`), a one-dimensional grid: the first
    product's (column block, row block) programs, then the second's, each running `_skinny_tile` as its
    own launch's program would (no idle programs, whichever product has more row blocks)."""
    pid = tl.program_id(0)
    columns = tl.cdiv(N, BLOCK_N)
    first = pid < columns * tl.cdiv(M, BLOCK_M)
    second = pid - columns * tl.cdiv(M, BLOCK_M)
    columns2 = tl.cdiv(N2, BLOCK_N2)
    if first:
        cols = (pid % columns) * BLOCK_N + tl.arange(0, BLOCK_N)
        prefetch_columns_to_l2(w_ptr, cols, cols < N, K, stride_w, PREFETCH_LINE, PREFETCH_STEP)
    else:
        cols2 = (second % columns2) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        prefetch_columns_to_l2(w2_ptr, cols2, cols2 < N2, K, stride_w2, PREFETCH_LINE2, PREFETCH_STEP2)
    wait_for_previous_kernel(USE_PDL)
    if first:
        _skinny_tile(
            pid % columns, pid // columns, x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
            stride_x, stride_w, stride_out, SCALED, COLUMN_SCALES, HAS_BIAS, DOT_PRECISION, MMA, BLOCK_M,
            BLOCK_N, BLOCK_K,
        )  # fmt: skip
    else:
        _skinny_tile(
            second % columns2, second // columns2, x2_ptr, x2_scale_ptr, w2_ptr, w2_scale_ptr, bias2_ptr,
            out2_ptr, M, N2, K, stride_x2, stride_w2, stride_out2, SCALED2, COLUMN_SCALES2, HAS_BIAS2,
            DOT_PRECISION2, MMA2, BLOCK_M2, BLOCK_N2, BLOCK_K2,
        )  # fmt: skip


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x [M, K] @ weight [N, K].T: at most MAX_ROWS rows, unit strides on K, and
    one element type (e4m3 rows with e4m3 weights, or one float dtype: FP8 rows come quantized)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[1]
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


class SkinnyProduct(NamedTuple):
    """One product's operands, as `skinny_linear` takes them."""

    x: torch.Tensor
    weight: torch.Tensor
    tiles: Tiles
    x_scale: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: Tiles,
    *,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in `out_dtype` (default x's dtype), `supports(x, weight)`.
    With e4m3 weights the rows are e4m3 too, quantized per row before the call (`ops.fp8.quantize_fp8(x,
    per_row=True)`: once per input, not in each of this kernel's programs, see above), with `x_scale` [M]
    (fp32), `weight_scale` (one fp32 element, or [N]: one per output column, for layers merged into one
    weight by layers/merged_linears.py) and `out_dtype` the model dtype. `bias` [N] is added in fp32
    before the one rounding."""
    product = SkinnyProduct(x, weight, tiles, x_scale, weight_scale, bias, out_dtype)
    out = _output(product)
    if x.shape[0] == 0:
        return out
    tensors, strides, constants, blocks = _operands(product, out)
    rows, depth = x.shape
    outputs, split = weight.shape[0], tiles.split_k
    partial = split_partials(split, rows, outputs, out)
    _skinny_linear_kernel[(*blocks, split)](
        *tensors, partial, rows, outputs, depth, *strides, **constants, SPLIT_K=split, **launch_options(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if split > 1:
        x_scale, _, weight_scale, bias, _ = tensors[1:]
        _skinny_split_sum_kernel[(rows, triton.cdiv(outputs, SPLIT_SUM_BLOCK))](
            partial, x_scale, weight_scale, bias, out, rows, outputs, out.stride(0),
            SCALED=constants["SCALED"], COLUMN_SCALES=constants["COLUMN_SCALES"],
            HAS_BIAS=constants["HAS_BIAS"], SPLIT_K=split, BLOCK_N=SPLIT_SUM_BLOCK, **launch_options(),
            num_warps=2,
        )  # fmt: skip
    return out


def pairable(first: Tiles, second: Tiles) -> bool:
    """Whether two products can share a launch with each output the bits of its own: one warp count (a
    GEMV tile's sums over K are laid out by it) and neither with split K (its slices and their sum kernel
    are a launch of their own). The pipeline depth is the launch's too, but it only decides how far ahead
    loads are issued, not the order of any sum: the first product's is taken."""
    return first.num_warps == second.num_warps and first.split_k == second.split_k == 1


def skinny_linear_pair(first: SkinnyProduct, second: SkinnyProduct) -> tuple[torch.Tensor, torch.Tensor]:
    """Both products in one launch, each as `skinny_linear` computes it alone (its own tile, the same
    bits): two linear layers of one input, e.g. an FP8 projection and a model-dtype one, without a second
    kernel on the decode step's critical path. The rows (M) and depth (K) are the same; `pairable` tiles."""
    if first.x.shape[0] != second.x.shape[0] or first.x.shape[1] != second.x.shape[1]:
        raise ValueError(
            f"paired products take rows of one shape, got {tuple(first.x.shape)} and {tuple(second.x.shape)}"
        )
    if not pairable(first.tiles, second.tiles):
        raise ValueError(
            f"paired tiles need one warp count, got {tuple(first.tiles)} and {tuple(second.tiles)}"
        )
    out, out2 = _output(first), _output(second)
    rows, depth = first.x.shape
    if rows == 0:
        return out, out2
    tensors, strides, constants, blocks = _operands(first, out)
    tensors2, strides2, constants2, blocks2 = _operands(second, out2)
    _skinny_pair_kernel[(blocks[0] * blocks[1] + blocks2[0] * blocks2[1],)](
        *tensors, first.weight.shape[0], depth, *strides, *tensors2, second.weight.shape[0], *strides2, rows,
        **constants, **{f"{name}2": value for name, value in constants2.items()},
        **launch_options(), num_warps=first.tiles.num_warps, num_stages=first.tiles.num_stages,
    )  # fmt: skip
    return out, out2


def _output(product: SkinnyProduct) -> torch.Tensor:
    """The product's [M, N] output, after checking its operands (`skinny_linear`'s contract)."""
    x, weight, x_scale, weight_scale = product.x, product.weight, product.x_scale, product.weight_scale
    fp8 = weight.element_size() == 1
    if fp8 and (x.dtype != weight.dtype or x_scale is None or weight_scale is None):
        raise ValueError(
            f"e4m3 weights need e4m3 rows with their x_scale (quantized before the call) and weight_scale; "
            f"got {x.dtype} rows, x_scale {'given' if x_scale is not None else 'missing'}"
        )
    if x.element_size() == 1 and product.out_dtype is None:
        raise ValueError("e4m3 rows need an out_dtype (the model dtype)")
    outputs = weight.shape[0]
    if fp8 and weight_scale.numel() > 1 and weight_scale.shape != (outputs,):
        raise ValueError(
            f"weight_scale: one element or one per output column ({outputs}), got {tuple(weight_scale.shape)}"
        )
    return torch.empty(x.shape[0], outputs, dtype=product.out_dtype or x.dtype, device=x.device)


def _operands(
    product: SkinnyProduct, out: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[int, int, int], dict[str, Any], tuple[int, int]]:
    """A product's kernel arguments: its tensors (unused ones stand in as x), strides, constexprs, and
    its grid (column blocks, row blocks)."""
    x, weight, tiles = product.x, product.weight, product.tiles
    fp8 = weight.element_size() == 1
    options = _mma_options(tiles, fp8)
    line = prefetch_line(weight)
    tensors = (
        x, product.x_scale if product.x_scale is not None else x, weight,
        product.weight_scale if fp8 else weight, product.bias if product.bias is not None else x, out,
    )  # fmt: skip
    constants = dict(
        SCALED=fp8,
        COLUMN_SCALES=fp8 and product.weight_scale.numel() > 1,
        HAS_BIAS=product.bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 and not fp8 else "tf32",
        **options,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        PREFETCH_LINE=line,
        PREFETCH_STEP=max(tiles.block_k, line),
    )
    blocks = (triton.cdiv(weight.shape[0], tiles.block_n), triton.cdiv(x.shape[0], options["BLOCK_M"]))
    return tensors, (x.stride(0), weight.stride(0), out.stride(0)), constants, blocks
