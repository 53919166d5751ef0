"""Where a prompt's images are, the rotary positions of its tokens per axis, and the ids its tokens are
cached under.

**Positions** (transformers' `Qwen4ExpModel.get_rope_index`): text tokens advance one position on all
three axes (temporal, height, width); an image's tokens, a grid of gh x gw merged tokens starting at
position s, take (s, s + row, s + column), and the text after it continues at s + max(gh, gw). A token
after the prompt (generated) at index i has position i + delta on every axis, delta = (the prompt's
largest position + 1) - its length (transformers' `mrope_position_deltas`).

**Cache ids**: the radix tree and the page keys of the host and disk tiers key a prompt by its token ids,
and every image's tokens are the same id. So the cache sees the prompt with each image token replaced by
an id above every token id (>= KEY_ID_BASE) derived from the image's content hash: two prompts share
cached pages exactly as far as their text and their images agree (a 56-bit prefix of the digest decides;
equal digests mean equal pixels after resizing, hence equal embeddings and positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from morion.errors import InvalidRequestError
from morion.multimodal.image_decode import PreparedImage

KEY_ID_BASE = 1 << 32


class PromptImages:
    """A prompt's images: `spans[i]` (start, end) are the prompt indices of image i's tokens."""

    def __init__(
        self, prompt: Sequence[int], images: Sequence[PreparedImage], image_token_id: int, merge_size: int
    ) -> None:
        self.images = list(images)
        self.merge_size = merge_size
        self.spans = _image_spans(prompt, [image.num_tokens(merge_size) for image in images], image_token_id)
        self.prompt_length = len(prompt)
        self.rope = self._prompt_positions()
        self.delta = int(self.rope.max()) + 1 - len(prompt) if len(prompt) else 0
        self.cache_ids = list(prompt)
        for (start, end), image in zip(self.spans, self.images, strict=True):
            base = KEY_ID_BASE + int.from_bytes(image.digest[:7], "little")
            # distinct per token of the image, so no two of its pages alias (XOR keeps them >= KEY_ID_BASE)
            self.cache_ids[start:end] = [base ^ index for index in range(end - start)]

    @property
    def num_image_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def positions(self, indices: np.ndarray) -> np.ndarray:
        """Rotary positions [3, len(indices)] int64 of the tokens at these sequence indices (prompt tokens
        or tokens after it)."""
        indices = np.asarray(indices, dtype=np.int64)
        inside = indices < self.prompt_length
        out = np.broadcast_to(indices + self.delta, (3, len(indices))).copy()
        out[:, inside] = self.rope[:, indices[inside]]
        return out

    def _prompt_positions(self) -> np.ndarray:
        rope = np.empty((3, self.prompt_length), dtype=np.int64)
        position = 0  # the next text token's position
        previous_end = 0
        for (start, end), image in zip(self.spans, self.images, strict=True):
            rope[:, previous_end:start] = position + np.arange(start - previous_end)
            position += start - previous_end
            _, grid_h, grid_w = image.grid
            rows, columns = grid_h // self.merge_size, grid_w // self.merge_size
            rope[0, start:end] = position
            rope[1, start:end] = position + np.repeat(np.arange(rows), columns)
            rope[2, start:end] = position + np.tile(np.arange(columns), rows)
            position += max(rows, columns)
            previous_end = end
        rope[:, previous_end:] = position + np.arange(self.prompt_length - previous_end)
        return rope


def _image_spans(prompt: Sequence[int], sizes: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """The runs of `image_token_id` in the prompt, one per image, each as long as its image's tokens."""
    ids = np.asarray(prompt, dtype=np.int64)
    is_image = np.concatenate(([False], ids == image_token_id, [False]))
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
    if len(runs) != len(sizes):
        raise InvalidRequestError(
            f"the prompt has {len(runs)} runs of image tokens (id {image_token_id}) for {len(sizes)} images"
        )
    for index, ((start, end), size) in enumerate(zip(runs, sizes, strict=True)):
        if end - start != size:
            raise InvalidRequestError(
                f"image {index} takes {size} tokens, but its run of image tokens in the prompt has "
                f"{end - start}"
            )
    return runs
