"""The device memory piecewise prefill graphs take, reserved before the K/V pool is sized, and the default
buckets a device affords.

A piecewise prefill graph set (runner/prefill_graph.py) keeps one private memory pool that holds its
largest bucket's activations (every piece's outputs stay alive across the eager calls between pieces),
plus the bridges those calls read and write. Measured on the H200, as a multiple of the eager warm-up
forward's activation peak scaled to the largest bucket (the peak grows with the tokens): the 80B preset's
graphs up to 4,096 tokens took 2.74 GiB where its 4,096-token peak was 0.65 GiB (4.2x); Flash-Next's up to
2,048 took 2.16 GiB where its 4,096-token peak was 0.95 GiB (4.5x). The reserve used to be 1.5x: the 80B's
graphs then fitted into the share of free memory the pool leaves (`mem_fraction`), while Flash-Next's up to
4,096 tokens (about 4.3 GiB, where 4.4 GiB were free after its pool) ran out of memory at capture and every
prefill ran eagerly (session 19). GRAPH_MEMORY_FACTOR is those measurements rounded up.

The defaults (config.DEFAULT_PREFILL_GRAPH_TOKENS and the chunk size) are what the graphs speed up most
on a device with room to spare; on one that the weights nearly fill, the largest buckets' graphs would
take the K/V pool's memory. So default buckets are kept only while their graphs take at most
DEFAULT_BUCKETS_SHARE of the memory free after the weights and the activations: Flash-Next's FP8 weights
on the H200 leave ~15 GiB, which affords graphs up to 2,048 tokens (~2.4 GiB) and not 4,096 (~4.8 GiB).
Buckets given with --prefill-graph-tokens are always captured, their memory reserved all the same.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from morion.config import EngineConfig

GRAPH_MEMORY_FACTOR = 5.0
DEFAULT_BUCKETS_SHARE = 0.2


def graph_memory_bytes(peak_bytes: int, peak_tokens: int, largest_bucket: int) -> int:
    """The memory graphs with buckets up to `largest_bucket` take, estimated from an eager forward's
    activation peak of `peak_tokens` tokens."""
    return int(peak_bytes * largest_bucket / peak_tokens * GRAPH_MEMORY_FACTOR)


def affordable_buckets(
    buckets: Sequence[int], peak_bytes: int, peak_tokens: int, room_bytes: int
) -> tuple[int, ...]:
    """The buckets (increasing) whose graphs, all of them up to that bucket, take at most
    DEFAULT_BUCKETS_SHARE of `room_bytes` (the memory free after the weights and the activation reserve):
    a prefix of `buckets`, since the estimate grows with the largest bucket."""
    budget = room_bytes * DEFAULT_BUCKETS_SHARE
    return tuple(b for b in buckets if graph_memory_bytes(peak_bytes, peak_tokens, b) <= budget)


def affordable_default_buckets(config: EngineConfig, peak: int, tokens: int, room: int) -> EngineConfig:
    """`config` with its default prefill graph buckets cut to those whose graphs take at most
    DEFAULT_BUCKETS_SHARE of `room` (the memory free after the weights and the activations); buckets
    given with --prefill-graph-tokens stay as they are."""
    if config.prefill_graph_tokens is not None:
        return config
    buckets = config.prefill_graph_buckets
    kept = affordable_buckets(buckets, peak, tokens, room)
    if kept == buckets:
        return config
    dropped = buckets[len(kept)]
    which = f"for token buckets {', '.join(map(str, kept))} only" if kept else "off"
    print(
        f"morion: piecewise prefill graphs {which}: graphs up to {dropped} tokens would take "
        f"~{graph_memory_bytes(peak, tokens, dropped) / 2**30:.2f} GiB, more than "
        f"{DEFAULT_BUCKETS_SHARE:.0%} of the {room / 2**30:.2f} GiB free after the weights and "
        "activations, which the K/V pool keeps (--prefill-graph-tokens sets the buckets)",
        file=sys.stderr,
    )
    return dataclasses.replace(config, prefill_graph_tokens=kept)
