"""Warm-up forwards on scratch memory (CUDA): one of a full chunk compiles the prefill kernels and measures
the activation peak that the KV pool must leave free; one of a short chunk compiles the short-chunk
kernels (engine/forward_groups.py), so a request's first tail does not wait for a compiler."""

from __future__ import annotations

import torch

from morion.cache.page_pool import PagePool
from morion.cache.spec import CacheSpec
from morion.cache.state_slots import StateSlots
from morion.engine.forward_batch import KVScales, PagedAttentionBackend, build_forward_batch
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS


@torch.inference_mode()
def measure_forward_peak_bytes(
    model: torch.nn.Module, spec: CacheSpec, num_tokens: int, device: torch.device, kv_scales: KVScales
) -> int:
    """Peak CUDA memory above the current allocation while one sequence of `num_tokens` tokens (token 0
    repeated) runs a forward and its last row's logits, with a pool and state slot of its own that are
    freed afterwards and not counted. Then a short chunk runs on the same scratch memory, unmeasured."""
    peak = _scratch_forward(model, spec, num_tokens, device, kv_scales)
    _scratch_forward(model, spec, min(num_tokens, SHORT_CHUNK_TOKENS), device, kv_scales)
    return peak


def _scratch_forward(
    model: torch.nn.Module, spec: CacheSpec, num_tokens: int, device: torch.device, kv_scales: KVScales
) -> int:
    page_size = spec.page_size
    num_pages = -(-num_tokens // page_size)
    pool = PagePool(spec, num_pages, device)
    slots = StateSlots(spec, 1, device) if spec.has_state else None
    batch = build_forward_batch(
        [([0] * num_tokens, list(range(num_pages)), 0, num_tokens)],
        [0 if slots is not None else None],
        page_size,
        device,
    )
    backend = PagedAttentionBackend(pool, batch, slots, kv_scales)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(batch.input_ids, batch.positions, backend)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pool, slots, batch, backend, hidden
    torch.cuda.empty_cache()
    return peak
