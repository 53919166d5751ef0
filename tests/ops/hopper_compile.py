"""Compiles Triton kernels for Hopper (sm_90) without a GPU: Triton's front end, its passes and the
ptxas that its wheel ships, exactly as on the H200. Run as a script in a process of its own, since the
test process runs every kernel in Triton's interpreter (TRITON_INTERPRET=1), whose kernels do not
compile. Prints one line per kernel that fails and a count; exits 1 if any failed.

    python tests/ops/hopper_compile.py [LAUNCHES.json]

Always the kernels of `KERNELS` with the H200's types (bf16 and e4m3, which the interpreter has not) and
the real shapes' constexprs; with LAUNCHES.json (tests/ops/launch_recorder.py) also every distinct launch
the CPU tests made, with their types, constexprs and launch options. With --pdl, each kernel is compiled
once more with programmatic dependent launch on (USE_PDL, and the skinny linear's L2 prefetch) and its PTX
must wait for the kernel before it (griddepcontrol.wait) before any global memory access (ops/pdl.py).

    python tests/ops/hopper_compile.py [LAUNCHES.json] [--pdl]
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from morion.ops import (
    add_rms_norm_triton,
    hyper_connection_triton,
    moe_decode_triton,
    moe_grouped_triton,
    moe_split_k,
    qsa_prefill_triton,
    qsa_triton,
    router_triton,
    skinny_linear_triton,
    store_kv_triton,
)
from morion.ops.moe_decode_triton import _MMA_MODES
from morion.ops.skinny_tiles import INVARIANT_GEMV

HOPPER = GPUTarget("cuda", 90, 32)


def _skinny(
    mma: str,
    element: str,
    block_n: int = 64,
    block_k: int = 128,
    column_scales: bool = False,
    split_k: int = 1,
    paired: bool = False,
) -> tuple:
    """The skinny kernel for rows and weights of this Triton type ("fp8e4nv" or "bf16"): one type for
    both, FP8 rows coming quantized; `column_scales`: a weight scale per column (merged FP8 layers);
    `split_k`: K over that many programs; `paired`: the constexprs of a product of the paired launch."""
    fp8 = element == "fp8e4nv"
    signature = {
        "x_ptr": f"*{element}",
        "x_scale_ptr": "*fp32",
        "w_ptr": f"*{element}",
        "w_scale_ptr": "*fp32",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_x": "i32",
        "stride_w": "i32",
        "stride_out": "i32",
    }
    constexprs = {
        "SCALED": fp8,
        "COLUMN_SCALES": column_scales,
        "HAS_BIAS": True,
        "DOT_PRECISION": "tf32",
        "MMA": _MMA_MODES[mma],
        "BLOCK_M": 1 if mma == "gemv" else 16,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "PREFETCH_LINE": 0,
        "PREFETCH_STEP": block_k,
    }
    if not paired:
        constexprs["SPLIT_K"] = split_k
    return skinny_linear_triton._skinny_linear_kernel, signature, constexprs


def _skinny_split_sum(column_scales: bool) -> tuple:
    """The skinny kernel's split-K sum (a row's fp32 partials in slice order, then the epilogue) for an
    FP8 product's scales, one per column with `column_scales`."""
    signature = {
        "partial_ptr": "*fp32",
        "x_scale_ptr": "*fp32",
        "w_scale_ptr": "*fp32",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "stride_out": "i32",
    }
    constexprs = {
        "SCALED": True,
        "COLUMN_SCALES": column_scales,
        "HAS_BIAS": True,
        "SPLIT_K": 4,
        "BLOCK_N": moe_split_k.SPLIT_SUM_BLOCK,
    }
    return skinny_linear_triton._skinny_split_sum_kernel, signature, constexprs


