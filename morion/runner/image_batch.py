"""The image inputs of one forward (`ImageRows`, models/image_rows.py): every token's rotary position per
axis and its QSA block's first token's, and the embeddings of the image tokens among the forward's rows.

An image is encoded (patches on the device, then the vision tower) by the first forward that computes
one of its tokens, whole (its patches attend to each other), and its embeddings stay with the request
until the forward that computes its last token, so a chunked prefill that splits an image's tokens
encodes it once. A prefix-cache hit inside an image encodes it again for the tokens past the hit; a
retracted request re-encodes what it recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from morion.models.image_rows import ImageRows
from morion.multimodal.patches import image_patches
from morion.multimodal.processing import ImageProcessing
from morion.multimodal.prompt_images import PromptImages
from morion.runner.host_to_device import to_device


class RequestWithImages(Protocol):
    """What the encoder reads and keeps on a request (engine/request.py's Request)."""

    images: PromptImages | None
    image_embeds: dict[int, torch.Tensor]


class ImageChunk(NamedTuple):
    """A forward's rows start .. start + length - 1 of `request` (the engine's chunks, or a verify)."""

    request: RequestWithImages
    start: int
    length: int


class EncoderStats:
    """Images encoded since the engine started, their tokens, and the time the encodes took (host time
    of the patch building and the tower's launch; on CUDA the tower runs asynchronously after it)."""

    def __init__(self) -> None:
        self.images = 0
        self.tokens = 0
        self.seconds = 0.0


class ImageEncoder:
    def __init__(self, model: torch.nn.Module, processing: ImageProcessing, device: torch.device) -> None:
        self.model = model
        self.processing = processing
        self.device = device
        self.block_size = model.rope_block_size
        self.stats = EncoderStats()

    def rows(self, chunks: Sequence[ImageChunk]) -> ImageRows | None:
        """The forward's `ImageRows`, or None when none of its requests has images (positions are then
        the sequence indices, as for text)."""
        if all(chunk.request.images is None for chunk in chunks):
            return None
        rope, block_rope, embed_rows, embeds = [], [], [], []
        self._encode_missing(chunks)
        row = 0
        for request, start, length in chunks:
            indices = np.arange(start, start + length, dtype=np.int64)
            block_starts = indices - indices % self.block_size
            images = request.images
            if images is None:
                rope.append(np.broadcast_to(indices, (3, length)))
                block_rope.append(np.broadcast_to(block_starts, (3, length)))
            else:
                rope.append(images.positions(indices))
                block_rope.append(images.positions(block_starts))
                for index, (first, end) in enumerate(images.spans):
                    lo, hi = max(first, start), min(end, start + length)
                    if lo >= hi:
                        continue
                    embed_rows.append(np.arange(row + lo - start, row + hi - start, dtype=np.int64))
                    embeds.append(request.image_embeds[index][lo - first : hi - first])
                    if end <= start + length:  # its last token is computed now
                        del request.image_embeds[index]
            row += length
        host = [np.concatenate(rope, axis=1), np.concatenate(block_rope, axis=1)]
        host.append(np.concatenate(embed_rows) if embed_rows else np.zeros(0, dtype=np.int64))
        rope_positions, block_rope_positions, rows = to_device(host, self.device)
        hidden = self.model.model.embed_tokens.weight
        stacked = torch.cat(embeds) if embeds else hidden.new_zeros(0, hidden.shape[1])
        return ImageRows(rope_positions, block_rope_positions, rows, stacked)

    def _encode_missing(self, chunks: Sequence[ImageChunk]) -> None:
        """One tower forward over every image some chunk computes tokens of and no earlier forward
        encoded (kept on its request)."""
        wanted: list[tuple[RequestWithImages, int]] = []
        for request, start, length in chunks:
            if request.images is None:
                continue
            for index, (first, end) in enumerate(request.images.spans):
                if first < start + length and end > start and index not in request.image_embeds:
                    wanted.append((request, index))
        if not wanted:
            return
        started = time.perf_counter()
        images = [request.images.images[index] for request, index in wanted]
        dtype = self.model.visual.patch_embed.proj.weight.dtype
        patches = torch.cat([image_patches(image.pixels, self.processing, self.device) for image in images])
        merge = self.processing.merge_size
        embeds = self.model.encode_images(patches.to(dtype), [image.grid for image in images])
        sizes = [image.num_tokens(merge) for image in images]
        for (request, index), image_embeds in zip(wanted, embeds.split(sizes), strict=True):
            request.image_embeds[index] = image_embeds
        self.stats.images += len(images)
        self.stats.tokens += sum(sizes)
        self.stats.seconds += time.perf_counter() - started
