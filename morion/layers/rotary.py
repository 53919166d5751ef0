"""Rotary position embeddings (rotate-half layout) with default, linear, llama3 and YaRN frequency
scaling, all static: the frequencies (fp32) and YaRN's cos/sin factor are fixed when the model is built.
With mRoPE sections, positions may come per axis (temporal, height, width: images in the prompt)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from morion.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Scaling types whose `original_max_position_embeddings` transformers fills in from the rest of the config.
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn")


def rope_type(rope: dict[str, Any]) -> str:
    """The scaling type of HF `rope_parameters` / `rope_scaling` (`rope_type`, or the older `type`)."""
    return rope.get("rope_type", rope.get("type", "default"))


def standardize_rope(
    rope: dict[str, Any], max_position_embeddings: int, top_level_original: int | None = None
) -> dict[str, Any]:
    """`rope` (a config's `rope_parameters` or `rope_scaling`, with `rope_theta` in it) completed as
    transformers completes it from the rest of the config, and checked: llama3 and YaRN take
    `original_max_position_embeddings` from the top level of the config (`top_level_original`) when it
    is set there, else from `rope`, else `max_position_embeddings`; a YaRN `factor` of null is
    `max_position_embeddings` over that. A `rope_type` other than `ROPE_TYPES`, or a value that scaling
    needs and lacks, raises a one-line `ModelLoadError` naming it."""
    rope = dict(rope)
    kind = rope_type(rope)
    if kind not in ROPE_TYPES:
        raise _unsupported(kind)
    rope["rope_type"] = kind
    if kind in _ORIGINAL_CONTEXT_TYPES:
        # transformers lets a top-level value win (its Phi-3 rule) when it builds the model
        original = top_level_original
        if original is None:
            original = rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = max_position_embeddings if original is None else original
    if kind == "yarn":
        if "factor" not in rope:
            raise ModelLoadError("rope_type 'yarn' needs a factor")
        if rope["factor"] is None:  # DeepSeek-style configs: the ratio of the two context lengths
            rope["factor"] = max_position_embeddings / float(rope["original_max_position_embeddings"])
    try:
        rope_frequencies(2, rope)  # refuse bad values now, not when the model is built
    except KeyError as error:
        raise ModelLoadError(f"rope_type {kind!r} needs {error.args[0]}") from None
    return rope


def scaled_context_length(rope: dict[str, Any], max_position_embeddings: int) -> int:
    """The context the positions may reach: a YaRN config's `original_max_position_embeddings` x
    `factor` (as vLLM derives it) when that is larger than `max_position_embeddings`."""
    if rope_type(rope) != "yarn":
        return max_position_embeddings
    scaled = int(float(rope["original_max_position_embeddings"]) * float(rope["factor"]))
    return max(max_position_embeddings, scaled)


def rope_frequencies(rotary_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in fp32, the factor cos and sin are multiplied by) for
    `rotary_dim` dims from HF `rope_parameters` (theta + scaling). The factor is 1 except for YaRN."""
    theta = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    powers = theta**exponents
    inv_freq = 1.0 / powers
    kind = rope_type(rope)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / _positive(rope, "factor"), 1.0
    if kind == "llama3":
        return _llama3_scaled(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, powers, rope)
    raise _unsupported(kind)


def _unsupported(kind: Any) -> ModelLoadError:
    return ModelLoadError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def _positive(rope: dict[str, Any], key: str) -> float:
    if rope.get(key) is None:
        raise ModelLoadError(f"rope_type {rope_type(rope)!r} needs {key}")
    value = float(rope[key])
    if not value > 0:
        raise ModelLoadError(f"rope_type {rope_type(rope)!r}: {key} must be positive, got {rope[key]!r}")
    return value


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


def _yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: 1 + 0.1 * mscale * ln(factor), and 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 1.0 + 0.1 * mscale * math.log(factor)


def _yarn(
    rotary_dim: int, theta: float, powers: torch.Tensor, rope: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts", arXiv 2309.00071), computed as transformers computes it, in the same fp32
    operation order: frequency pairs that turn more than `beta_fast` times over the original context
    keep their frequency, those turning fewer than `beta_slow` times are divided by `factor`, and a
    linear ramp over the pair index blends the two between; cos and sin are scaled by the attention
    factor (`attention_factor`, else from `mscale` / `mscale_all_dim` when both are set, else
    1 + 0.1 ln(factor))."""
    factor = _positive(rope, "factor")
    original_context = _positive(rope, "original_max_position_embeddings")
    # transformers reads these with `or`: a 0 or a null falls back to the default too
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_magnitude(factor, mscale) / _yarn_magnitude(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_magnitude(factor)

    def pair_boundary(turns: float) -> float:
        # the (fractional) dim index whose wavelength fits `turns` times into the original context
        return rotary_dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    first, last = pair_boundary(beta_fast), pair_boundary(beta_slow)
    if rope.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, rotary_dim - 1)
    if first == last:
        last += 0.001  # a zero-width ramp would divide by zero
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - first) / (last - first)
    kept = 1 - ramp.clamp(0, 1)  # weight of the original frequency, 1 for the fast pairs
    original = 1.0 / powers
    interpolated = 1.0 / (factor * powers)
    inv_freq = interpolated * (1 - kept) + original * kept
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (non-contiguous, batched) positions; cos/sin are fp32.

    The frequencies are a plain fp32 attribute, not a buffer, so casting the model to bf16 or building
    it on the meta device never touches them. YaRN's attention factor multiplies cos and sin, as in
    transformers (q and k each take it once, so the attention logits take its square).
    """

    def __init__(
        self, rotary_dim: int, rope: dict[str, Any], mrope_sections: tuple[int, int, int] | None = None
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self._inv_freq, self.attention_factor = rope_frequencies(rotary_dim, rope)
        self._axes = None if mrope_sections is None else mrope_axes(rotary_dim // 2, mrope_sections)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], or [3, T] (temporal, height, width: interleaved mRoPE, built with sections):
        cos, sin [T, rotary_dim]. With three equal axes the result is that of the one-axis positions."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        if positions.dim() == 2:
            if self._axes is None:
                raise ValueError("positions per axis need a rotary embedding built with mRoPE sections")
            if self._axes.device != positions.device:
                self._axes = self._axes.to(positions.device)
            # frequency j turns with the position of its own axis
            freqs = positions.float().gather(0, self._axes[:, None].expand(-1, positions.shape[1])).T
            freqs = freqs * self._inv_freq[None, :]
        else:
            freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def mrope_axes(num_frequencies: int, sections: tuple[int, int, int]) -> torch.Tensor:
    """Interleaved mRoPE (Qwen3-VL, Qwen3.5, Qwen3.8-Flash-Next): the position axis [F] each of the
    rotary's frequency pairs turns with. Frequency j belongs to height where j % 3 == 1 and j < 3 x
    sections[1], to width where j % 3 == 2 and j < 3 x sections[2], to the temporal axis otherwise (as
    transformers' `recomposition_frequencies`)."""
    axes = torch.zeros(num_frequencies, dtype=torch.int64, device="cpu")
    for axis in (1, 2):
        axes[axis : min(3 * sections[axis], num_frequencies) : 3] = axis
    return axes


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
