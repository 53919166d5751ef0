"""Every Triton kernel of morion/ops reads only the module globals a compiled kernel may read.

Compiled on a GPU, a `@triton.jit` function may use a module global only when it is a `tl.constexpr`, a
module or a function; Triton's interpreter (the CPU tests) accepts any. So a plain `int` global passes every
CPU test and fails to compile on the GPU, as `GROUP_SIZE` did in the NVFP4 kernels. This reads each
kernel's source and names the globals it loads.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import morion.ops

# Under TRITON_INTERPRET=1 (the CPU tests) `triton.jit` gives an InterpretedFunction: both hold the source.
Kernel = triton.runtime.jit.JITFunction | InterpretedFunction


def _kernels() -> list[tuple[str, Kernel]]:
    found = []
    for info in pkgutil.iter_modules(morion.ops.__path__):
        module = importlib.import_module(f"morion.ops.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, Kernel) and value.fn.__module__ == module.__name__:
                found.append((f"{module.__name__}.{name}", value))
    return found


def _names_loaded_from_globals(kernel: Kernel) -> set[str]:
    function = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0]
    assert isinstance(function, ast.FunctionDef)
    local = {argument.arg for argument in function.args.args}
    names = [node for node in ast.walk(function) if isinstance(node, ast.Name)]
    local |= {node.id for node in names if isinstance(node.ctx, ast.Store)}
    return {node.id for node in names if isinstance(node.ctx, ast.Load) and node.id not in local}


def _allowed_when_compiled(value: object) -> bool:
    return isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype)) or callable(value)


KERNELS = _kernels()


def test_the_kernels_are_found() -> None:
    # The scan must see the kernel modules at all, or the test below checks nothing.
    assert len(KERNELS) >= 20


@pytest.mark.parametrize(("name", "kernel"), KERNELS, ids=[name for name, _ in KERNELS])
def test_a_kernel_reads_no_plain_global(name: str, kernel: Kernel) -> None:
    module_globals = kernel.fn.__globals__
    plain = sorted(
        f"{global_name} ({type(module_globals[global_name]).__name__})"
        for global_name in _names_loaded_from_globals(kernel)
        if global_name in module_globals and not _allowed_when_compiled(module_globals[global_name])
    )
    assert not plain, f"{name} reads globals a compiled kernel cannot: {plain}; make them tl.constexpr"
