"""What a model keeps in the cache, declared once per model and read by everything in `cache/` and `engine/`.

A model declares two kinds of components (design.md §3):

- per-token components, paged with one page table: a page holds `page_size` tokens of *every* one of them
  (attention K/V of each full-attention layer, side caches such as compressed index keys);
- per-request state components, held in fixed-size state slots (a conv window, a recurrent state). A state
  is valid only at one exact token position, so a prefix hit needs a snapshot taken at the hit position.

Nothing here names a model: the model builds its spec from its own config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _check_component(kind: str, name: str, num_layers: int, shape: tuple[int, ...], dtype: object) -> None:
    if not name:
        raise ValueError(f"{kind} needs a non-empty name")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{kind} {name!r}: num_layers must be an int >= 1, got {num_layers!r}")
    if not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ValueError(f"{kind} {name!r}: shape must hold ints >= 1, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{kind} {name!r}: dtype must be a torch.dtype, got {dtype!r}")


def _format_bytes(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value, unit = num_bytes / 1024, "KiB"
    for larger_unit in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger_unit
    return f"{value:.1f} {unit}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TokenComponent:
    """Per-token data of `num_layers` layers; one token of one layer has shape `token_shape`.

    Example: attention K and V of 24 layers with 8 KV heads of dim 64 is
    `TokenComponent("kv", 24, (2, 8, 64), torch.bfloat16)`.
    """

    name: str
    num_layers: int
    token_shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # A list would make the spec unhashable (and mutable).
        object.__setattr__(self, "token_shape", tuple(self.token_shape))
        _check_component("token component", self.name, self.num_layers, self.token_shape, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers of this component."""
        return self.num_layers * math.prod(self.token_shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateComponent:
    """Per-request state of `num_layers` layers; one request's state of one layer has shape `shape`."""

    name: str
    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        _check_component("state component", self.name, self.num_layers, self.shape, self.dtype)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one state slot takes over all layers of this component."""
        return self.num_layers * math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class CacheSpec:
    """Everything a model caches: per-token components (paged) and per-request state components (slots)."""

    page_size: int
    token_components: tuple[TokenComponent, ...]
    state_components: tuple[StateComponent, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_components", tuple(self.token_components))
        object.__setattr__(self, "state_components", tuple(self.state_components))
        ps = self.page_size
        # Power of two: page and slot arithmetic (and kernel block sizes) divide by it.
        if not isinstance(ps, int) or ps < 1 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {ps!r}")
        # Pages are what the radix tree keys and what the pool is sized in; without per-token data a page
        # would cost nothing and the pool could not be sized.
        if not self.token_components:
            raise ValueError("a CacheSpec needs at least one token component")
        names = [c.name for c in (*self.token_components, *self.state_components)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"component names must be unique, repeated: {', '.join(duplicates)}")

    @property
    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token for c in self.token_components)

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def bytes_per_slot(self) -> int:
        return sum(c.bytes_per_slot for c in self.state_components)

    @property
    def has_state(self) -> bool:
        """True when a prefix hit also needs a state snapshot at the hit position."""
        return bool(self.state_components)

    def describe(self) -> str:
        """One line for the startup report."""
        tokens = ", ".join(
            f"{c.name} {c.num_layers}x{c.token_shape} {_dtype_name(c.dtype)}" for c in self.token_components
        )
        line = (
            f"page {self.page_size} tokens, {_format_bytes(self.bytes_per_token)}/token "
            f"({tokens}), {_format_bytes(self.bytes_per_page)}/page"
        )
        if self.has_state:
            states = ", ".join(
                f"{c.name} {c.num_layers}x{c.shape} {_dtype_name(c.dtype)}" for c in self.state_components
            )
            line += f"; {_format_bytes(self.bytes_per_slot)}/state slot ({states})"
        return line