def _skinny_pair() -> tuple:
    """The paired launch of an FP8 product (a tl.dot tile, a scale per column) and a bf16 one (a GEMV
    tile): Gated DeltaNet's in_proj_qkvz and in_proj_ba on the 80B preset."""
    _, _, first = _skinny("dot", "fp8e4nv", 32, 256, column_scales=True, paired=True)
    _, _, second = _skinny("gemv", "bf16", 8, 512, paired=True)
    pointers = ("x", "x_scale", "w", "w_scale", "bias", "out")
    fp8 = ("*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*bf16")
    bf16 = ("*bf16", "*fp32", "*bf16", "*bf16", "*bf16", "*bf16")
    strides = ("stride_x", "stride_w", "stride_out")
    signature = {
        **{f"{name}_ptr": kind for name, kind in zip(pointers, fp8, strict=True)},
        "N": "i32",
        "K": "i32",
        **dict.fromkeys(strides, "i32"),
        **{f"{name.replace('x_', 'x2_').replace('w_', 'w2_') if '_' in name else name + '2'}_ptr": kind
           for name, kind in zip(pointers, bf16, strict=True)},
        "N2": "i32",
        **{f"{stride}2": "i32" for stride in strides},
        "M": "i32",
    }  # fmt: skip
    constexprs = {**first, **{f"{name}2": value for name, value in second.items()}}
    return skinny_linear_triton._skinny_pair_kernel, signature, constexprs


