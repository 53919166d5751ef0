"""An image processor's settings, as transformers' Qwen-VL image processor (`Qwen2VLImageProcessor`, which
Qwen3-VL, Qwen3.5 and Qwen3.8-Flash-Next use) reads them from a model's `preprocessor_config.json`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from morion.errors import ModelLoadError

# Qwen3-VL's published preprocessor_config.json (Qwen3.8-Flash-Next ships the same processor): the
# settings of a model without one (a preset), and the defaults of the fields one leaves out.
QWEN3_VL_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Neither side of a resized image may be more than this many times the other (transformers' limit).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessing:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessing:
        """A preprocessor_config.json's fields (`size` {shortest_edge, longest_edge} or the older
        `min_pixels` / `max_pixels`), each missing one from `QWEN3_VL_DEFAULTS`."""
        merged = {**QWEN3_VL_DEFAULTS, **raw}
        size = {**QWEN3_VL_DEFAULTS["size"], **(merged.get("size") or {})}
        min_pixels = merged.get("min_pixels") or size["shortest_edge"]
        max_pixels = merged.get("max_pixels") or size["longest_edge"]
        processing = cls(
            patch_size=int(merged["patch_size"]),
            temporal_patch_size=int(merged["temporal_patch_size"]),
            merge_size=int(merged["merge_size"]),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=_triple(merged["image_mean"], "image_mean"),
            image_std=_triple(merged["image_std"], "image_std"),
        )
        if processing.min_pixels > processing.max_pixels or processing.min_pixels <= 0:
            raise ModelLoadError(f"preprocessor config: min pixels {min_pixels} and max pixels {max_pixels}")
        return processing

    @classmethod
    def for_model(cls, directory: str | Path | None) -> ImageProcessing:
        """The model directory's preprocessor_config.json, or Qwen3-VL's settings without one."""
        path = None if directory is None else Path(directory) / "preprocessor_config.json"
        if path is None or not path.is_file():
            return cls.from_dict({})
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as error:
            raise ModelLoadError(f"{path}: {error}") from None

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def digest(self) -> bytes:
        """SHA-256 of these settings: part of every image's content hash, so that images prepared with
        other settings never share cached tokens."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize`: both sides multiples of `factor`, the area within [min_pixels,
        max_pixels], the aspect ratio kept as closely as that allows. ValueError for a side of 0 or an
        aspect ratio above MAX_ASPECT_RATIO."""
        if min(height, width) <= 0:
            raise ValueError(f"an image of {width}x{height} pixels has no area")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(
                f"an image of {width}x{height} pixels: its aspect ratio is above {MAX_ASPECT_RATIO}"
            )
        factor = self.factor
        new_height = round(height / factor) * factor
        new_width = round(width / factor) * factor
        if new_height * new_width > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            new_height = max(factor, math.floor(height / beta / factor) * factor)
            new_width = max(factor, math.floor(width / beta / factor) * factor)
        elif new_height * new_width < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            new_height = math.ceil(height * beta / factor) * factor
            new_width = math.ceil(width * beta / factor) * factor
        return new_height, new_width

    def num_tokens(self, height: int, width: int) -> int:
        """Tokens an image of this size becomes in the prompt (one per merge window of patches)."""
        resized_height, resized_width = self.resized_size(height, width)
        return (resized_height // self.factor) * (resized_width // self.factor)


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ValueError(f"{name} needs 3 values (RGB), got {value!r}")
    return (float(values[0]), float(values[1]), float(values[2]))
