"""Overlapped decode (`--overlap-decode`): a decode step is launched before the previous step's tokens
reach the host, so the host's scheduling, batch building and bookkeeping run while the device computes.

The synchronous step is: schedule, build the batch, replay, sample, read the tokens back (the device goes
idle), book them. With overlap, step k's forward reads step k - 1's sampled tokens on the device: each
request whose input is still there holds a placeholder (`PLACEHOLDER`) in `output_token_ids`, so its
positions, slots and pages follow as if the token were known, and its row's input id is copied from the
previous step's token tensor on the device before the replay. Then step k - 1's tokens are read back (the
device is busy with step k meanwhile), their placeholders replaced, and they are booked as the synchronous
step books them: stop tokens, stop strings, max tokens, finish.

A request that finished at step k - 1 has had its token t(k-1) computed by step k: a real token of its
sequence, so the K/V and state that step k writes are valid for its whole prefix, and the scheduler counted
it (`after_forward` at the launch), so what the finish caches is consistent; step k's token for it is
dropped (its placeholder removed at the finish). The caching, any reuse of its pages and slots, and host
backups are queued after step k on the device (copy rule 3's event for backups).

Which steps overlap (`Engine._overlappable`): every running request decoding one token with sampling that
reads only its logits and its own generator (greedy or sampled; no penalties, logit bias, grammar or
logprobs, whose host state or output needs the previous token), nothing waiting, no speculative decoding,
one rank, and free pages for every decode (so the step retracts nobody). Any other step first reads back
the pending tokens (`Engine._resolve_pending`) and runs as before. The tokens come from the synchronous
sampler's code (`sampler.device_tokens`), each request drawing once a step from its own generator as
before, so the answers are the same tokens, seeded sampling included; the only difference a client sees
is that a step's outputs arrive one step later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from morion.engine.request import Request
from morion.engine.sampler import reads_only_logits
from morion.runner.forward_batch import ForwardBatch
from morion.runner.host_to_device import ToHost, to_device

# A token still on the device. Never a vocabulary id; never packed into a cache key (a request is only
# cached by a finish, after its placeholders are replaced or removed).
PLACEHOLDER = -1


@dataclass
class PendingTokens:
    """A launched decode step's tokens, on their way to the host: request i's token goes to
    `requests[i].output_token_ids[positions[i]]` (its placeholder)."""

    requests: list[Request]
    positions: list[int]
    tokens: torch.Tensor  # [n] int64 on the device, in `requests` order
    host: ToHost
    _rows: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rows = {id(request): row for row, request in enumerate(self.requests)}

    def row_of(self, request: Request) -> int | None:
        """The index of `request`'s token in `tokens`, where that token is the request's next input."""
        row = self._rows.get(id(request))
        if row is None or len(request.prompt_token_ids) + self.positions[row] != request.num_computed:
            return None
        return row


def eligible(request: Request) -> bool:
    """Whether a request's next decode step may read its last token on the device: its sampling reads
    only its logits and its own generator (greedy or sampled; no penalty, logit bias or grammar, whose
    host state needs the last token), and it wants no logprobs (read back with the tokens)."""
    params = request.params
    return reads_only_logits(request.sampler) and params.logprobs is None and request.prompt_logprobs is None


def patch_input_ids(batch: ForwardBatch, requests: list[Request], pending: PendingTokens | None) -> None:
    """Copies, on the device, the pending step's token into each row of `batch` (one new token per
    request, in `requests` order) whose input is still a placeholder. No host sync: the row indices go
    up pinned, in one copy."""
    if pending is None:
        return
    rows, sources = [], []
    for row, request in enumerate(requests):
        source = pending.row_of(request)
        if source is not None:
            rows.append(row)
            sources.append(source)
    if not rows:
        return
    device = batch.input_ids.device
    if rows == sources and len(rows) == batch.input_ids.shape[0] == pending.tokens.shape[0]:
        batch.input_ids.copy_(pending.tokens)  # the steady state: the same requests in the same order
        return
    rows_t, sources_t = to_device([np.asarray(rows, np.int64), np.asarray(sources, np.int64)], device)
    batch.input_ids.index_copy_(0, rows_t, pending.tokens.index_select(0, sources_t))