SELECTED_STRIDES = (
    "stride_q_tok",
    "stride_q_head",
    "stride_kv_tok",
    "stride_kv_kv",
    "stride_kv_head",
    "stride_o_tok",
    "stride_o_head",
    "stride_bits",
)
KERNELS = {
    # Two linear layers of one input in one launch (layers/paired_products.py).
    "skinny_linear_triton._skinny_pair_kernel[dot fp8e4nv, gemv bf16]": _skinny_pair(),
    "qsa_triton._select_token_slots_kernel": (
        qsa_triton._select_token_slots_kernel,
        {
            "scores_ptr": "*fp32",
            "num_complete_ptr": "*i64",
            "positions_ptr": "*i64",
            "page_table_ptr": "*i32",
            "slots_ptr": "*i32",
            "counts_ptr": "*i32",
            "stride_scores": "i32",
            "stride_page_table": "i32",
            "stride_slots": "i32",
            "rows_per_seq": "i32",
            "num_blocks": "i32",
        },
        {"TOP_K": 512, "RATIO": 4, "PAGE_SIZE": 16, "WIDTH": 2051, "BLOCK": 512},
    ),
    "qsa_triton._select_block_bits_kernel": (
        qsa_triton._select_block_bits_kernel,
        {
            "scores_ptr": "*fp32",
            "num_complete_ptr": "*i64",
            "bits_ptr": "*i32",
            "stride_scores": "i32",
            "stride_bits": "i32",
            "num_blocks": "i32",
        },
        {"TOP_K": 512, "BLOCK": 512},
    ),
    # Flash-Next's shapes: 24 query heads on 2 K/V heads of 256 (GROUP 12: 10 tokens in 128 rows), FP8 K/V.
    "qsa_prefill_triton._selected_kernel": (
        qsa_prefill_triton._selected_kernel,
        {
            "q_ptr": "*bf16",
            "kv_ptr": "*fp8e4nv",
            "out_ptr": "*bf16",
            "page_row_ptr": "*i32",
            "positions_ptr": "*i64",
            "bits_ptr": "*i32",
            "rows": "i32",
            **dict.fromkeys(SELECTED_STRIDES, "i32"),
            "qk_scale": "fp32",
            "v_scale": "fp32",
        },
        {
            "GROUP": 12,
            "BLOCK_Q": 10,
            "BLOCK_M": 128,
            "RATIO": 4,
            "BLOCK_D": 256,
            "HEAD_DIM": 256,
            "PAGE_SIZE": 16,
            "DOT_PRECISION": "tf32",
        },
    ),
    **{
        f"skinny_linear_triton._skinny_linear_kernel[{mma}, {element}]": _skinny(mma, element)
        for mma in ("dot", "gemv")
        for element in ("fp8e4nv", "bf16")
    },
    # FP8 layers of one input merged into one weight (layers/merged_linears.py): a scale per column.
    "skinny_linear_triton._skinny_linear_kernel[dot, fp8e4nv, column scales]": _skinny(
        "dot", "fp8e4nv", column_scales=True
    ),
    # K split over programs (a tuned tile's `split_k`), and the kernel that adds the slices up.
    "skinny_linear_triton._skinny_linear_kernel[gemv, bf16, split K 4]": _skinny("gemv", "bf16", split_k=4),
    "skinny_linear_triton._skinny_split_sum_kernel[fp8 column scales]": _skinny_split_sum(True),
    # The untuned model-dtype products' tile (router, gates, QSA indexer on every CUDA decode step).
    "skinny_linear_triton._skinny_linear_kernel[INVARIANT_GEMV, bf16]": _skinny(
        INVARIANT_GEMV.mma, "bf16", INVARIANT_GEMV.block_n, INVARIANT_GEMV.block_k
    ),
    **{
        f"store_kv_triton._store_kv_kernel[{pool} pool]": (
            store_kv_triton._store_kv_kernel,
            {
                "k_ptr": "*bf16",
                "v_ptr": "*bf16",
                "slots_ptr": "*i64",
                "kv_ptr": f"*{pool}",
                "width": "i32",
                "stride_k": "i32",
                "stride_v": "i32",
                "stride_slot": "i32",
                "stride_kv": "i32",
                "inv_k": "fp32",
                "inv_v": "fp32",
            },
            {"FP8": pool == "fp8e4nv", "FP8_MAX": 448.0, "BLOCK": 1024},
        )
        for pool in ("fp8e4nv", "bf16")
    },
    **{
        f"moe_decode_triton._gate_up_kernel[{mma}, fp8, split_k {split_k}{', grouped' if grouped else ''}]": (
            moe_decode_triton._gate_up_kernel,
            {
                "x_ptr": "*fp8e4nv",
                "x_scale_ptr": "*fp32",
                "w_ptr": "*fp8e4nv",
                "w_scale_ptr": "*fp32",
                "ids_ptr": "*i64",
                "tiles_ptr": "*i64",
                "order_ptr": "*i64",
                "act_ptr": "*fp32",
                "amax_ptr": "*fp32",
                "partial_ptr": "*fp32",
                "num_pairs": "i32",
                "top_k": "i32",
                "hidden_size": "i32",
                "inter_size": "i32",
                "stride_x": "i32",
                "stride_we": "i32",
                "stride_wn": "i32",
                "stride_se": "i32",
            },
            {
                "GROUPED": grouped,
                "FP8": True,
                "DOT_PRECISION": "tf32",
                "BLOCK_P": 1 if grouped else 16,
                "BLOCK_M": 64 if grouped else 1 if mma == "gemv" else 16,
                "BLOCK_N": 64 if grouped else 32,
                "BLOCK_K": 128 if grouped else 256,
                "MMA": _MMA_MODES[mma],
                "SPLIT_K": split_k,
                # The grouped mode's 64-row tiles are Hopper wgmma: FP8 sums promoted every 128 products.
                "PROMOTE_K": 128 if grouped else -1,
            },
        )
        for mma, split_k, grouped in (
            ("dot", 1, False),
            ("gemv", 1, False),
            ("dot", 4, False),
            ("dot", 1, True),
        )
    },
    "qsa_triton._store_block_keys_kernel": (
        qsa_triton._store_block_keys_kernel,
        {
            "raw_ptr": "*bf16",
            "key_rows_ptr": "*bf16",
            "slots_ptr": "*i64",
            "positions_ptr": "*i64",
            "cos_ptr": "*fp32",
            "sin_ptr": "*fp32",
            "w_ptr": "*bf16",
            "scratch_ptr": "*bf16",
            "stride_key_rows": "i32",
            "stride_cos": "i32",
            "stride_sin": "i32",
            "dim": "i32",
            "rotary_dim": "i32",
            "eps": "fp32",
        },
        {"RATIO": 4, "BLOCK_D": 128},
    ),
    # The 80B's residual add + norm with its FP8 rows (bf16 in, e4m3 codes out: the interpreter has neither).
    "add_rms_norm_triton._add_rms_norm_kernel[bf16, quantize]": (
        add_rms_norm_triton._add_rms_norm_kernel,
        {
            "x_ptr": "*bf16",
            "residual_ptr": "*bf16",
            "w_ptr": "*bf16",
            "out_ptr": "*bf16",
            "new_residual_ptr": "*bf16",
            "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "K": "i32",
            "stride_x": "i32",
            "stride_residual": "i32",
            "eps": "fp32",
        },
        {
            "MODE": 1,
            "QUANTIZE": True,
            "FP8_MAX": 448.0,
            "MIN_SCALE": 1e-12,
            "SLOTS": 0,
            "BLOCK": 2048,
            "VECTOR": 8,
        },
    ),
    "router_triton._route_kernel": (
        router_triton._route_kernel,
        {
            "logits_ptr": "*bf16",
            "shared_ptr": "*bf16",
            "weights_ptr": "*bf16",
            "ids_ptr": "*i64",
            "num_experts": "i32",
            "stride_logits": "i32",
            "stride_shared": "i32",
            "apart_start": "i32",
        },
        {
            "TOP_K": 10,
            "NORMALIZE": True,
            "SHARED": True,
            "WIDTH": 11,
            "APART": False,
            "BLOCK_E": 512,
            "BLOCK_K": 16,
        },
    ),
    "hyper_connection_triton._inject_kernel": (
        hyper_connection_triton._inject_kernel,
        {
            "streams_ptr": "*bf16",
            "block_out_ptr": "*bf16",
            "weights_ptr": "*bf16",
            "out_ptr": "*bf16",
            "hidden": "i32",
            "width": "i32",
            "hc_count": "i32",
            "stride_streams": "i32",
            "stride_block_out": "i32",
            "stride_weights": "i32",
        },
        {"SLOTS": 0, "BLOCK": 1024},
    ),
    "hyper_connection_triton._down_kernel": (
        hyper_connection_triton._down_kernel,
        {
            "streams_ptr": "*bf16",
            "norm_w_ptr": "*bf16",
            "down_w_ptr": "*bf16",
            "inject_w_ptr": "*bf16",
            "partial_ptr": "*fp32",
            "rstd_ptr": "*fp32",
            "num_tokens": "i32",
            "hidden": "i32",
            "lowrank": "i32",
            "hc_count": "i32",
            "out_rows": "i32",
            "stride_streams": "i32",
            "inv_hidden": "fp32",
            "eps": "fp32",
        },
        {"BLOCK_T": 4, "BLOCK_N": 4, "BLOCK_K": 512, "STAGES": 1},
    ),
    "hyper_connection_triton._up_mix_kernel": (
        hyper_connection_triton._up_mix_kernel,
        {
            "streams_ptr": "*bf16",
            "norm_w_ptr": "*bf16",
            "up_w_ptr": "*bf16",
            "partial_ptr": "*fp32",
            "rstd_ptr": "*fp32",
            "mixed_ptr": "*bf16",
            "inject_ptr": "*bf16",
            "num_tokens": "i32",
            "hidden": "i32",
            "lowrank": "i32",
            "hc_count": "i32",
            "out_rows": "i32",
            "stride_streams": "i32",
            "inv_count": "fp32",
        },
        {"HAS_INJECT": True, "HC_BLOCK": 4, "BLOCK_T": 4, "BLOCK_C": 16, "BLOCK_R": 32, "STAGES": 1},
    ),
    # The grouped MoE path's elementwise kernels at the 80B's shapes (I = 512, H = 2048, top-10).
    "moe_grouped_triton._swiglu_quantize_kernel": (
        moe_grouped_triton._swiglu_quantize_kernel,
        {
            "gate_up_ptr": "*bf16",
            "weights_ptr": "*bf16",
            "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "inter_size": "i32",
            "stride_row": "i32",
        },
        {"FP8_MAX": 448.0, "MIN_SCALE": 1e-12, "BLOCK": 512},
    ),
    "moe_grouped_triton._combine_pairs_kernel": (
        moe_grouped_triton._combine_pairs_kernel,
        {
            "values_ptr": "*bf16",
            "position_ptr": "*i64",
            "out_ptr": "*bf16",
            "hidden_size": "i32",
            "stride_values": "i32",
            "stride_out": "i32",
        },
        {"TOP_K": 10, "BLOCK": 512},
    ),
}


