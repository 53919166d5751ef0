"""A request as the engine tracks it: tokens, sampling state, and the cache resources it holds."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum

from morion.cache.page_keys import ROOT_KEY
from morion.cache.radix_cache import TOKEN_TYPECODE
from morion.engine.outputs import PromptLogprob
from morion.engine.sampler import RequestSampler
from morion.engine.sampling_params import SamplingParams
from morion.engine.stop import StopStringMatcher
from morion.engine.thread_times import ThreadTimes
from morion.multimodal.prompt_images import PromptImages
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
    added_at: float = 0.0  # time.perf_counter() at Engine.add_request
    admitted_at: float | None = None  # at its first admission (scheduler), for FirstTokenTimes
    # The stepping thread's scheduler times then (engine/thread_times.py; None off Linux), for the same.
    admitted_thread: ThreadTimes | None = None
    first_token_reported: bool = False  # its FirstTokenTimes went out in a StepOutput
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
    # The root of its key chain: page_keys.chain_root(params.cache_salt). Its page keys start there, and
    # the radix tree matches it only against requests of the same chain.
    chain_root: bytes = ROOT_KEY
    page_keys: list[bytes] = field(default_factory=list)  # content keys of its first full pages (tiers)
    # Its first cache ids (`cache_token_ids`) packed as uint64, what the radix cache matches on
    # (`packed_token_ids`).
    packed_tokens: array = field(default_factory=lambda: array(TOKEN_TYPECODE), repr=False)
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
    images: PromptImages | None = None  # the prompt's images (models with a vision tower)
    # The vision tower's output per image (index into images), from the first forward that needs an image
    # until its tokens are all computed (engine/image_batch.py).
    image_embeds: dict[int, object] = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def packed_token_ids(self, num_tokens: int) -> array:
        """The first `num_tokens` of `cache_token_ids` as `array("Q")`. Tokens are only ever appended, so
        the packed copy grows by the new ones: a long prompt is packed once, not at every prefill chunk."""
        packed = self.packed_tokens
        prompt = self.prompt_token_ids if self.images is None else self.images.cache_ids
        if len(packed) < min(num_tokens, len(prompt)):
            packed.extend(prompt[len(packed) : num_tokens])
        if len(packed) < num_tokens:
            packed.extend(self.output_token_ids[len(packed) - len(prompt) : num_tokens - len(prompt)])
        return packed[:num_tokens]

    @property
    def cache_token_ids(self) -> list[int]:
        """What the prefix cache (radix tree, host and disk page keys) keys the request by: its token ids,
        with each image token replaced by an id derived from its image's content hash."""
        if self.images is None:
            return self.token_ids
        return self.images.cache_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
