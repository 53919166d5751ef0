"""PLE's table rows (layers/ple.py) fetched by the device with no host sync, and per-position state for
verify forwards.

In a step where every sequence has the same n new tokens (decode n = 1, verify n = 1 + drafts, and a
short forward of prompt tails of one length, n <= SHORT_CHUNK_TOKENS: models/qwen4_exp._fetch_ple_rows),
`fetch_static` runs with static shapes and no host work, so the step can be captured in a CUDA graph:

- hashes on the device: contexts from each sequence's n-gram history state and its n tokens
  (`cut_contexts`: EOS past an EOS), rows by `NGramHash.rows` (int64 wrap-around and true modulo behave
  alike on every device);
- advances the history state: after token t it is stored in the working slot (decode) or in slot
  `verify_slots[b, t]` (verify: whichever number of drafts is accepted, the state after the last
  accepted token is already in place, as for Gated DeltaNet);
- gathers the table rows on the device: on the CPU by indexing the host shards, on CUDA with a Triton
  kernel that reads the page-locked shards directly through unified virtual addressing
  (`ops/host_gather_triton.py`). A table in memory-mapped files (`--ple-placement mmap`) is not
  page-locked: its rows are gathered on the host after a sync (not capturable; `device_gather_ok` says
  which).

Other forwards (prefill chunks, tails of mixed lengths) take `fetch_prefill`: the same device hashing and
gather, the sources' positions built on the host from the batch's layout (eager, still no sync).

`forward_verify` runs the layer over a verify forward one token column at a time, so its conv window
after token t lands in slot `verify_slots[b, t]` too.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence

import torch

from morion.layers.host_table import FP8_DTYPE, FetchedRows, HostRowTable
from morion.layers.hybrid_backend import HybridBackend
from morion.layers.ngram_hash import NGramHash
from morion.layers.ple import NGRAM_HISTORY, PLELayer


def device_gather_ok(table: HostRowTable, device: torch.device) -> bool:
    """Whether `device` can gather the table's rows itself: always on the CPU; on CUDA when every shard
    is mapped into the device's address space (page-locked host RAM: placement "ram" on a CUDA model;
    asked of the driver once per table and device, outside any capture)."""
    return device.type != "cuda" or _shard_addresses(table, device) is not None


# Device copies, made by the eager warm-up runs before any capture: per hash object and device its
# constants (rebuilt when a checkpoint replaced them), per table and device its shards' addresses.
_HASHES: weakref.WeakKeyDictionary[NGramHash, dict[torch.device, tuple[tuple[int, ...], NGramHash]]]
_HASHES = weakref.WeakKeyDictionary()
_ADDRESSES: weakref.WeakKeyDictionary[
    HostRowTable, dict[torch.device, tuple[tuple[int, ...], torch.Tensor | None]]
]
_ADDRESSES = weakref.WeakKeyDictionary()


def _device_hash(ngram_hash: NGramHash, device: torch.device) -> NGramHash:
    sources = tuple(id(value) for value in ngram_hash.constants.values())
    per_device = _HASHES.setdefault(ngram_hash, {})
    cached = per_device.get(device)
    if cached is None or cached[0] != sources:
        on_device = copy.copy(ngram_hash)
        on_device.constants = {name: value.to(device) for name, value in ngram_hash.constants.items()}
        cached = per_device[device] = (sources, on_device)
    return cached[1]


def _shard_addresses(table: HostRowTable, device: torch.device) -> torch.Tensor | None:
    """[num_shards] int64 on `device`: where its kernels read each shard; None if they cannot."""
    if any(shard is None for shard in table.shards):
        return None
    pointers = tuple(shard.data_ptr() for shard in table.shards)
    per_device = _ADDRESSES.setdefault(table, {})
    cached = per_device.get(device)
    if cached is None or cached[0] != pointers:
        from morion.ops.host_gather_triton import device_addresses

        addresses = device_addresses(table.shards, device)
        on_device = None if addresses is None else torch.tensor(addresses, dtype=torch.int64).to(device)
        cached = per_device[device] = (pointers, on_device)
    return cached[1]


def cut_contexts(sources: torch.Tensor, eos: int) -> torch.Tensor:
    """sources [..., n]: a token (column 0) and the n - 1 tokens before it, nearest first (EOS before its
    sequence's start) -> its n-gram context for `NGramHash.rows`: past the first EOS before the token
    every column reads EOS, as transformers cuts an n-gram at an EOS."""
    before = sources[..., 1:]
    cut = torch.cumsum((before == eos).to(torch.int32), dim=-1) > 0
    return torch.cat((sources[..., :1], torch.where(cut, eos, before)), dim=-1)


def hash_rows(
    ngram_hash: NGramHash, history: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """history [B, c] (each sequence's last c = ngram_size - 1 token ids, EOS before its start) and its
    new tokens [B, n] -> (table rows [B, n, heads], window [B, c + n]: history then tokens, so the history
    after token t is window[:, t + 1 : t + 1 + c])."""
    context_len = ngram_hash.ngram_size - 1
    window = torch.cat((history, tokens), dim=1)
    length = tokens.shape[1]
    sources = torch.stack(
        [window[:, context_len - shift : context_len - shift + length] for shift in range(context_len + 1)],
        dim=-1,
    )
    contexts = cut_contexts(sources, ngram_hash.eos_token_id).view(-1, ngram_hash.ngram_size)
    rows = _device_hash(ngram_hash, tokens.device).rows(contexts)
    return rows.view(*tokens.shape, -1), window


def ragged_window_indices(query_ranges: Sequence[tuple[int, int]], context_len: int) -> torch.Tensor:
    """Where a forward of sequences with any numbers of new tokens finds, in `cat(history.flatten(),
    tokens)` (history [B, c], tokens as laid out by `query_ranges`), each token's n-gram sources
    ([T, c + 1], the token then the c before it, as `cut_contexts` takes them) followed by each sequence's
    history after its last token ([B, c]): one flat int64 host tensor of T * (c + 1) + B * c positions,
    built from the layout alone (no device value read)."""
    num_seqs = len(query_ranges)
    starts = torch.tensor([start for start, _ in query_ranges], dtype=torch.int64)
    lengths = torch.tensor([length for _, length in query_ranges], dtype=torch.int64)
    sequence = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # each sequence's first row among the T
    within = torch.arange(sum(length for _, length in query_ranges)) - first[sequence]

    # Sequence b's window w = history[b] then its tokens: w[i] lies at b * c + i for i < c, else at token
    # start_b + i - c, after the B * c history ids.
    def window_at(seq: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
        in_history = place < context_len
        return torch.where(
            in_history, seq * context_len + place, num_seqs * context_len + starts[seq] + place - context_len
        )

    shifts = torch.arange(context_len + 1)
    sources = window_at(sequence[:, None], context_len + within[:, None] - shifts[None, :])
    after = window_at(torch.arange(num_seqs)[:, None], lengths[:, None] + torch.arange(context_len)[None, :])
    return torch.cat((sources.reshape(-1), after.reshape(-1)))


def gather_rows(table: HostRowTable, rows: torch.Tensor) -> torch.Tensor:
    """rows [N] int64 on the model's device -> [N, dim] in the table's storage dtype on that device, with
    no host sync (`device_gather_ok` must hold)."""
    dtype = table.dtype
    if dtype is None or table.missing():
        raise RuntimeError(f"host table is not loaded: lacks {table.missing() or 'every shard'}")
    row_bytes = table.dim * dtype.itemsize
    if rows.is_cuda:
        from morion.ops.host_gather_triton import gather_host_rows

        addresses = _shard_addresses(table, rows.device)
        if addresses is None:
            raise RuntimeError("the table's shards are not mapped into the device's address space")
        out = gather_host_rows(rows, addresses, table.shard_rows, row_bytes)
        return out.view(dtype)
    # CPU: every shard indexed (clamped), each row kept from the shard it lies in; a fixed shape per shard.
    out = torch.zeros(rows.shape[0], row_bytes, dtype=torch.uint8)
    for index, shard in enumerate(table.shards):
        local = rows - index * table.shard_rows
        inside = (local >= 0) & (local < shard.shape[0])
        picked = shard.view(torch.uint8).index_select(0, local.clamp(0, shard.shape[0] - 1))
        out = torch.where(inside[:, None], picked, out)
    return out.view(dtype)


def fetch_static(ple: PLELayer, input_ids: torch.Tensor, backend: HybridBackend) -> FetchedRows:
    """`fetch_prefill`'s rows for a step of B sequences with n new tokens each (rows b * n .. b * n +
    n - 1), advancing the n-gram history state as described above. Raises while a CUDA graph is captured
    if the device cannot gather the rows itself (a memory-mapped table)."""
    embedding = ple.ple_embedding
    ngram_hash, table = embedding.hash, embedding.table
    host_gather = not device_gather_ok(table, input_ids.device)
    if host_gather and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "PLE cannot be captured in a CUDA graph with its n-gram table in memory-mapped files: the rows "
            "are gathered on the host (--ple-placement ram avoids it)"
        )
    num_seqs = len(backend.query_ranges)
    tokens = input_ids.view(num_seqs, -1)
    pool = backend.state_pool(NGRAM_HISTORY, ple.ple_ordinal)
    stored = pool[backend.state_indices.long()]
    history = torch.where(stored == 0, ngram_hash.eos_token_id, stored - 1)  # stored as id + 1
    rows, window = hash_rows(ngram_hash, history, tokens)
    context_len = history.shape[1]
    width = tokens.shape[1]
    after = window.unfold(1, context_len, 1)[:, 1 : width + 1]  # [B, n, c]: the history after each token
    verify_slots = backend.verify_slots
    if verify_slots is None:
        pool[backend.state_indices.long()] = after[:, -1] + 1
    else:
        pool[verify_slots.long().reshape(-1)] = (after + 1).reshape(num_seqs * width, context_len)
    flat = rows.reshape(-1)
    scale = table.scale if table.dtype == FP8_DTYPE else None
    if host_gather:
        return table.fetch(flat.cpu(), input_ids.device)  # memory-mapped table: a host gather (syncs)
    return FetchedRows(gather_rows(table, flat), None, None, scale)


def fetch_prefill(ple: PLELayer, input_ids: torch.Tensor, backend: HybridBackend) -> FetchedRows:
    """The rows of a forward whose sequences have any numbers of new tokens (prefill chunks, prompt tails
    of mixed lengths), advancing the n-gram history state, with no host sync: the positions of every
    token's n-gram sources and of each sequence's new history come from the batch's layout
    (`ragged_window_indices`, built on the host and copied over from pinned memory), and the device picks
    the sources, hashes them and gathers the table rows as `fetch_static` does. The host hashed them once,
    after two syncs per forward that waited for the device to drain the forward before (8.8 ms of an 8K
    prefill at 12 layers on an H100, results/2026-12-05-session-40-notes.md). The same integer hashing of
    the same tokens, so the same rows and state. Not capturable (the positions are a host tensor): a piecewise
    prefill graph runs it eagerly. A memory-mapped table's rows are gathered on the host (one sync)."""
    embedding = ple.ple_embedding
    ngram_hash, table = embedding.hash, embedding.table
    device = input_ids.device
    pool = backend.state_pool(NGRAM_HISTORY, ple.ple_ordinal)
    slots = backend.state_indices.long()
    stored = pool[slots]
    history = torch.where(stored == 0, ngram_hash.eos_token_id, stored - 1)  # stored as id + 1
    num_seqs, context_len = history.shape
    positions = ragged_window_indices(backend.query_ranges, context_len)
    if device.type == "cuda":  # pinned, so the copy is asynchronous (the caching host allocator keeps it)
        positions = positions.pin_memory()
    positions = positions.to(device, non_blocking=True)
    window = torch.cat((history.reshape(-1), input_ids.to(history.dtype)))[positions]
    num_tokens = input_ids.shape[0]
    sources = window[: num_tokens * (context_len + 1)].view(num_tokens, context_len + 1)
    pool[slots] = window[num_tokens * (context_len + 1) :].view(num_seqs, context_len) + 1
    contexts = cut_contexts(sources, ngram_hash.eos_token_id)
    flat = _device_hash(ngram_hash, device).rows(contexts).reshape(-1)
    if not device_gather_ok(table, device):
        return table.fetch(flat.cpu(), device)  # memory-mapped table: a host gather (syncs)
    scale = table.scale if table.dtype == FP8_DTYPE else None
    return FetchedRows(gather_rows(table, flat), None, None, scale)


class _VerifyColumn:
    """The backend a PLE layer sees for token column t of a verify forward: one token per sequence,
    state read from the slot holding the state after token t - 1 (the working slot for t = 0) and
    written to the slot for the state after token t."""

    def __init__(self, backend: HybridBackend, column: int) -> None:
        slots = backend.verify_slots
        self._backend = backend
        self._source = (backend.state_indices if column == 0 else slots[:, column - 1]).long()
        self._target = slots[:, column].long()
        self.query_ranges: Sequence[tuple[int, int]] = [(b, 1) for b in range(slots.shape[0])]

    def read_state(self, component: str, ordinal: int) -> torch.Tensor:
        return self._backend.state_pool(component, ordinal)[self._source]

    def write_state(self, component: str, ordinal: int, value: torch.Tensor) -> None:
        self._backend.state_pool(component, ordinal)[self._target] = value

    def outside_graph(self, op: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        return op(self, *inputs)  # a verify forward is captured whole: nothing runs between pieces


def forward_verify(
    ple: PLELayer, streams: torch.Tensor, embedded: torch.Tensor, backend: HybridBackend
) -> torch.Tensor:
    """`PLELayer.forward` for a verify forward (rows b * n + t: sequence b's token t), one column at a
    time so the conv window after each token is kept in its verify slot."""
    num_seqs, width = backend.verify_slots.shape
    by_column = streams.view(num_seqs, width, -1)
    rows_by_column = embedded.view(num_seqs, width, -1)
    outs = []
    for column in range(width):
        column_rows = rows_by_column[:, column].contiguous()
        outs.append(ple(by_column[:, column].contiguous(), column_rows, _VerifyColumn(backend, column)))
    return torch.stack(outs, dim=1).view(streams.shape)
