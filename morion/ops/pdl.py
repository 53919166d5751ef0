"""Programmatic dependent launch (PDL) of morion's Triton kernels: `--pdl launch|prefetch` (Hopper on).

A decode step is ~600 small kernels (80B preset; `results/2026-12-03-h200-profile-80b-main.md`), and between
two of them the GPU idles while the next one is launched and its programs ramp up. With PDL a kernel is
launched while the one before it in the stream still runs: its programs become resident once every program
of that kernel has signalled (`gdc_launch_dependents`) or exited, and then wait (`gdc_wait`,
griddepcontrol.wait) until that kernel has completed and its writes are visible. In a CUDA graph the
launch attribute becomes a programmatic edge, so graph replays overlap the same way.

Invariant, what makes it safe: every kernel of ours calls `wait_for_previous_kernel` in every program,
unconditionally, before its first access to memory another kernel writes (in practice first of all, or
after `prefetch_to_l2`). Kernel N waits for N-1's completion, and N-1 completed only after it waited for
N-2, so no kernel runs ahead of any earlier one. A program that skipped the wait (an early return) could
let its kernel complete before the kernel it follows, and the next kernel would read too early. Before the
wait a kernel may touch only what no kernel writes during a step: weights. A torch or cuBLAS kernel between
two of ours is launched the ordinary way, so it waits for the one before it entirely.

Modes (`PDL_MODES`):
- auto (the default): `AUTO_MODE` where the device has PDL, off elsewhere.
- off: launches as before; the kernels' PDL code is a constexpr branch that compiles away.
- launch: the launch overlap alone.
- prefetch: also the skinny linear's weights (up to `PREFETCH_MAX_BYTES` a call) sent to L2 by each
  program before it waits, so a small linear streams its weights while the kernel before it finishes.

The mode is the process's, set once by the engine's assembly (`set_pdl_mode`) before its warm-up and graph
capture; it applies on CUDA devices of compute capability 9.0 and later, and `launch_options` is read at
every launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.config import PDL_MODES

# The most weight bytes one skinny-linear call sends to L2 ahead of its wait. The H200's L2 is 50 MB and
# holds the running kernel's working set too; a larger slab (the LM head's 311 MB in FP8) would be evicted
# before its loads came and read from HBM twice.
PREFETCH_MAX_BYTES = 8 * 2**20

# Bytes of one L2 prefetch (a cache line).
L2_LINE_BYTES = 128

_mode = "off"


# What `auto` means where the device has PDL: the H200 measured prefetch fastest (80B decode step at C1
# 4.30 ms off, 3.80 launch, 3.78 prefetch; Flash-Next 9.28, 8.87, 8.74:
# results/2026-12-03-h200-session-notes-1504cf1.md).
AUTO_MODE = "prefetch"


def set_pdl_mode(mode: str, device: torch.device) -> str:
    """Sets the process's PDL mode for kernels launched on `device`; returns the mode in effect: "off"
    wherever PDL does not exist (not CUDA, or compute capability below 9.0), `AUTO_MODE` for auto where
    it does."""
    global _mode
    if mode not in PDL_MODES:
        raise ValueError(f"pdl mode must be one of {', '.join(PDL_MODES)}, got {mode!r}")
    supported = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    asked = AUTO_MODE if mode == "auto" else mode
    _mode = asked if supported else "off"
    return _mode


def pdl_mode() -> str:
    return _mode


def launch_options() -> dict[str, bool]:
    """The keyword arguments of a kernel launch for the mode in effect: the kernel's USE_PDL constexpr and,
    with PDL on, Triton's launch option (the launch attribute programmatic stream serialization)."""
    if _mode == "off":
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


def prefetch_line(weight: torch.Tensor) -> int:
    """Elements of `weight` in one L2 line where a kernel should send them to L2 before it waits (mode
    prefetch, at most PREFETCH_MAX_BYTES), else 0: the kernels' PREFETCH_LINE constexpr."""
    if _mode != "prefetch" or weight.numel() * weight.element_size() > PREFETCH_MAX_BYTES:
        return 0
    return L2_LINE_BYTES // weight.element_size()


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Every program's first step (the module's invariant): waits for the kernel before it to complete,
    then lets the kernel after it be launched (it launches once all of this kernel's programs got here)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(pointers):
    """Asks L2 for the line holding each address (PTX prefetch.global.L2); no value is loaded. Every
    address must lie in the tensor (the caller points masked-out lanes at one that does). For weights
    only: the call precedes `wait_for_previous_kernel`."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_columns_to_l2(w_ptr, cols, cols_ok, K, stride_w, LINE: tl.constexpr, STEP: tl.constexpr):
    """Weight columns `cols` of a [N, K] matrix with row stride `stride_w` into L2, one address per L2
    line (LINE elements, 0: nothing), STEP depths at a time; out-of-range columns and depths point at the
    first column and the last element, so every address lies in the tensor. Weights only: the call
    precedes `wait_for_previous_kernel`."""
    if LINE > 0:
        lines = tl.arange(0, STEP // LINE) * LINE
        first = w_ptr + tl.cast(tl.where(cols_ok, cols, 0), tl.int64)[None, :] * stride_w
        for start in range(0, K, STEP):
            prefetch_to_l2(first + tl.minimum(start + lines, K - 1)[:, None])