def _variant(name: str, types: dict[str, str], constexprs: dict[str, object]) -> tuple:
    """The `KERNELS` entry `name` with some argument types and constexprs replaced."""
    kernel, signature, fixed = KERNELS[name]
    return kernel, {**signature, **types}, {**fixed, **constexprs}


# The kernels that take a MoE block's fp32 slot rows (`SlotPartials`: top-10 and the shared expert).
KERNELS["add_rms_norm_triton._add_rms_norm_kernel[fp32 partials, quantize]"] = _variant(
    "add_rms_norm_triton._add_rms_norm_kernel[bf16, quantize]", {"x_ptr": "*fp32"}, {"SLOTS": 11}
)
KERNELS["hyper_connection_triton._inject_kernel[fp32 partials]"] = _variant(
    "hyper_connection_triton._inject_kernel", {"block_out_ptr": "*fp32"}, {"SLOTS": 11}
)


def compile_for_hopper(
    kernel: triton.runtime.jit.JITFunction,
    signature: dict,
    constexprs: dict,
    options: dict | None = None,
    aligned: tuple[str, ...] = (),
) -> triton.compiler.CompiledKernel:
    """The kernel compiled for sm_90; `aligned` names the arguments a launch specializes as divisible by
    16 (aligned pointers, sizes and strides: the real model's), which decides the vector layouts."""
    if "USE_PDL" in kernel.arg_names:
        constexprs = {"USE_PDL": False, **constexprs}  # the launches as main runs them: PDL off
    full = {**signature, **{name: "constexpr" for name in constexprs}}
    missing = set(kernel.arg_names) - set(full)
    if missing:
        raise ValueError(f"no type for {sorted(missing)}")
    values = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(
        ASTSource(fn=kernel, signature=full, constexprs=values, attrs=attrs), target=HOPPER, options=options
    )


