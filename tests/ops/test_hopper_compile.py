"""The newest Triton kernels compile for Hopper (sm_90) on a machine without a GPU (tests/ops/
hopper_compile.py, in a process of its own: this one runs kernels in the interpreter, which accepts code
the compiler refuses). An NVFP4 kernel once passed every CPU test and failed to compile on the H200."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tests.ops.launch_recorder import read_launches

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


# The kernels hopper_compile.py always compiles with the H200's types (its `KERNELS`).
FIXED_KERNELS = 28
NO_PTXAS = not PTXAS.exists() and shutil.which("ptxas") is None
ROOT = Path(__file__).parents[2]
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}


def _compile(*launches: str) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).with_name("hopper_compile.py")
    return subprocess.run(
        [sys.executable, str(script), *launches], cwd=ROOT, capture_output=True, text=True, timeout=900,
        env=ENV,
    )  # fmt: skip


@pytest.mark.skipif(NO_PTXAS, reason="no ptxas to compile with")
def test_kernels_compile_for_sm90_with_the_h200_s_types():
    run = _compile()
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"compiled for sm_90: {FIXED_KERNELS} of {FIXED_KERNELS}" in run.stdout, run.stdout


@pytest.mark.skipif(NO_PTXAS, reason="no ptxas to compile with")
def test_every_kernel_launch_of_the_cpu_kernel_tests_compiles_for_sm90(tmp_path):
    """The kernel tests of tests/ops, run again in the interpreter with the launch recorder; then each
    distinct launch (kernel, argument types, constexprs, launch options) compiled for Hopper, and each
    kernel once more with programmatic dependent launch on: its PTX waits for the kernel before it
    before any global memory access (ops/pdl.py's invariant, which a read before the wait breaks)."""
    launches = tmp_path / "launches.json"
    recording = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.ops.launch_recorder",
         "-m", "not gpu", "-n", "auto", "tests/ops", "--ignore", "tests/ops/test_hopper_compile.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**ENV, "TRITON_INTERPRET": "1", "MORION_LAUNCHES_OUT": str(launches)},
    )  # fmt: skip
    assert recording.returncode == 0, recording.stdout[-3000:] + recording.stderr[-3000:]
    recorded = read_launches(launches)
    launches = tmp_path / "merged.json"
    launches.write_text(json.dumps(recorded))
    assert len({(launch["module"], launch["name"]) for launch in recorded}) >= 25, recorded
    run = _compile(str(launches), "--pdl")
    assert run.returncode == 0, run.stdout + run.stderr
    total = FIXED_KERNELS + len(recorded)
    assert f"compiled for sm_90: {total} of {total}" in run.stdout, run.stdout
    waiting = re.search(r"waits first with PDL on sm_90: (\d+) of (\d+) kernels", run.stdout)
    assert waiting is not None and waiting.group(1) == waiting.group(2), run.stdout
    assert int(waiting.group(2)) >= 25, run.stdout


@pytest.mark.skipif(NO_PTXAS, reason="no ptxas to compile with")
def test_fused_quantization_and_slot_sums_leave_the_norm_s_summation_order_alone():
    """The add + norm kernel reduces the squares in one layout whether it quantizes its rows or not and
    whether x comes as rows or as a MoE block's fp32 slot partials (sm_90, the 80B's K = 2048, aligned as
    in the model), so its normed bits are the plain kernel's in each case. The e4m3 store once pulled the
    whole row into 16 values a thread against 8, and on the H200 the fused normed rows differed from the
    unfused ones by a bit."""
    code = (
        "from tests.ops.hopper_compile import first_reduction_layout\n"
        "aligned = ('x_ptr', 'residual_ptr', 'w_ptr', 'out_ptr', 'new_residual_ptr', 'q_ptr', 'scale_ptr',"
        " 'K', 'stride_x', 'stride_residual')\n"
        "for x in ('bf16', 'fp32 partials'):\n"
        "    for quantize in (False, True):\n"
        "        print(first_reduction_layout("
        "f'add_rms_norm_triton._add_rms_norm_kernel[{x}, quantize]', aligned, QUANTIZE=quantize))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV
    )
    assert run.returncode == 0, run.stdout + run.stderr
    plain, *others = run.stdout.split("\n")[:4]
    assert "sizePerThread = [8]" in plain, plain
    assert others == [plain] * 3, run.stdout
