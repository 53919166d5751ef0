"""A drafter whose proposals come from one drafter while another runs for its cost.

For benchmarks on random weights: the synthetic drafter (`spec/synthetic.py`) sets the acceptance, the
MTP drafter runs exactly as it would (its extend and chained steps, its K/V writes), so a measured
speed includes the draft head's cost — "through the MTP-shaped path". Its tokens are discarded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from morion.spec.drafter import Drafter, DraftRequest, Drafts, HiddenStateDrafter


class CostShapedDrafter:
    def __init__(self, proposer: Drafter, cost: HiddenStateDrafter) -> None:
        self.name = f"{proposer.name} (through the {cost.name} path)"
        self._proposer = proposer
        self._cost = cost

    def observe(self, request: DraftRequest, start: int, hidden: torch.Tensor) -> None:
        self._cost.observe(request, start, hidden)

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        self._cost.propose(requests, width)
        return self._proposer.propose(requests, width)

    def release(self, request_id: str) -> None:
        self._cost.release(request_id)
        self._proposer.release(request_id)
