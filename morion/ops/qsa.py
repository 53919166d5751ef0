"""Qwen Sparse Attention (QSA): choosing the tokens each query attends to, and attending to them only.
Pure-torch reference, used on every device for now (no fused kernel yet).

For one sequence with raw index keys `raw [L, Di]` (token i at position i) and a query at position p:

- the visible tokens 0..p form `nc = (p + 1) // r` complete blocks of `r` (`compress_ratio`) tokens,
  aligned to position 0; block b's key is rope_at(b * r)(k_norm(mean of its raw keys)) (`pool_blocks`
  does the mean; the caller norms and rotates);
- score(b) = sum over index heads h of relu(q_h . key_b) / sqrt(Di);
- the query sees the tokens of its top-min(budget / r, nc) blocks, plus the tail nc * r .. p of the
  unfinished block (0 to r - 1 tokens), and attends (softmax) over those only.

Ties: `torch.topk` breaks ties (e.g. blocks whose scores are all relu'd to exactly 0) in an unspecified but
deterministic way that depends on the vector it is given. transformers calls it once per query on the
scores of that query's `nc` complete blocks; `select_tokens` calls it on exactly those vectors (rows with
the same `nc` batched, which torch resolves identically), so the selection, ties included, matches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def pool_blocks(raw_keys: torch.Tensor, ratio: int) -> torch.Tensor:
    """Mean of each complete block of `ratio` raw keys [L, Di] -> [L // ratio, Di]: averaged in fp32,
    rounded to the keys' dtype (as transformers)."""
    num_blocks = raw_keys.shape[0] // ratio
    blocks = raw_keys[: num_blocks * ratio].view(num_blocks, ratio, raw_keys.shape[-1])
    return blocks.float().mean(dim=1).to(raw_keys.dtype)


def block_scores(index_q: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """index_q [Q, H, Di], block_keys [B, Di] -> [Q, B] fp32: sum over heads of relu(q . key) / sqrt(Di)."""
    dots = torch.matmul(index_q.float(), block_keys.float().transpose(0, 1))  # [Q, H, B]
    return torch.relu(dots).sum(dim=1) / math.sqrt(index_q.shape[-1])


def select_tokens(scores: torch.Tensor, first_position: int, ratio: int, block_topk: int) -> torch.Tensor:
    """Token positions each query attends to: [Q, block_topk * ratio + ratio - 1] int64, -1 past the end.

    scores [Q, B] from `block_scores` for queries at positions first_position .. first_position + Q - 1
    (consecutive, as one sequence's rows in a step), B >= the blocks complete for the last of them.
    """
    num_queries = scores.shape[0]
    width = block_topk * ratio + ratio - 1
    device = scores.device
    selected = torch.full((num_queries, width), -1, dtype=torch.long, device=device)
    within_block = torch.arange(ratio, device=device)
    row = 0
    while row < num_queries:
        # Rows whose visible tokens make the same number of complete blocks share one topk call.
        complete = (first_position + row + 1) // ratio
        end = min(num_queries, (complete + 1) * ratio - 1 - first_position)
        picked = min(block_topk, complete)
        if picked:
            blocks = scores[row:end, :complete].topk(picked, dim=-1).indices
            selected[row:end, : picked * ratio] = (blocks[:, :, None] * ratio + within_block).flatten(1)
        positions = torch.arange(first_position + row, first_position + end, device=device)
        # The unfinished block's tokens complete*ratio .. p (fewer than `ratio`) come after the blocks.
        tail = complete * ratio + within_block[: ratio - 1]
        tail_rows = torch.where(tail[None, :] <= positions[:, None], tail[None, :], -1)
        selected[row:end, picked * ratio : picked * ratio + ratio - 1] = tail_rows
        row = end
    return selected


def sparse_attention(
    q: torch.Tensor,
    selected: torch.Tensor,
    gather_kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    tile_rows: int = 64,
) -> torch.Tensor:
    """Each query row attends (softmax, scaled by `scale`) to the tokens `select_tokens` chose for it.

    q [Q, Hq, D]; selected [Q, W] token positions, -1 for none; `gather_kv(positions [N])` returns k, v
    [N, Hkv, D] (fp32) of the sequence at those positions. Rows go in tiles: a tile gathers the union of
    its rows' tokens once and masks what each row did not select, so memory stays O(tile * union), not
    O(rows * sequence). fp32 math; returns [Q, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], tile_rows):
        rows = slice(start, start + tile_rows)
        tile = selected[rows]
        chosen = tile >= 0
        union, column = torch.unique(tile[chosen], return_inverse=True)
        mask = torch.zeros(tile.shape[0], union.shape[0], dtype=torch.bool, device=q.device)
        mask[chosen.nonzero()[:, 0], column] = True
        k, v = gather_kv(union)
        attended = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out[rows] = attended.transpose(0, 1).to(q.dtype)
    return out
