"""An image's pixels as the vision tower's input: rescaled to [0, 1], normalised by the processor's mean
and std, cut into patches and laid out as transformers' Qwen-VL image processor lays them out: patches
[h * w, C * T * P * P], merge windows row-major, the patches of a window row-major inside it, each patch
channel-major with its single frame repeated `temporal_patch_size` times (an image is a one-frame clip)."""

from __future__ import annotations

import numpy as np
import torch

from morion.multimodal.processing import ImageProcessing


def image_patches(pixels: np.ndarray, processing: ImageProcessing, device: torch.device) -> torch.Tensor:
    """pixels [H, W, 3] uint8 (sides multiples of patch x merge) -> fp32 patches [N, 3 * T * P * P] on
    `device`."""
    patch, merge, frames = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    image = torch.from_numpy(np.ascontiguousarray(pixels)).to(device).permute(2, 0, 1).float()
    mean = torch.tensor(processing.image_mean, device=device)[:, None, None]
    std = torch.tensor(processing.image_std, device=device)[:, None, None]
    # fp32 throughout; the processor rescales in fp64 before rounding to fp32: equal to ~1 ulp.
    image = (image * (1 / 255) - mean) / std
    channels, height, width = image.shape
    grid_h, grid_w = height // patch, width // patch
    windows = image.view(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # (window row, window column, row in window, column in window, channel, patch row, patch column)
    windows = windows.permute(1, 4, 2, 5, 0, 3, 6)
    clip = windows.unsqueeze(5).expand(*windows.shape[:5], frames, patch, patch)
    return clip.reshape(grid_h * grid_w, channels * frames * patch * patch)
