"""The one frozen engine configuration that CLI flags map onto, with automatic choices resolved."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from morion.errors import MorionError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a path, a known model name, or None for the default model
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise MorionError(f"unsupported dtype {self.dtype!r} (choose auto, {', '.join(DTYPES)})")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise MorionError(f"invalid device {self.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise MorionError(f"device {self.device!r} requested but CUDA is not available")
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
