"""Qwen Sparse Attention (QSA): Qwen3.8-Flash-Next's full-attention layers.

The attention itself is Qwen3-Next's gated attention (q_proj yields per-head query | gate halves,
zero-centred q/k norms, partial RoPE, sigmoid(gate) on the output: `GatedAttentionProjections`); what
differs is which tokens a query sees. An indexer (`index_qk_proj`: H index query heads and one raw key
of dim Di per token) scores blocks of `compress_ratio` (r) cached tokens and each query attends only to
its `budget` best-scoring tokens' blocks plus the unfinished block's tail (ops/qsa.py has the rule).
Below budget + r - 1 tokens every block is selected and QSA is ordinary causal attention.

Cache, per token and QSA layer, paged with K/V (so prefix hits, snapshots and the host/disk tiers carry
them like K/V, and `cache/` knows nothing of QSA):

- `INDEX_KEYS`: the raw index key [Di] (un-normed, un-rotated), as computed;
- `BLOCK_KEYS`: the compressed block keys, one per block of r tokens: the block key
  rope_at(first position)(k_norm(mean of its r raw keys)) [Di], in the model dtype, is split over the
  block's r token slots ([ceil(Di / r)] each). Pages hold whole blocks (the page size is a multiple of
  r, `cache_spec` checks), so a block's r slots are consecutive and one block is one row of the
  component's storage viewed [num_slots / r, r * ceil(Di / r)]: row = any of its tokens' slot // r.

A block key is computed once, when the block's last token is computed (a prefill chunk, a decode step or
a verify forward), from the raw keys in the cache (the earlier tokens' may come from earlier steps or a
prefix hit), and written before any query of the step scores. A block is complete exactly when its last
token is computed, and a query at position p scores only blocks ending at or before p, so no query ever
reads a key that was not written for its own tokens: a prefix hit (page-aligned, so block-aligned) brings
complete blocks' keys with its pages, and a rejected speculative draft's block is rewritten when the real
token at its end is computed. The raw keys stay cached: the unfinished block's key needs them later.

Two paths (ops/qsa.py):

- decode and verify steps (every sequence has the same n new tokens: `decode_only`, a speculative
  `verify_slots` forward, or a backend with a true `uniform_queries`: the MTP drafter's draft right
  after a verify step, spec/mtp.py; see `static_step`): static shapes and no host syncs, so the step
  can be captured in a CUDA graph. Scores over the page table's whole block capacity (-inf past each
  query's complete blocks), a top-k of fixed size, the selected tokens' slots through the page table,
  attention masked to each row's count. On CUDA three kernels run it: Triton block scores, one Triton
  kernel for the top-k and the token slots (a radix select over the row's complete blocks only), the
  paged decode kernel (one-token pages); on the CPU torch. Ties among equally scored blocks go to the
  lower block index, except on the CPU, where both paths break them exactly as transformers does there
  (`exact_ties_on_cpu`).
- prefill chunks and mixed batches: on CUDA, the static path again, one sequence's rows at a time in
  tiles of up to `PREFILL_TILE_ROWS` queries (`static_prefill`); on the CPU the per-sequence reference (shapes
  that follow the data, host syncs) over the cached block keys. Either way the step first computes and
  stores the keys of the blocks its tokens complete. With `selected_prefill` (`--qsa-prefill selected`),
  a sequence's piece of more than SHORT_CHUNK_TOKENS (a long forward's piece) at a context of at most
  SELECTED_PREFILL_MAX_BUDGETS budgets attends on tensor cores instead (ops/qsa_prefill_triton.py: the
  same selection, as bits, a tile of queries per program over the key blocks any of them selected); short
  pieces (a prompt's tail, which a CUDA graph may replay) and longer contexts keep the split-KV kernel.
  The choice follows the piece alone, so a prompt sent again computes each row on the path its cold run
  took.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from morion.layers.gated_attention import GatedAttentionProjections
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import RotaryEmbedding, apply_rotary
from morion.layers.token_cache_backend import TokenCacheBackend
from morion.ops.qsa import (
    block_scores,
    gather_token_kv,
    pool_blocks,
    select_blocks,
    select_tokens,
    selected_tokens,
    sparse_attention,
    static_block_scores,
    static_sparse_attention,
)
from morion.ops.skinny_tiles import linear_forward

# Prefill queries per static-path tile: as many as keep the tile's scratch (its rows' block scores, token
# slots and split-KV partials, `_prefill_tile_rows`) within PREFILL_TILE_BYTES, at least the first and at
# most the second of PREFILL_TILE_ROWS, in multiples of PREFILL_TILE_ALIGN. The budget is what tiles of
# 256 rows took at the longest context (Flash-Next at 256K: ~125 MB), so no context needs more scratch
# than before, and the warm-up forward (a long prompt at a short context) now meets the budget it
# reserves for; at short contexts a tile holds more rows: a 1K Flash-Next prefill runs 2 tiles a QSA
# layer, not 4, and each tile costs the engine thread ~0.5 ms of launches (the prefill is host-bound:
# results/2026-12-04-h200-session-notes-8cbb9bd.md).
PREFILL_TILE_BYTES = 128 << 20
PREFILL_TILE_ROWS = (256, 4096)
PREFILL_TILE_ALIGN = 64
# `--qsa-prefill selected` takes the selected-blocks kernel up to contexts of this many budgets (16K
# tokens for Flash-Next). Its work follows the context (a program reads the union of its queries'
# selections), the split-KV kernel's the budget: with random weights, estimated ~25 against 62 ms a
# 4K-token step at 8K and ~120 against 91 at 32K. An estimate until the H200 measures both.
SELECTED_PREFILL_MAX_BUDGETS = 8
INDEX_KEYS = "qsa_index_keys"  # the token component holding each token's raw index key [Di]
BLOCK_KEYS = "qsa_block_keys"  # the token component holding the block keys, ceil(Di / r) per token


def static_step(backend: TokenCacheBackend) -> bool:
    """Every sequence has the same number n of new tokens at consecutive positions, rows b * n .. b * n + n
    - 1 of the batch: a decode step, a speculative verify forward, or a forward whose backend says so
    with a true `uniform_queries` attribute (the MTP drafter's after-verify draft over the verify
    positions, which keeps no state and so has no `verify_slots`). Such steps take the static path."""
    uniform = getattr(backend, "uniform_queries", False)
    return backend.decode_only or backend.verify_slots is not None or uniform


def block_key_slice(head_dim: int, ratio: int) -> int:
    """Values of a block key each of the block's token slots holds (`BLOCK_KEYS`' token shape)."""
    return -(-head_dim // ratio)


class QSAIndexer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rms_norm_eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        # Rows: num_heads query heads, then the single key head (QSA's indexer is MQA).
        self.index_qk_proj = nn.Linear(hidden_size, (num_heads + 1) * head_dim, bias=False)
        self.q_layernorm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)
        self.k_layernorm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [T, H, Di], normed and rotated; raw keys [T, Di], as cached)."""
        tokens = x.shape[0]
        q, raw_keys = (
            linear_forward(self.index_qk_proj, x)  # the skinny kernel where the device tuned its shape
            .view(tokens, self.num_heads + 1, self.head_dim)
            .split([self.num_heads, 1], dim=1)
        )
        if q.is_cuda:
            from morion.ops import qk_norm_rope_triton as heads

            if heads.supports(q, q, cos, sin):  # the norm and RoPE in one kernel, as gated attention's
                return heads.norm_rope(q, self.q_layernorm.weight, self.q_layernorm.eps, cos, sin), raw_keys[
                    :, 0
                ]
        return apply_rotary(self.q_layernorm(q), cos, sin), raw_keys[:, 0]

    def keys_of_blocks(self, raw_blocks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Block keys [N, Di] from each block's raw keys [N, r, Di] and the cos, sin [N, rotary_dim] of its
        first token's position: the mean in fp32 rounded to the keys' dtype (as transformers), k_norm,
        RoPE at the block's first position."""
        pooled = self.k_layernorm(raw_blocks.float().mean(dim=1).to(raw_blocks.dtype))
        return apply_rotary(pooled[:, None], cos, sin)[:, 0]

    def block_keys(self, raw_keys: torch.Tensor, ratio: int, rotary: RotaryEmbedding) -> torch.Tensor:
        """Keys [L // ratio, Di] of a sequence's complete blocks of text (position = index), recomputed
        from its raw keys [L, Di] (what the `BLOCK_KEYS` cache must hold; tests compare the two)."""
        pooled = self.k_layernorm(pool_blocks(raw_keys, ratio))
        starts = torch.arange(pooled.shape[0], device=raw_keys.device) * ratio
        cos, sin = rotary(starts)
        return apply_rotary(pooled[:, None], cos, sin)[:, 0]


def set_qsa_prefill(model: nn.Module, kernel: str) -> None:
    """Sets which kernel every QSA layer of `model` runs its long prefill pieces on (CUDA):
    EngineConfig.qsa_prefill, "split" or "selected" (module docstring)."""
    for module in model.modules():
        if isinstance(module, QSAAttention):
            module.selected_prefill = kernel == "selected"


class Rotation(NamedTuple):
    """A forward's rotary angles, [T, rotary_dim] each: at every token's position, and at the position of
    the first token of the block it belongs to (what its block's key is rotated by, once the block is
    complete). Text tokens' positions are their indices; with images, positions per axis
    (models/qwen4_exp_images.py)."""

    cos: torch.Tensor
    sin: torch.Tensor
    block_cos: torch.Tensor
    block_sin: torch.Tensor


class QSAAttention(GatedAttentionProjections):
    # On the CPU, break top-k ties among equally scored blocks exactly as transformers does (per-row
    # top-k over exactly the complete blocks: reads their count on the host, which costs nothing there).
    # Off: ties go to the lower block on every path, as on CUDA (ops/qsa.py), with the fixed-size top-k
    # a graph captures (tests switch it off to check that path syncs nothing, and to compare devices).
    exact_ties_on_cpu: ClassVar[bool] = True
    # Prefill chunks through the static selection and attention too, in tiles of rows (None: on CUDA,
    # where the per-sequence reference's host syncs and small ops cost the most; tests switch it on for
    # the CPU). The tile bounds the scratch (`_prefill_tile_rows`), and the attention's split count is
    # fixed, so a row's result does not depend on how its prompt is chunked or tiled.
    static_prefill: ClassVar[bool | None] = None
    # Long prefill pieces on the selected-blocks kernel (the engine's `--qsa-prefill selected`; the
    # module docstring says which pieces): set per module by the engine's assembly.
    selected_prefill: bool = False

    def __init__(
        self,
        *args: Any,
        index_heads: int,
        index_head_dim: int,
        budget: int,
        compress_ratio: int,
        **kwargs: Any,
    ) -> None:
        """`args` and `kwargs` are `GatedAttentionProjections`'; the indexer has `index_heads` query heads
        of `index_head_dim`, and each query attends to its `budget` best tokens in blocks of
        `compress_ratio`."""
        if budget % compress_ratio:
            raise ValueError(f"QSA budget {budget} is not a multiple of the compress ratio {compress_ratio}")
        super().__init__(*args, **kwargs)
        self.compress_ratio = compress_ratio
        self.block_topk = budget // compress_ratio
        hidden_size, rms_norm_eps = self.q_proj.in_features, self.q_norm.eps
        self.indexer = QSAIndexer(hidden_size, index_heads, index_head_dim, rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotation: Rotation,
        backend: TokenCacheBackend,
    ) -> torch.Tensor:
        """x: [T, hidden]; positions [T] (each token's index in its sequence); `rotation` the rotary's
        cos, sin at each token's position and at its block's first token's. Returns [T, hidden]."""
        q, k, v, gate = self.project(x, rotation.cos, rotation.sin)
        index_q, raw_keys = self.indexer.project(x, rotation.cos, rotation.sin)
        out = backend.outside_graph(
            self._cache_and_attend, q, k, v, index_q, raw_keys, positions, rotation.block_cos,
            rotation.block_sin,
        )  # fmt: skip
        return self.gate_output(out, gate)

    def _cache_and_attend(
        self,
        backend: TokenCacheBackend,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        raw_keys: torch.Tensor,
        positions: torch.Tensor,
        block_cos: torch.Tensor,
        block_sin: torch.Tensor,
    ) -> torch.Tensor:
        """The part that reads the batch's layout and the cache (`HybridBackend.outside_graph`: a
        piecewise prefill graph runs it eagerly between its pieces): stores this step's K/V, raw index
        keys and completed block keys, then attends. Returns [T, H, D], before the output gate."""
        ordinal = self.attention_ordinal
        backend.write_kv(ordinal, k, v)
        backend.write_tokens(INDEX_KEYS, ordinal, raw_keys)
        # Decode and verify: every sequence has the same number of new tokens (the static path).
        static = static_step(backend)
        self._store_block_keys(positions, block_cos, block_sin, backend, static)
        if static:
            return self._attend_static(q, index_q, positions, backend.page_table, backend)
        if q.is_cuda if self.static_prefill is None else self.static_prefill:
            return self._attend_prefill_static(q, index_q, positions, backend)
        return self._attend_reference(q, index_q, backend)

    def _block_rows(self, backend: TokenCacheBackend) -> torch.Tensor:
        """The `BLOCK_KEYS` storage of this layer as one row per block slot [num_slots / r, r * slice]."""
        pool = backend.token_pool(BLOCK_KEYS, self.attention_ordinal)
        return pool.view(-1, self.compress_ratio * pool.shape[-1])

    def _store_block_keys(
        self,
        positions: torch.Tensor,
        block_cos: torch.Tensor,
        block_sin: torch.Tensor,
        backend: TokenCacheBackend,
        static: bool,
    ) -> None:
        """Computes and stores the key of every block whose last token is among this step's tokens
        (`block_cos`, `block_sin`: `Rotation`'s)."""
        ratio, dim = self.compress_ratio, self.indexer.head_dim
        key_rows = self._block_rows(backend)
        if positions.is_cuda:  # one kernel, for every row of any forward (no host sync)
            from morion.ops import qsa_triton

            norm = self.indexer.k_layernorm
            raw_keys = backend.token_pool(INDEX_KEYS, self.attention_ordinal)
            qsa_triton.store_block_keys_(
                raw_keys, key_rows, backend.out_slots, positions, block_cos, block_sin, norm.weight,
                norm.eps, ratio,
            )  # fmt: skip
            return
        raw_blocks = backend.token_pool(INDEX_KEYS, self.attention_ordinal).view(-1, ratio, dim)
        rows = backend.out_slots // ratio  # a token's block slot (pages hold whole blocks)
        ends_block = (positions + 1) % ratio == 0
        if not static:
            done = ends_block.nonzero()[:, 0]
            block = rows[done]
            keys = self.indexer.keys_of_blocks(raw_blocks[block], block_cos[done], block_sin[done])
            key_rows[block, :dim] = keys.to(key_rows.dtype)
            return
        # Without data-dependent shapes: one column of the n tokens per sequence at a time (sequences own
        # distinct blocks, so no two rows of a write collide), every row rewriting its block with the new
        # key where its token ends it and with the key as it was elsewhere. Columns go in order, so a block
        # a later column ends is written after the earlier columns rewrote it unchanged.
        width = backend.query_ranges[0][1] if backend.query_ranges else 1
        for column in range(width):
            block = rows[column::width]
            cos, sin = block_cos[column::width], block_sin[column::width]
            keys = self.indexer.keys_of_blocks(raw_blocks[block], cos, sin)
            ends = ends_block[column::width, None]
            key_rows[block, :dim] = torch.where(ends, keys.to(key_rows.dtype), key_rows[block, :dim])

    def _attend_static(
        self,
        q: torch.Tensor,
        index_q: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        backend: TokenCacheBackend,
    ) -> torch.Tensor:
        """Rows b * n .. b * n + n - 1 are the n queries of sequence b (page_table row b) at consecutive
        positions: a decode or verify step, or a tile of one sequence's prefill chunk. No host syncs
        (but with exact CPU ties). The attention's split count follows the fixed selection width alone, so
        a query's result is the same in a prefill tile, a decode step or a verify (any batch). On CUDA
        three kernels: block scores, the selection with its token slots, the paged attention."""
        ratio, dim = self.compress_ratio, self.indexer.head_dim
        page_size = backend.page_size
        num_seqs, rows = page_table.shape[0], q.shape[0]
        num_complete = torch.div(positions + 1, ratio, rounding_mode="floor")
        key_rows = self._block_rows(backend)
        kv_layer = backend.kv_pool(self.attention_ordinal)
        k_scale, v_scale = backend.kv_scales
        if q.is_cuda:
            from morion.ops import qsa_triton

            scores = qsa_triton.block_scores(index_q, key_rows, page_table, num_complete, page_size, ratio)
            slots, counts = qsa_triton.select_token_slots(
                scores, num_complete, positions, page_table, self.block_topk, ratio, page_size
            )
            return qsa_triton.sparse_attention(q, kv_layer, slots, counts, self.scale, k_scale, v_scale)
        # Each page holds page_size / r consecutive block rows: gather whole pages of block keys.
        per_page = key_rows.view(-1, page_size // ratio, key_rows.shape[-1])
        keys = per_page[page_table.long()].view(num_seqs, -1, key_rows.shape[-1])[..., :dim]
        scores = static_block_scores(index_q, keys, num_complete)
        blocks = select_blocks(scores, num_complete, self.block_topk, self.exact_ties_on_cpu)
        tokens, counts = selected_tokens(blocks, num_complete, positions, ratio)
        sequence = torch.div(torch.arange(rows, device=q.device), rows // num_seqs, rounding_mode="floor")
        pages = page_table.long()[sequence[:, None], tokens // page_size]
        slots = pages * page_size + tokens % page_size
        k, v = gather_token_kv(kv_layer, slots, k_scale, v_scale)
        return static_sparse_attention(q, k, v, counts, self.scale)

    def _attend_prefill_static(
        self, q: torch.Tensor, index_q: torch.Tensor, positions: torch.Tensor, backend: TokenCacheBackend
    ) -> torch.Tensor:
        """Prefill / mixed batches on the static path: each sequence's rows in tiles of at most
        `_prefill_tile_rows` consecutive queries, each tile one sequence of the static path. Every
        kernel of it computes a row alone, so the tiling never changes a row's result."""
        out = torch.zeros_like(q)
        tile_rows = self._prefill_tile_rows(q, backend)
        selected = self._selected_pieces(backend)
        for n, (start, length) in enumerate(backend.query_ranges):
            attend = self._attend_selected if selected[n] else self._attend_static
            for tile in range(start, start + length, tile_rows):
                rows = slice(tile, min(tile + tile_rows, start + length))
                out[rows] = attend(
                    q[rows], index_q[rows], positions[rows], backend.page_table[n : n + 1], backend
                )
        return out

    def _selected_pieces(self, backend: TokenCacheBackend) -> list[bool]:
        """Which sequences' pieces take the selected-blocks kernel: long pieces at contexts within the
        limit, under `selected_prefill` (module docstring). Short ones are a prompt's tail, which a CUDA
        graph may replay (without the host copy of the lengths read here), and a piece of a few queries
        gains nothing from sharing key tiles."""
        long = [length > SHORT_CHUNK_TOKENS for _, length in backend.query_ranges]
        if not self.selected_prefill or not any(long):
            # Short pieces never read the lengths: a CUDA graph of them has no host copy (the H200's
            # short-graph capture failed on it, and its short forwards ran eagerly).
            return [False] * len(long)
        limit = SELECTED_PREFILL_MAX_BUDGETS * self.block_topk * self.compress_ratio
        return [
            is_long and context <= limit for is_long, context in zip(long, backend.context_lens, strict=True)
        ]

    def _attend_selected(
        self,
        q: torch.Tensor,
        index_q: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        backend: TokenCacheBackend,
    ) -> torch.Tensor:
        """A tile of one sequence's queries (page_table [1, P]) on the selected-blocks kernel: the static
        path's block scores and selection, as bits, then the queries' selected blocks and tails on tensor
        cores (ops/qsa_prefill_triton.py; Triton, so CUDA or the interpreter)."""
        from morion.ops import qsa_prefill_triton, qsa_triton

        ratio = self.compress_ratio
        num_complete = torch.div(positions + 1, ratio, rounding_mode="floor")
        key_rows = self._block_rows(backend)
        scores = qsa_triton.block_scores(
            index_q, key_rows, page_table, num_complete, backend.page_size, ratio
        )
        bits = qsa_triton.select_block_bits(scores, num_complete, self.block_topk)
        k_scale, v_scale = backend.kv_scales
        return qsa_prefill_triton.selected_prefill_attention(
            q, backend.kv_pool(self.attention_ordinal), page_table[0], positions, bits, ratio,
            backend.page_size, self.scale, k_scale, v_scale,
        )  # fmt: skip

    def _prefill_tile_rows(self, q: torch.Tensor, backend: TokenCacheBackend) -> int:
        """Rows of a prefill tile (PREFILL_TILE_BYTES' rule) from what one row of `_attend_static`
        allocates: fp32 scores over the page table's blocks, int32 token slots of the selection's fixed
        width and their count, and on CUDA the split-KV kernel's fp32 partials and log-sum-exps per
        (query head, split)."""
        blocks = backend.page_table.shape[1] * backend.page_size // self.compress_ratio
        width = self.block_topk * self.compress_ratio + self.compress_ratio - 1
        splits = 1
        if q.is_cuda:
            from morion.ops.paged_attention_triton import kv_split_count

            splits = kv_split_count(self.num_kv_heads, width, q.device)
        row_bytes = 4 * (blocks + width + 1 + self.num_heads * splits * (self.head_dim + 1))
        fewest, most = PREFILL_TILE_ROWS
        rows = PREFILL_TILE_BYTES // row_bytes // PREFILL_TILE_ALIGN * PREFILL_TILE_ALIGN
        return max(fewest, min(most, rows))

    def _attend_reference(
        self, q: torch.Tensor, index_q: torch.Tensor, backend: TokenCacheBackend
    ) -> torch.Tensor:
        """Prefill / mixed batches: one sequence at a time over its cached block keys (host syncs)."""
        ratio, dim, ordinal = self.compress_ratio, self.indexer.head_dim, self.attention_ordinal
        out = torch.zeros_like(q)
        for n, (start, length) in enumerate(backend.query_ranges):
            if length == 0:
                continue
            rows = slice(start, start + length)
            cached = backend.read_sequence_tokens(BLOCK_KEYS, ordinal, n)
            num_blocks = cached.shape[0] // ratio
            block_keys = cached[: num_blocks * ratio].reshape(num_blocks, ratio * cached.shape[-1])[:, :dim]
            scores = block_scores(index_q[rows], block_keys)
            exact = not q.is_cuda and self.exact_ties_on_cpu
            selected = select_tokens(scores, cached.shape[0] - length, ratio, self.block_topk, exact)
            out[rows] = sparse_attention(
                q[rows],
                selected,
                lambda positions, n=n: backend.read_sequence_kv(ordinal, n, positions),
                self.scale,
            )
        return out