def first_reduction_layout(name: str, aligned: tuple[str, ...], **constexprs: object) -> str:
    """The layout of the first `tt.reduce`'s operand in the sm_90 TTGIR of `KERNELS[name]` (constexprs
    overridden): a reduction's order follows its layout (values a thread, threads a warp), so two kernels
    whose sums must agree bit for bit must reduce in the same one."""
    kernel, signature, fixed = KERNELS[name]
    ttgir = compile_for_hopper(kernel, signature, {**fixed, **constexprs}, aligned=aligned).asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.MULTILINE))
    operand = re.search(r'"tt\.reduce".*?\}\) : \(tensor<[^,]+, (#\w+)>', ttgir, re.DOTALL)
    if operand is None:
        raise ValueError(f"{name}: no tt.reduce in its TTGIR")
    return aliases.get(operand.group(1), operand.group(1))


def recorded(path: str) -> dict[str, tuple]:
    """The launches tests/ops/launch_recorder.py wrote, as `KERNELS` entries (with launch options)."""
    launches = {}
    for number, launch in enumerate(json.loads(Path(path).read_text())):
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        name = f"{launch['module'].removeprefix('morion.ops.')}.{launch['name']} (launch {number})"
        launches[name] = (kernel, launch["signature"], launch["constexprs"], launch["options"])
    return launches


