"""What a forward of a model with a vision tower takes besides token ids and sequence indices when images
are among its tokens (`Qwen4ExpForCausalLM.forward(..., images=ImageRows)`); the engine builds it
(engine/image_batch.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ImageRows(NamedTuple):
    """For a forward of T tokens: every token's rotary position per axis (temporal, height, width; a text
    token's three are equal), the positions of the first token of each token's QSA block (its block key
    is rotated there), and the rows whose input is an image token with the embeddings they take instead
    of their token's (the vision tower's output)."""

    rope_positions: torch.Tensor  # [3, T] int64
    block_rope_positions: torch.Tensor  # [3, T] int64
    embed_rows: torch.Tensor  # [N] int64
    embeds: torch.Tensor  # [N, hidden]
