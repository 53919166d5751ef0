"""Qwen Sparse Attention (QSA): choosing the tokens each query attends to, and attending to them only.

For one sequence with raw index keys `raw [L, Di]` (token i at position i) and a query at position p:

- the visible tokens 0..p form `nc = (p + 1) // r` complete blocks of `r` (`compress_ratio`) tokens,
  aligned to position 0; block b's key is rope_at(b * r)(k_norm(mean of its raw keys)) (`pool_blocks`
  does the mean; the caller norms and rotates);
- score(b) = sum over index heads h of relu(q_h . key_b) / sqrt(Di);
- the query sees the tokens of its top-min(budget / r, nc) blocks, plus the tail nc * r .. p of the
  unfinished block (0 to r - 1 tokens), and attends (softmax) over those only.

Two implementations of the same rule:

- the reference (`block_scores`, `select_tokens`, `sparse_attention`): one sequence at a time, shapes
  that follow the data, host syncs. Prefill and mixed batches use it.
- the static one (`static_block_scores`, `select_blocks`, `selected_tokens`, `static_sparse_attention`):
  a batch of B sequences with the same number n of new tokens each (decode: n = 1; speculative verify),
  every shape fixed by the batch size and the page-table width: scores over the table's whole block
  capacity, -inf past each query's complete blocks, a top-k of fixed size (budget / r, whatever the
  table's width: a row's attention runs over the same shape in a graph as eagerly), the tail appended,
  and attention masked to each row's count. No host sync, so a CUDA graph can capture it (on CUDA the
  scores come from `qsa_triton.py` and the attention from the paged decode kernel).

Ties: `torch.topk` breaks ties (e.g. blocks whose scores are all relu'd to exactly 0, frequent when few
blocks score) in an unspecified but deterministic way that depends on the device, the algorithm and the
vector it is given. transformers calls it once per query on the scores of that query's `nc` complete
blocks. With `exact_ties` (CPU tensors only: the default there) both paths call it on exactly those
vectors (rows with the same `nc` batched, which torch resolves identically, the static path reading the
counts on the host, which costs nothing on the CPU), so the selection, ties included, matches
transformers on the CPU. Otherwise (CUDA, or the CPU with exact ties switched off) `top_blocks` ranks
zero scores below positive ones and among themselves by lower block index, so the result depends
neither on the device nor on the padding, and a CUDA graph captures it.
Either way the selected blocks' scores are the same multiset; only which of equally scored blocks is
taken can differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from morion.ops.paged_attention import FP8_KV_DTYPE


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


def top_blocks(scores: torch.Tensor, k: int, exact_ties: bool) -> torch.Tensor:
    """Indices [rows, k] of the k best of scores [rows, N] (scores >= 0, or -inf where there is no block),
    best first. exact_ties: torch.topk's own tie-breaking (transformers' on the CPU; -inf entries come
    last, in no particular order). Otherwise zero scores (every head's dot product relu'd away: the ties
    that happen) rank below all positive ones and among themselves by lower index, on any device, and
    picks past the last finite entry are -1. (Distinct blocks with bit-identical positive scores are left
    to torch.topk; unlike zeros they do not occur in practice.)"""
    if exact_ties:
        return scores.topk(k, dim=-1).indices
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=scores.dtype)
    # Exact in fp32 for up to 2^24 blocks; NaN garbage counts as zero.
    ranked = torch.where(scores > 0, scores, torch.where(scores == float("-inf"), scores, -1.0 - index))
    best, indices = ranked.topk(k, dim=-1)
    return torch.where(best > float("-inf"), indices, -1)


def select_tokens(
    scores: torch.Tensor, first_position: int, ratio: int, block_topk: int, exact_ties: bool = True
) -> torch.Tensor:
    """Token positions each query attends to: [Q, block_topk * ratio + ratio - 1] int64, -1 past the end.

    scores [Q, B] from `block_scores` for queries at positions first_position .. first_position + Q - 1
    (consecutive, as one sequence's rows in a step), B >= the blocks complete for the last of them.
    exact_ties: see `top_blocks`.
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
            blocks = top_blocks(scores[row:end, :complete], picked, exact_ties)
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


# -- static shapes: B sequences with n new tokens each (decode, speculative verify) ---------------------


def static_block_scores(
    index_q: torch.Tensor, block_keys: torch.Tensor, num_complete: torch.Tensor
) -> torch.Tensor:
    """index_q [B * n, H, Di] (sequence b's n queries are rows b * n .. b * n + n - 1), block_keys
    [B, NB, Di] (each sequence's keys for its first NB blocks, garbage past the complete ones) ->
    scores [B * n, NB] fp32, -inf where block >= num_complete [B * n] of the row."""
    num_seqs, num_blocks, dim = block_keys.shape
    rows, heads = index_q.shape[0], index_q.shape[1]
    q = index_q.float().reshape(num_seqs, (rows // num_seqs) * heads, dim)
    dots = torch.bmm(q, block_keys.float().transpose(1, 2)).view(rows, heads, num_blocks)
    scores = torch.relu(dots).sum(dim=1) / math.sqrt(dim)
    return mask_incomplete_blocks(scores, num_complete)


def mask_incomplete_blocks(scores: torch.Tensor, num_complete: torch.Tensor) -> torch.Tensor:
    """-inf at blocks >= num_complete[row] (a where, not an add: garbage NaNs there go too)."""
    blocks = torch.arange(scores.shape[1], device=scores.device)
    return torch.where(blocks[None, :] < num_complete[:, None], scores, float("-inf"))


def select_blocks(
    scores: torch.Tensor, num_complete: torch.Tensor, block_topk: int, exact_ties: bool
) -> torch.Tensor:
    """The blocks each row attends to: [rows, block_topk] int64, the chosen blocks first (min(block_topk,
    num_complete) of them), -1 after them. The width is block_topk whatever NB (the page table's block
    capacity) is: the attention over the selection then has one shape, and so one summation order, for a
    row whether its step ran over the batch's page table (eager) or a graph's wider one.

    scores [rows, NB] from `static_block_scores` (-inf past num_complete). `exact_ties` (CPU tensors
    only: it reads num_complete on the host) takes each row's top-k over exactly its complete blocks, as
    transformers does (see the module docstring); otherwise one fixed-size top-k (ties to the lower
    block), which a CUDA graph captures."""
    rows, num_blocks = scores.shape
    selected = torch.full((rows, block_topk), -1, dtype=torch.long, device=scores.device)
    if exact_ties:
        counts = num_complete.tolist()
        for complete in sorted(set(counts)):
            picked = min(block_topk, complete)
            if picked:
                same = torch.tensor([r for r, c in enumerate(counts) if c == complete], device=scores.device)
                selected[same, :picked] = top_blocks(scores[same, :complete], picked, True)
        return selected
    # Best first: a row with fewer than k complete blocks gets them first, then -inf ones (dropped here).
    k = min(block_topk, num_blocks)
    indices = top_blocks(scores, k, False)
    selected[:, :k] = torch.where((indices >= 0) & (indices < num_complete[:, None]), indices, -1)
    return selected


def selected_tokens(
    blocks: torch.Tensor, num_complete: torch.Tensor, positions: torch.Tensor, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token positions [rows, W], counts [rows]): row t attends to its first counts[t] positions, the
    chosen blocks' tokens and then the tail num_complete * ratio .. position; W = K * ratio + ratio - 1.
    Positions past a row's count are 0 (a valid index, masked by the count)."""
    rows, k = blocks.shape
    width = k * ratio + ratio - 1
    column = torch.arange(width, device=blocks.device)[None, :]
    chosen = torch.clamp(num_complete, max=k)[:, None]  # blocks taken (they come first in `blocks`)
    block = blocks.gather(1, torch.clamp(column // ratio, max=k - 1).expand(rows, width))
    in_blocks = column < chosen * ratio
    tail = num_complete[:, None] * ratio + (column - chosen * ratio)
    counts = chosen[:, 0] * ratio + positions + 1 - num_complete * ratio
    tokens = torch.where(in_blocks, block * ratio + column % ratio, tail)
    return torch.where(column < counts[:, None], tokens, 0), counts


def gather_token_kv(
    kv_layer: torch.Tensor, slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [*slots.shape, Hkv, D] fp32 at flat pool slots (FP8 pools dequantized: value * scale)."""
    if kv_layer.dtype != FP8_KV_DTYPE:
        kv = kv_layer[slots].float()
        return kv[..., 0, :, :], kv[..., 1, :, :]
    # Through a byte view, as store_kv: indexing is defined for uint8 everywhere, not for fp8.
    kv = kv_layer.view(torch.uint8)[slots].view(FP8_KV_DTYPE).float()
    return kv[..., 0, :, :] * k_scale, kv[..., 1, :, :] * v_scale


def static_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [rows, Hq, D]; k, v [rows, W, Hkv, D] fp32 (row t's selected tokens, the first counts[t] real);
    softmax attention per row over its real tokens, fp32 math; returns [rows, Hq, D] in q's dtype."""
    rows, num_q_heads, dim = q.shape
    width, num_kv_heads = k.shape[1], k.shape[2]
    grouped = q.float().view(rows, num_kv_heads, num_q_heads // num_kv_heads, dim)
    scores = torch.einsum("thgd,twhd->thgw", grouped, k) * scale
    real = torch.arange(width, device=q.device)[None, :] < counts[:, None]
    probs = torch.softmax(scores.masked_fill(~real[:, None, None, :], float("-inf")), dim=-1)
    out = torch.einsum("thgw,twhd->thgd", probs, v)
    return out.reshape(rows, num_q_heads, dim).to(q.dtype)
