"""Warm-up forwards on scratch memory (CUDA): one of a full chunk compiles the prefill kernels and measures
the activation peak that the KV pool must leave free; then unmeasured ones compile what requests would
otherwise compile while the server runs: long and short chunks (engine/forward_groups.py) of one and
several sequences, at every tile width the fused MoE kernels take for up to a decode or short forward's
tokens (their pair block is the power of two at or above tokens x top-k). A kernel compiled while serving
stalls every running request for seconds (the H200 saw a 4.1 s time to first token through the server);
Triton keeps what it compiled on disk, so a machine's first start pays for it."""

from __future__ import annotations

import torch

from morion.cache.page_pool import PagePool
from morion.cache.spec import CacheSpec
from morion.cache.state_slots import StateSlots
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.runner.backend import KVScales
from morion.runner.forward_batch import build_forward_batch
from morion.runner.model_runner import forward_eager


@torch.inference_mode()
def measure_forward_peak_bytes(
    model: torch.nn.Module,
    spec: CacheSpec,
    num_tokens: int,
    device: torch.device,
    kv_scales: KVScales,
    max_group_tokens: int,
    max_sequences: int,
) -> int:
    """Peak CUDA memory above the current allocation while one sequence of `num_tokens` tokens (token 0
    repeated) runs a forward and its last row's logits, with a pool and state slots of its own that are
    freed afterwards and not counted. Then the batches of `warmup_batches` run on scratch memory,
    unmeasured."""
    peak = _scratch_forward(model, spec, [num_tokens], device, kv_scales)
    for lengths in warmup_batches(num_tokens, max_group_tokens, max_sequences):
        _scratch_forward(model, spec, lengths, device, kv_scales)
    return peak


def warmup_batches(chunk_tokens: int, max_group_tokens: int, max_sequences: int) -> list[list[int]]:
    """Sequence lengths of the unmeasured warm-up forwards, after the full chunk: a long chunk split into
    two sequences at no page boundary, then for each total of tokens that starts a new MoE pair block
    (2, 3, 5, 9, ... up to `max_group_tokens`, the most a decode or short forward holds) a short forward
    of that many tokens (sequences of at most SHORT_CHUNK_TOKENS, at most `max_sequences` of them). The
    kernels of decode forwards are compiled when their graphs are captured; the fused MoE kernels are the
    same in every kind of forward."""
    batches = []
    if chunk_tokens > 2 * SHORT_CHUNK_TOKENS + 14:
        half = chunk_tokens // 2
        batches.append([half + 7, chunk_tokens - half - 7])
    totals = sorted({min(2**k + 1, max_group_tokens) for k in range(max_group_tokens.bit_length())})
    for total in (t for t in totals if 1 < t <= chunk_tokens):
        full, rest = divmod(total, SHORT_CHUNK_TOKENS)
        lengths = [SHORT_CHUNK_TOKENS] * full + ([rest] if rest else [])
        batches.append(lengths[:max_sequences])
    return batches


def _scratch_forward(
    model: torch.nn.Module,
    spec: CacheSpec,
    lengths: list[int],
    device: torch.device,
    kv_scales: KVScales,
) -> int:
    """One forward of sequences of `lengths` tokens (token 0, from position 0) on a pool and state slots
    of their own; returns the peak CUDA memory above the allocation before it."""
    page_size = spec.page_size
    pages_of = [-(-length // page_size) for length in lengths]
    pool = PagePool(spec, sum(pages_of), device)
    slots = StateSlots(spec, len(lengths), device) if spec.has_state else None
    chunks, first_page = [], 0
    for length, num_pages in zip(lengths, pages_of, strict=True):
        chunks.append(([0] * length, list(range(first_page, first_page + num_pages)), 0, length))
        first_page += num_pages
    batch = build_forward_batch(
        chunks,
        [i if slots is not None else None for i in range(len(lengths))],
        page_size,
        device,
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = forward_eager(model, pool, batch, slots, kv_scales)
    model.compute_logits(hidden[batch.last_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pool, slots, batch, hidden
    torch.cuda.empty_cache()
    return peak
