"""How one engine step's chunks split into forwards, so that no request's result depends on its neighbours.

A request must answer the same whatever else the server runs beside it: a conversation restored from the
host or disk tier recomputes only its prompt's tail (what follows its last page boundary, a chunk of its
own, scheduler.py) and then decodes, and both must come out as they did in the cold run, under any other
traffic. Each kernel computes a row the same way in any batch of *its* kind (fixed split-KV counts, fused
MoE tiles that never depend on the token count, cuBLAS GEMMs measured row-invariant on the H200), but a
mixed batch changes the kind: one long prompt chunk in the batch switches every row to the prefill
kernels (the extend attention kernel, chunked Gated DeltaNet, grouped MoE GEMMs). So a step runs up to
three kinds of forward, each over chunks of one kind only:

1. decode: one new token per sequence (decode steps, and one-token tails): CUDA-graph replay;
2. short: 2 to SHORT_CHUNK_TOKENS new tokens per sequence (tails): token-by-token Gated DeltaNet, split-KV
   attention;
3. long: prefill chunks.

Decode and short forwards hold at most `max_tokens` tokens (the fused MoE kernels' batch-invariant range,
layers/moe.AUTO_TRITON_MAX_TOKENS); more make several forwards of that kind. Each extra forward reads the
weights once more: a long prefill chunk's forward is compute-bound, and the others are a decode step's
cost, so the split costs a step at most one decode step of time.
"""

from __future__ import annotations

from morion.engine.scheduler import ScheduledChunk
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.layers.moe import AUTO_TRITON_MAX_TOKENS

FORWARD_GROUP_MAX_TOKENS = AUTO_TRITON_MAX_TOKENS


def forward_groups(chunks: list[ScheduledChunk], max_tokens: int) -> list[list[ScheduledChunk]]:
    """The step's chunks as forwards: decode ones first (the latency users feel), then short, then long
    ones; each chunk once, in its step order within its forward."""
    decode = [c for c in chunks if c.num_tokens == 1]
    short = [c for c in chunks if 1 < c.num_tokens <= SHORT_CHUNK_TOKENS]
    long = [c for c in chunks if c.num_tokens > SHORT_CHUNK_TOKENS]
    groups = _capped(decode, max_tokens) + _capped(short, max_tokens)
    return groups + ([long] if long else [])


def _capped(chunks: list[ScheduledChunk], max_tokens: int) -> list[list[ScheduledChunk]]:
    groups: list[list[ScheduledChunk]] = []
    tokens = max_tokens  # forces a new group for the first chunk
    for chunk in chunks:
        if tokens + chunk.num_tokens > max_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(chunk)
        tokens += chunk.num_tokens
    return groups
