"""The newest Triton kernels compile for Hopper (sm_90) on a machine without a GPU (tests/ops/
hopper_compile.py, in a process of its own: this one runs kernels in the interpreter, which accepts code
the compiler refuses). An NVFP4 kernel once passed every CPU test and failed to compile on the H200."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists() and shutil.which("ptxas") is None, reason="no ptxas to compile with")
def test_kernels_compile_for_sm90():
    script = Path(__file__).with_name("hopper_compile.py")
    root = Path(__file__).parents[2]
    run = subprocess.run(
        [sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok") == 16, run.stdout
