"""Where the scheduler cuts a prompt's prefill: at multiples of the alignment unit counted from token 0 and
at the tail, for the request alone, whatever else the step runs (decodes, other prefills). The cut points
decide the bits of the prefix state a prompt leaves in the cache tiers, so they must not depend on company.
"""

from __future__ import annotations

import torch

from morion.cache import CacheSpec, PagePool, RadixCache, StateComponent, StateSlots, TokenComponent
from morion.engine.request import Request
from morion.engine.sampler import RequestSampler
from morion.engine.sampling_params import SamplingParams
from morion.engine.scheduler import Scheduler

PAGE = 8
CHUNK = 64
PARAMS = SamplingParams(temperature=0.0)
SPEC = CacheSpec(
    PAGE,
    (TokenComponent("kv", 1, (1, 1, 2), torch.float32),),
    (StateComponent("ssm", 1, (2, 2), torch.float32),),
)


class Steps:
    """A scheduler over a small state model's cache, stepped as the engine does without a model: every
    scheduled chunk is computed, and a request whose last token ran samples one more (so it decodes)."""

    def __init__(self, chunk_size: int = CHUNK) -> None:
        pool = PagePool(SPEC, 256)
        self.scheduler = Scheduler(RadixCache(pool, StateSlots(SPEC, 32)), chunk_size, 16)
        self.arrivals = 0
        self.pieces: dict[str, list[int]] = {}  # per request: num_computed after each prefill piece

    def add(self, name: str, prompt: list[int]) -> Request:
        request = Request(name, prompt, PARAMS, RequestSampler(PARAMS, prompt), 1000, self.arrivals)
        self.arrivals += 1
        self.pieces[name] = []
        self.scheduler.add(request)
        return request

    def step(self) -> list[tuple[str, int]]:
        chunks = self.scheduler.schedule()
        for request, num_tokens in chunks:
            decodes = request.num_uncomputed == 1 and request.output_token_ids
            self.scheduler.after_forward(request, num_tokens)
            if not decodes:
                self.pieces[request.request_id].append(request.num_computed)
            if request.num_uncomputed == 0:
                request.output_token_ids.append(1)
        return [(request.request_id, num_tokens) for request, num_tokens in chunks]

    def run_until_decoding(self, request: Request) -> None:
        while not request.output_token_ids:
            self.step()


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(length)]


def test_a_prompt_is_cut_the_same_alone_beside_decodes_and_beside_other_prefills() -> None:
    prompt = _prompt(1, 200)  # units end at 64, 128, 192; the tail is 192..200
    alone = Steps()
    alone.run_until_decoding(alone.add("p", prompt))
    assert alone.pieces["p"] == [64, 128, 192, 200]

    beside_decodes = Steps()
    decoding = [beside_decodes.add(f"d{i}", _prompt(10 + i, 5 + i)) for i in range(3)]
    beside_decodes.step()  # their prefills: from here on they decode, 3 tokens of every step's budget
    assert all(r.output_token_ids for r in decoding)
    beside_decodes.run_until_decoding(beside_decodes.add("p", prompt))
    assert beside_decodes.pieces["p"] == alone.pieces["p"]  # the old rule cut at 56 (61 tokens left)

    beside_prefills = Steps()
    other = beside_prefills.add("o", _prompt(2, 100))  # first in line: 64, then 96 and its tail
    beside_prefills.run_until_decoding(beside_prefills.add("p", prompt))
    beside_prefills.run_until_decoding(other)
    assert beside_prefills.pieces["o"] == [64, 96, 100]
    assert beside_prefills.pieces["p"] == alone.pieces["p"]


def test_the_first_prefill_piece_runs_whole_while_decodes_use_the_budget() -> None:
    steps = Steps()
    for i in range(3):
        steps.add(f"d{i}", _prompt(10 + i, 5))
    steps.step()
    steps.add("p", _prompt(1, 200))
    step = steps.step()
    assert step == [("d0", 1), ("d1", 1), ("d2", 1), ("p", CHUNK)]  # 67 tokens: one over per decode
    # Pieces after the first run while they fit what is left: none is left here, so "q" waits to be
    # admitted; once admitted with too little left, it is computed from the next step on, whole.
    decodes = [("d0", 1), ("d1", 1), ("d2", 1)]
    q = steps.add("q", _prompt(3, 200))
    assert steps.step() == [*decodes, ("p", CHUNK)]
    assert steps.step() == [*decodes, ("p", CHUNK)]
    assert q.num_computed == 0 and q not in steps.scheduler.running
    assert steps.step() == [*decodes, ("p", 8)]  # its tail: 53 tokens left, "q"'s piece is 64
    assert q in steps.scheduler.running and q.num_computed == 0
    assert steps.step() == [*decodes, ("p", 1), ("q", CHUNK)]


def test_a_prefix_hit_that_ends_mid_unit_runs_up_to_the_next_multiple_first() -> None:
    steps = Steps()
    shared = _prompt(4, 40)
    first = steps.add("first", [*shared, 7])  # 41 tokens: the tail's snapshot at 40 is cached
    steps.run_until_decoding(first)
    steps.scheduler.finish(first, "stop")
    hit = steps.add("hit", [*shared, *_prompt(5, 160)])  # 200 tokens
    steps.run_until_decoding(hit)
    assert hit.num_cached_tokens == 40
    assert steps.pieces["hit"] == [64, 128, 192, 200]


def test_the_unit_is_the_chunk_size_floored_to_whole_pages() -> None:
    steps = Steps(chunk_size=70)  # unit 64
    steps.run_until_decoding(steps.add("p", _prompt(1, 150)))
    assert steps.pieces["p"] == [64, 128, 144, 150]
