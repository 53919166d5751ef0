"""From an image file's bytes to what the engine takes: decoded (PNG, JPEG, WebP), made RGB (transparency
over white), resized to the processor's grid with Pillow's bicubic filter, as transformers' Qwen-VL image
processor (`Qwen2VLImageProcessorPil`) does, and hashed.

This runs in the server's front end (off its event loop); the engine normalises and patches the result
(multimodal/patches.py). Bad input raises `ImageError` with a message for the client.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import NamedTuple

import numpy as np

from morion.multimodal.processing import ImageProcessing

FORMATS = ("PNG", "JPEG", "WEBP")
# Decoded images above this many pixels are refused before they are decoded (a small file can claim a
# huge image): 8192 x 8192, four times what any resize keeps of Qwen3-VL's 16.8 M-pixel ceiling.
MAX_DECODED_PIXELS = 8192 * 8192


class ImageError(ValueError):
    """An image the server cannot use; the message says why (for an HTTP 400)."""


class PreparedImage(NamedTuple):
    """An image as the engine takes it: RGB pixels [height, width, 3] uint8 at the processor's grid, the
    grid (t, h, w) in patches, and its content hash (the processor's settings, the grid and the pixels)."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    digest: bytes

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid
        return t * (h // merge_size) * (w // merge_size)


def prepare_image(data: bytes, processing: ImageProcessing) -> PreparedImage:
    """Decodes, converts and resizes an image file's bytes. ImageError for anything but a PNG, JPEG or WebP
    image that decodes completely and fits MAX_DECODED_PIXELS."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(FORMATS))
            width, height = image.size
            if width * height > MAX_DECODED_PIXELS:
                raise ImageError(
                    f"the image is {width}x{height} pixels, more than the {MAX_DECODED_PIXELS:,} pixels "
                    "accepted"
                )
            image.load()  # decodes the whole file: a truncated or corrupt one fails here
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"the image is larger than the {MAX_DECODED_PIXELS:,} pixels accepted") from None
    except UnidentifiedImageError:
        raise ImageError(f"the data is not an image in a supported format ({', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"the image could not be decoded: {error}") from None
    try:
        resized_height, resized_width = processing.resized_size(height, width)
    except ValueError as error:
        raise ImageError(str(error)) from None
    rgb = _rgb(image)
    if (resized_width, resized_height) != rgb.size:
        rgb = rgb.resize((resized_width, resized_height), resample=Image.Resampling.BICUBIC)
    pixels = np.array(rgb, dtype=np.uint8)  # writable: torch.from_numpy takes it as it is
    grid = (1, resized_height // processing.patch_size, resized_width // processing.patch_size)
    return PreparedImage(pixels, grid, image_digest(pixels, grid, processing))


def _rgb(image):
    """RGB, with anything transparent composited over white (as transformers' `convert_to_rgb`)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def image_digest(pixels: np.ndarray, grid: tuple[int, int, int], processing: ImageProcessing) -> bytes:
    """SHA-256 over the processor's settings, the grid and the resized pixels: what the prompt's image
    tokens are cached under (equal digests, equal embeddings)."""
    hasher = hashlib.sha256(processing.digest())
    hasher.update(np.asarray(grid, dtype="<i8").tobytes())
    hasher.update(np.ascontiguousarray(pixels).tobytes())
    return hasher.digest()
