"""Programmatic dependent launch (ops/pdl.py): the mode switch, and its invariant in every kernel's source.

The compiled side (each kernel's PTX waits before its first global access with PDL on) is checked on the
CPU by tests/ops/test_hopper_compile.py; the speed by `morion bench --pdl` on the H200.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from morion.ops import pdl

OPS = Path(pdl.__file__).parent
# Calls a kernel may make before its wait: the L2 prefetch of weights (pdl.py's helpers), and pure index
# arithmetic (moe_split_k's `k_slice`: a program's K slice, which the skinny kernel's prefetch reads).
ALLOWED_BEFORE_WAIT = {
    "prefetch_to_l2", "prefetch_columns_to_l2", "k_slice", "program_id", "arange", "cast", "where",
    "minimum", "range", "cdiv",
}  # fmt: skip


def _triton_kernels() -> list[tuple[str, ast.FunctionDef]]:
    """Every launched Triton kernel of morion/ops: a jit function whose name ends in `_kernel` (pdl.py's
    own `wait_for_previous_kernel` is a helper the kernels call)."""
    kernels = []
    for path in sorted(set(OPS.glob("*.py")) - {Path(pdl.__file__)}):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.endswith("_kernel"):
                continue
            if any("jit" in ast.unparse(decorator) for decorator in node.decorator_list):
                kernels.append((f"{path.stem}.{node.name}", node))
    return kernels


def _called_name(call: ast.Call) -> str:
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def _is_wait(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and _called_name(statement.value) == "wait_for_previous_kernel"
        and ast.unparse(statement.value.args) == "USE_PDL"
    )


def _invariant_error(kernel: ast.FunctionDef) -> str | None:
    """Why the kernel's source breaks ops/pdl.py's invariant, or None."""
    if "USE_PDL" not in [argument.arg for argument in kernel.args.args]:
        return "no USE_PDL parameter"
    body = kernel.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        if _is_wait(statement):
            return None
        for node in ast.walk(statement):
            if isinstance(node, ast.Return):
                return "returns before wait_for_previous_kernel(USE_PDL)"
            if isinstance(node, ast.Call) and _called_name(node) == "wait_for_previous_kernel":
                return "waits inside a branch or a loop"
            if isinstance(node, ast.Call) and _called_name(node) not in ALLOWED_BEFORE_WAIT:
                return f"calls {_called_name(node)} before wait_for_previous_kernel(USE_PDL)"
    return "no top-level wait_for_previous_kernel(USE_PDL)"


@pytest.mark.parametrize(("module", "name"), [("pdl", "prefetch_columns_to_l2"), ("moe_split_k", "k_slice")])
def test_the_helpers_allowed_before_the_wait_make_only_such_calls(module, name):
    """A helper allowed before the wait prefetches weights and indexes only, in its own body too."""
    source = ast.parse((OPS / f"{module}.py").read_text())
    (helper,) = [n for n in ast.walk(source) if isinstance(n, ast.FunctionDef) and n.name == name]
    calls = {_called_name(node) for node in ast.walk(helper) if isinstance(node, ast.Call)}
    assert calls and calls <= ALLOWED_BEFORE_WAIT - {name}, calls


def test_every_kernel_waits_for_the_previous_one_before_it_touches_memory():
    kernels = _triton_kernels()
    assert len(kernels) >= 25, [name for name, _ in kernels]
    errors = {name: error for name, kernel in kernels if (error := _invariant_error(kernel)) is not None}
    assert not errors, errors


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("def k_kernel(x, BLOCK: tl.constexpr):\n    pass", "no USE_PDL parameter"),
        (
            "def k_kernel(x, USE_PDL: tl.constexpr):\n    v = tl.load(x)\n"
            "    wait_for_previous_kernel(USE_PDL)",
            "calls load before wait_for_previous_kernel(USE_PDL)",
        ),
        (
            "def k_kernel(x, USE_PDL: tl.constexpr):\n    if tl.program_id(0) > 3:\n        return\n"
            "    wait_for_previous_kernel(USE_PDL)",
            "returns before wait_for_previous_kernel(USE_PDL)",
        ),
        (
            "def k_kernel(x, USE_PDL: tl.constexpr):\n    if x:\n        wait_for_previous_kernel(USE_PDL)",
            "waits inside a branch or a loop",
        ),
        (
            "def k_kernel(x, USE_PDL: tl.constexpr):\n    tl.store(x, 1)",
            "calls store before wait_for_previous_kernel(USE_PDL)",
        ),
        (
            "def k_kernel(x, USE_PDL: tl.constexpr):\n    '''doc'''\n    i = tl.program_id(0)\n"
            "    prefetch_to_l2(x + i)\n    wait_for_previous_kernel(USE_PDL)\n    tl.load(x)",
            None,
        ),
    ],
)
def test_the_invariant_check_catches_a_kernel_that_reads_or_returns_before_its_wait(source, error):
    (kernel,) = ast.parse(source).body
    assert _invariant_error(kernel) == error


@pytest.fixture
def restore_mode():
    before = pdl.pdl_mode()
    yield
    pdl._mode = before


def test_pdl_is_off_without_a_hopper_gpu_and_rejects_an_unknown_mode(restore_mode):
    for mode in ("auto", "prefetch"):
        pdl._mode = "launch"
        assert pdl.set_pdl_mode(mode, torch.device("cpu")) == "off"
        assert pdl.launch_options() == {"USE_PDL": False}
        assert pdl.prefetch_line(torch.empty(16, 16, dtype=torch.float8_e4m3fn)) == 0
    with pytest.raises(ValueError, match="pdl mode must be one of auto, off, launch, prefetch, got 'on'"):
        pdl.set_pdl_mode("on", torch.device("cpu"))


@pytest.mark.parametrize(("major", "asked", "in_effect"), [
    (9, "auto", pdl.AUTO_MODE), (9, "launch", "launch"), (9, "off", "off"), (10, "auto", pdl.AUTO_MODE),
    (8, "auto", "off"), (8, "prefetch", "off"),
])  # fmt: skip
def test_auto_takes_the_measured_mode_where_the_device_has_pdl(
    monkeypatch, restore_mode, major, asked, in_effect
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (major, 0))
    assert pdl.set_pdl_mode(asked, torch.device("cuda", 0)) == in_effect
    assert pdl.pdl_mode() == in_effect
    assert pdl.AUTO_MODE == "prefetch"  # what the H200 measured fastest (ops/pdl.py)


def test_launch_options_and_prefetch_follow_the_mode(restore_mode):
    small = torch.empty(1024, 2048, dtype=torch.float8_e4m3fn, device="meta")  # 2 MiB
    large = torch.empty(151936, 2048, dtype=torch.float8_e4m3fn, device="meta")  # the 80B LM head
    bf16 = torch.empty(1024, 2048, dtype=torch.bfloat16, device="meta")
    pdl._mode = "launch"
    assert pdl.launch_options() == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.prefetch_line(small) == 0
    pdl._mode = "prefetch"
    assert pdl.launch_options() == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.prefetch_line(small) == 128  # e4m3: 128 elements a 128-byte line
    assert pdl.prefetch_line(bf16) == 64
    assert pdl.prefetch_line(large) == 0  # beyond PREFETCH_MAX_BYTES: it would not stay in L2


def test_the_engine_config_refuses_an_unknown_mode():
    with pytest.raises(MorionError, match="pdl must be one of auto, off, launch, prefetch, got 'on'"):
        EngineConfig(pdl="on")


def test_an_engine_without_a_hopper_gpu_says_pdl_is_off_and_runs(capsys, restore_mode):
    config = EngineConfig(model="preset:qwen3-next-tiny", device="cpu", kv_cache_tokens=512, pdl="launch")
    engine = Engine(config)
    said = capsys.readouterr().err
    assert "--pdl launch needs a CUDA device of compute capability 9.0 or later; off" in said
    assert pdl.pdl_mode() == "off"
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()


def test_the_default_auto_runs_quietly_without_a_hopper_gpu(capsys, restore_mode):
    config = EngineConfig(model="preset:qwen3-next-tiny", device="cpu", kv_cache_tokens=512)
    assert config.pdl == "auto"
    engine = Engine(config)
    assert "--pdl" not in capsys.readouterr().err
    assert pdl.pdl_mode() == "off"
    engine.close()
