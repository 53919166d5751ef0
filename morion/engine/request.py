"""A request as the engine tracks it: tokens, sampling state, and the cache resources it holds."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum

from morion.engine.outputs import PromptLogprob
from morion.engine.sampler import RequestSampler
from morion.engine.sampling_params import SamplingParams
from morion.engine.stop import StopStringMatcher
from morion.text.detokenizer import IncrementalDetokenizer


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Invariants while RUNNING:
    - `pages[i]` holds the K/V of tokens [i * page_size, (i + 1) * page_size) of `token_ids`; pages cover
      at least the first `num_computed` tokens, and every remaining prompt token (reserved at admission).
    - `owned_pages` are the pages this request must free; the rest of `pages` belong to the prefix cache
      and stay alive because `prefix_node` is locked.
    - The K/V of `token_ids[:num_computed]` is in the pages (pages restored from the host tier this step:
      once the step's forward has waited for their copies); the last sampled token is never computed yet.
    - `state_slot` holds the model's per-request state after exactly `num_computed` tokens (likewise).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampler: RequestSampler
    max_new_tokens: int
    arrival: int
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStringMatcher | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    pages: list[int] = field(default_factory=list)
    owned_pages: set[int] = field(default_factory=set)
    prefix_node: object | None = None
    state_slot: int | None = None  # working per-request state (models with state components)
    boundary_slot: int | None = None  # copy of the state at `boundary_position`, the last page boundary
    boundary_position: int = 0
    # Speculative decoding: slots for the states after each draft token of a verify forward (column t + 1
    # of `verify_slots`); held while running, swapped with `state_slot` when drafts are accepted.
    draft_slots: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_once: bool = False
    page_keys: list[bytes] = field(default_factory=list)  # content keys of its first full pages (tiers)
    # Its first tokens packed as uint32, what the radix cache matches on (`packed_token_ids`).
    packed_tokens: array = field(default_factory=lambda: array("I"), repr=False)
    prefetch_rounds: int = 0  # disk prefetches it started since it was last admitted
    tier_wait_started: float | None = None  # when the first of them began (restore latency counts it)
    text: str = ""
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With params.prompt_logprobs: entry i is prompt token i's (logprob, top alternatives) given the tokens
    # before it; entry 0 stays None (nothing predicts the first token).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    prompt_logprobs_reported: bool = False  # in a StepOutput already (they go out once)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def packed_token_ids(self, num_tokens: int) -> array:
        """The first `num_tokens` token ids as `array("I")`. Tokens are only ever appended, so the packed
        copy grows by the new ones: a long prompt is packed once, not at every prefill chunk."""
        packed = self.packed_tokens
        prompt = self.prompt_token_ids
        if len(packed) < min(num_tokens, len(prompt)):
            packed.extend(prompt[len(packed) : num_tokens])
        if len(packed) < num_tokens:
            packed.extend(self.output_token_ids[len(packed) - len(prompt) : num_tokens - len(prompt)])
        return packed[:num_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
