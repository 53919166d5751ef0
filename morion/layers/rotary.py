"""Rotary position embeddings (rotate-half layout) with default, linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from morion.errors import ModelLoadError


def rope_inverse_frequencies(rotary_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies for `rotary_dim` dims from HF `rope_parameters` (theta + scaling)."""
    theta = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    raise ModelLoadError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band between the
    # two thresholds interpolated smoothly.
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    original_context = float(rope["original_max_position_embeddings"])
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (non-contiguous, batched) positions; cos/sin are fp32.

    The frequencies are a plain fp32 attribute, not a buffer, so casting the model to bf16 or building
    it on the meta device never touches them.
    """

    def __init__(self, rotary_dim: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self._inv_freq = rope_inverse_frequencies(rotary_dim, rope)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotates the first `cos.shape[-1]` dims, passes the rest through."""
    rotary_dim = cos.shape[-1]
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passthrough), dim=-1)