# A global memory access in PTX: what a kernel launched with PDL may do only after it waited (an L2
# prefetch, of weights, may come before).
_GLOBAL_ACCESS = re.compile(r"\b(?:(?:ld|st|atom|red)\.global|cp\.async(?!\.bulk\.prefetch))")


def pdl_order_error(kernel: triton.runtime.jit.JITFunction, signature: dict, constexprs: dict) -> str | None:
    """Compiles the kernel with PDL on (and the skinny linear's prefetch, when it has one) and returns why
    its PTX breaks ops/pdl.py's invariant, or None: griddepcontrol.wait, then launch_dependents, both
    before the first global memory access."""
    pdl = {**constexprs, "USE_PDL": True}
    if "PREFETCH_LINE" in pdl:
        pdl.update(PREFETCH_LINE=128, PREFETCH_STEP=max(128, pdl["BLOCK_K"]))
    ptx = compile_for_hopper(kernel, signature, pdl, {"launch_pdl": True}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0 or "griddepcontrol.launch_dependents" not in ptx:
        return "no griddepcontrol.wait and launch_dependents in its PTX"
    access = _GLOBAL_ACCESS.search(ptx)
    if access is not None and access.start() < wait:
        return f"{access.group(0)} before griddepcontrol.wait"
    if "PREFETCH_LINE" in pdl and not 0 <= ptx.find("prefetch.global.L2") < wait:
        return "no prefetch.global.L2 before griddepcontrol.wait"
    return None


# What the compiling processes read (`main` fills it before they fork): name -> (kernel, signature,
# constexprs, launch options).
_kernels: dict[str, tuple] = {}


def _compile_error(name: str) -> str | None:
    """Why kernel `name` does not compile for sm_90, or None."""
    kernel, signature, constexprs, options = _kernels[name]
    try:
        compile_for_hopper(kernel, signature, constexprs, options)
    except Exception as error:  # reported by name, every one
        return f"{type(error).__name__}: {str(error)[:500]}"
    return None


def _pdl_error(name: str) -> str | None:
    kernel, signature, constexprs, _ = _kernels[name]
    try:
        return pdl_order_error(kernel, signature, constexprs)
    except Exception as exception:
        return f"{type(exception).__name__}: {str(exception)[:500]}"


def _on_every_core(check: Callable[[str], str | None], names: list[str]) -> dict[str, str | None]:
    """`check` of each name, in a process a core (forked: they inherit `_kernels`); each compile is
    Triton's front end and ptxas, independent of the others."""
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        return dict(zip(names, pool.map(check, names, chunksize=1), strict=True))


def main(argv: list[str]) -> int:
    pdl = "--pdl" in argv
    argv = [arg for arg in argv if arg != "--pdl"]
    _kernels.update({name: (*entry, None) for name, entry in KERNELS.items()})
    if argv:
        _kernels.update(recorded(argv[0]))
    errors = {name: error for name, error in _on_every_core(_compile_error, list(_kernels)).items() if error}
    for name, error in errors.items():
        print(f"{name}: {error}")
    print(f"compiled for sm_90: {len(_kernels) - len(errors)} of {len(_kernels)}")
    failed = len(errors)
    if pdl:
        # Each kernel once (its first launch here): the order of its first instructions does not depend
        # on its types or tiles.
        first: dict[tuple[str, str], str] = {}
        for name, (kernel, *_) in _kernels.items():
            first.setdefault((kernel.fn.__module__, kernel.fn.__qualname__), name)
        wrong = {
            name: error for name, error in _on_every_core(_pdl_error, list(first.values())).items() if error
        }
        for name, error in wrong.items():
            print(f"{name} with PDL: {error}")
        print(f"waits first with PDL on sm_90: {len(first) - len(wrong)} of {len(first)} kernels")
        failed += len(wrong)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
