"""Qwen3.8-Flash-Next's vision tower (`vision_config`; transformers' `Qwen4ExpVisionModel`, the Qwen3-VL
form): patches of `temporal_patch_size` x `patch_size`² pixels, a learned position table resampled to each
image's grid, `depth` pre-norm ViT blocks with 2-D rotary attention inside each image, and a merger that
folds every `spatial_merge_size`² neighbouring patches into one token of the text model's width.

Inputs come from `multimodal/patches.py`: the patches of all images of a forward, concatenated, each
image's patches in merge-window order (the `spatial_merge_size`² patches of one output token are
consecutive), and each image's grid (t, h, w) in patches. Module names follow the checkpoint's
`model.visual.*`, so checkpoint names are parameter names (under `visual.`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from morion.errors import ModelLoadError

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float

    @classmethod
    def from_hf(cls, hf: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        """transformers' `Qwen4ExpVisionConfig` fields with its defaults; the merger must produce tokens of
        the text model's width."""
        rope = hf.get("rope_parameters") or {}
        kind = rope.get("rope_type", "axial")
        config = cls(
            depth=hf.get("depth", 27),
            hidden_size=hf.get("hidden_size", 1152),
            intermediate_size=hf.get("intermediate_size", 4304),
            num_heads=hf.get("num_heads", 16),
            in_channels=hf.get("in_channels", 3),
            patch_size=_single(hf.get("patch_size", 16), "patch_size"),
            temporal_patch_size=_single(hf.get("temporal_patch_size", 2), "temporal_patch_size"),
            spatial_merge_size=hf.get("spatial_merge_size", 2),
            out_hidden_size=hf.get("out_hidden_size", 3584),
            num_position_embeddings=hf.get("num_position_embeddings", 2304),
            hidden_act=hf.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        problems = []
        if kind != "axial":
            problems.append(f"rope_type {kind!r} (the tower's RoPE is axial)")
        if config.hidden_act not in _GELU:
            problems.append(f"hidden_act {config.hidden_act!r} (need {' or '.join(_GELU)})")
        if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
            problems.append(f"hidden_size {config.hidden_size} over {config.num_heads} heads")
        side = math.isqrt(config.num_position_embeddings)
        if side * side != config.num_position_embeddings:
            problems.append(f"num_position_embeddings {config.num_position_embeddings} is not a square")
        if config.out_hidden_size != text_hidden_size:
            problems.append(
                f"out_hidden_size {config.out_hidden_size} differs from the text model's {text_hidden_size}"
            )
        if problems:
            raise ModelLoadError(f"unsupported qwen4_exp vision_config: {'; '.join(problems)}")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _single(value: Any, name: str) -> int:
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ModelLoadError(f"unsupported qwen4_exp vision_config: {name} {value} (need one size)")
        value = value[0]
    return int(value)


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride, over one patch at a time: a linear map of the flat patch
    (channel, temporal, row, column order, as the processor flattens it)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, size, stride=size, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """x [N, hidden]: the patches of several images; each attends to its own image's only (`lengths`:
        patches per image frame, in order)."""
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outputs = []
        for q_image, k_image, v_image in zip(
            q.split(lengths), k.split(lengths), v.split(lengths), strict=True
        ):
            heads_first = [t.transpose(0, 1) for t in (q_image, k_image, v_image)]
            outputs.append(F.scaled_dot_product_attention(*heads_first).transpose(0, 1))
        return self.proj(torch.cat(outputs).reshape(tokens, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over every dim of each head, in fp32 (as transformers' vision tower)."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = _GELU[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each output token's merge window of patches (consecutive) as one vector
    through a GELU MLP to the text model's width."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        # Axial RoPE: head_dim / 4 frequencies, the row's angles then the column's, repeated (rotate-half).
        quarter = config.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu") / quarter
        self._inv_freq = 1.0 / config.rope_theta**exponents  # a plain attribute: never cast, never meta

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_dim] of the images with these grids (t, h, w), concatenated -> their tokens
        [N / merge², out_hidden_size], image after image."""
        merge = self.config.spatial_merge_size
        rows, columns = _patch_coordinates(grids, merge, patches.device)
        x = self.patch_embed(patches)
        x = x + self._position_embeddings(rows, columns, grids).to(x.dtype)
        cos, sin = self._rotary(rows, columns)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _rotary(self, rows: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq.to(rows.device)
        angles = torch.cat((rows.float()[:, None] * inv_freq, columns.float()[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def _position_embeddings(
        self, rows: torch.Tensor, columns: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """The learned side x side table resampled bilinearly (corners aligned) to each image's grid."""
        side = math.isqrt(self.config.num_position_embeddings)
        counts = [t * h * w for t, h, w in grids]
        heights = torch.tensor([h for _, h, _ in grids], device=rows.device).repeat_interleave(
            torch.tensor(counts, device=rows.device)
        )
        widths = torch.tensor([w for _, _, w in grids], device=rows.device).repeat_interleave(
            torch.tensor(counts, device=rows.device)
        )
        row_taps, row_weights = _bilinear_taps(rows, heights, side)
        column_taps, column_weights = _bilinear_taps(columns, widths, side)
        indices = (row_taps[:, :, None] * side + column_taps[:, None, :]).flatten(1)
        weights = (row_weights[:, :, None] * column_weights[:, None, :]).flatten(1)
        # fp32 weights: the products and their sum are fp32 (as transformers), cast by the caller
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries (clamped to the table) and weights that interpolate position `index` of an
    axis of `size` patches from a table of `side` entries, corners aligned."""
    source = index.float() * (side - 1) / (size - 1).clamp(min=1)
    low = source.floor()
    fraction = source - low
    taps = torch.stack((low.long(), low.long() + 1), dim=-1).clamp(0, side - 1)
    return taps, torch.stack((1 - fraction, fraction), dim=-1)


def _patch_coordinates(
    grids: Sequence[tuple[int, int, int]], merge: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in its image of every patch, in the processor's merge-window order: windows row-major,
    patches row-major inside a window; frames repeat the same coordinates."""
    rows, columns = [], []
    for t, h, w in grids:
        row = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        column = (
            torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        )
        rows.append(row.transpose(1, 2).flatten().repeat(t))
        columns.append(column.transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows), torch.cat(columns)
