"""A pytest plugin (`-p tests.ops.launch_recorder`) that records every Triton kernel launch the tests make
in Triton's interpreter: the kernel, each argument's Triton type, the constexpr values and the launch
options, written as JSON to $MORION_LAUNCHES_OUT when the session ends (a pytest-xdist worker writes
$MORION_LAUNCHES_OUT.<worker>: `read_launches` merges them). tests/ops/hopper_compile.py
compiles each distinct launch for Hopper, so a kernel variant the CPU tests run but the GPU compiler
refuses fails on the CPU."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

# torch dtypes as Triton's signature strings name the pointers to them.
TRITON_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv",
    torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip
# Launch options that change the compiled code.
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")

_launches: dict[str, dict[str, Any]] = {}


def _argument_type(value: Any) -> str | None:
    """The Triton signature type of a non-constexpr argument, None for one it cannot name."""
    if isinstance(value, torch.Tensor):
        return f"*{TRITON_TYPES[value.dtype]}" if value.dtype in TRITON_TYPES else None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _record(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> None:
    parameters = inspect.signature(kernel.fn).parameters
    values = dict(zip(kernel.arg_names, args, strict=False))
    values.update({name: value for name, value in kwargs.items() if name in parameters})
    signature, constexprs = {}, {}
    for name, parameter in parameters.items():
        value = values.get(name, parameter.default)
        if "constexpr" in str(parameter.annotation):
            if not isinstance(value, (bool, int, float, str)):
                return  # a constexpr that JSON cannot carry: not recorded
            constexprs[name] = value
            continue
        kind = _argument_type(value)
        if kind is None:
            return
        signature[name] = kind
    launch = {
        "module": kernel.fn.__module__,
        "name": kernel.fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "options": {name: kwargs[name] for name in OPTIONS if name in kwargs},
    }
    _launches[json.dumps(launch, sort_keys=True)] = launch


def pytest_configure(config: Any) -> None:
    run = InterpretedFunction.run

    def recording_run(self: InterpretedFunction, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        _record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("MORION_LAUNCHES_OUT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if path and worker:
        path = f"{path}.{worker}"
    if path and _launches:
        with open(path, "w") as out:
            json.dump(sorted(_launches.values(), key=lambda launch: json.dumps(launch, sort_keys=True)), out)


def read_launches(path: Path) -> list[dict[str, Any]]:
    """The distinct launches recorded to `path` by one process or to `path.<worker>` by xdist workers."""
    launches: dict[str, dict[str, Any]] = {}
    for part in sorted(path.parent.glob(f"{path.name}*")):
        for launch in json.loads(part.read_text()):
            launches[json.dumps(launch, sort_keys=True)] = launch
    return [launches[key] for key in sorted(launches)]
