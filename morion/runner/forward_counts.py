"""How a model runner's forwards ran: per kind of forward, whether a CUDA graph replayed it or it ran
eagerly. The server exports the counts (`morion_engine_forwards_total{kind, path}`, server/metrics.py), so
an operator sees what share of the served forwards the graphs cover: a decode batch larger than the largest
decode graph, a prefill chunk larger than the largest prefill bucket, or several prompt tails in one short
forward run eagerly, and a failed capture leaves a whole kind eager."""

from __future__ import annotations

from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS

# decode: one new token per sequence; short: 2 to SHORT_CHUNK_TOKENS (a prompt's tail); prefill: longer
# chunks (engine/forward_groups.py); verify: a speculative verify forward.
FORWARD_KINDS = ("decode", "short", "prefill", "verify")
FORWARD_PATHS = ("graph", "eager")


def forward_kind(max_query_len: int) -> str:
    """The kind of a step's forward (not a verify) from its longest sequence's new tokens."""
    if max_query_len == 1:
        return "decode"
    return "short" if max_query_len <= SHORT_CHUNK_TOKENS else "prefill"


class ForwardCounts:
    def __init__(self) -> None:
        self._counts = {(kind, path): 0 for kind in FORWARD_KINDS for path in FORWARD_PATHS}

    def record(self, kind: str, path: str) -> None:
        self._counts[kind, path] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """(kind, path) -> forwards so far, every pair present."""
        return dict(self._counts)
