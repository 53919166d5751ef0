"""Forced acceptance: speculative decoding's system cost at a set acceptance, on any weights.

For benchmarks only. A verify step normally accepts the drafts the target agrees with; here each
request accepts draft j with probability p given it accepted the ones before (drawn from a seeded
generator), whatever the target says, and then adds the target's own greedy token at the first
position not accepted, as a real verify step would. The engine's bookkeeping is exactly that of real
speculation with that acceptance: the accepted drafts' K/V and (hybrid) states are the ones the verify
forward computed for them, the rest rolls back, and an MTP drafter extends over the accepted tokens. Only
the text differs from the target's greedy output, which on random weights has no meaning anyway (and
which random weights make too fragile to serve as an oracle: near-tied logits follow kernel rounding).
Results produced with it are SYNTHETIC.
"""

from __future__ import annotations

import random


class ForcedAcceptance:
    def __init__(self, acceptance: float, seed: int) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.acceptance = acceptance
        self._rng = random.Random(seed)

    def num_accepted(self, num_drafts: int) -> int:
        """Leading drafts accepted out of `num_drafts`: a truncated geometric draw."""
        accepted = 0
        while accepted < num_drafts and self._rng.random() < self.acceptance:
            accepted += 1
        return accepted
