"""Batched token sampling for requests with different sampling parameters.

Per step: penalties → logit bias → grammar mask → greedy argmax for greedy requests → temperature → top-k →
top-p → min-p → draw. A batch of plain greedy requests (nothing alters their logits) takes every row's
argmax at once. Tokens and their logprobs come back to the host in one transfer.
The masks are computed for the whole batch at once; each request draws with its own generator, so a
seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from morion.engine.grammar import GrammarMatcher, apply_grammar_masks
from morion.engine.sampling_params import SamplingParams

# Cumulative sums of fp32 probabilities over a large vocabulary drift by ~1e-6; a set whose true mass is
# exactly top_p must still count as reaching it, or top-p keeps one token too many.
_TOP_P_TOLERANCE = 1e-6


class RequestSampler:
    """Sampling state of one request: its parameters, its generator and the token counts for penalties.

    Counts are sparse and kept only when a penalty is set: the prompt's distinct token ids (for the
    repetition penalty) and the distinct generated ids with their counts, in growable host arrays so that
    a step gathers a batch's counts with one concatenation rather than a Python loop over tokens.
    `grammar` is the request's matcher when its output is constrained; `append` advances it.
    """

    def __init__(
        self, params: SamplingParams, prompt_token_ids: Sequence[int], grammar: GrammarMatcher | None = None
    ) -> None:
        self.params = params
        self.grammar = grammar
        self.seed = params.seed if params.seed is not None else _fresh_seed()
        self._counts_outputs = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self._prompt_ids = (
            torch.unique(torch.as_tensor(list(prompt_token_ids), dtype=torch.long))
            if params.repetition_penalty != 1.0
            else None
        )
        self._prompt_ids_device: torch.Tensor | None = None
        self._slot_of: dict[int, int] = {}  # generated token id -> its index in the two arrays below
        self._output_ids = np.empty(16, dtype=np.int64)
        self._output_counts = np.empty(16, dtype=np.float32)
        self._generator: torch.Generator | None = None

    def append(self, token_id: int) -> None:
        """Record a generated token for the grammar and the penalties."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if not self._counts_outputs:
            return
        slot = self._slot_of.get(token_id)
        if slot is None:
            slot = self._slot_of[token_id] = len(self._slot_of)
            if slot == len(self._output_ids):
                self._output_ids = np.resize(self._output_ids, 2 * slot)
                self._output_counts = np.resize(self._output_counts, 2 * slot)
            self._output_ids[slot] = token_id
            self._output_counts[slot] = 0
        self._output_counts[slot] += 1

    @property
    def output_ids(self) -> np.ndarray:
        """Distinct generated token ids (a view; empty when no penalty is set)."""
        return self._output_ids[: len(self._slot_of)]

    @property
    def output_counts(self) -> np.ndarray:
        """How often each of `output_ids` was generated (a view)."""
        return self._output_counts[: len(self._slot_of)]

    def distribution(self, scores: torch.Tensor) -> torch.Tensor:
        """Rows of fp32 `scores` as the distribution this request draws from (`sampling_probs`): what
        rejection sampling of speculative drafts keeps (spec/rejection.py)."""
        return sampling_probs(scores, [self.params] * scores.shape[0])

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's generator, created and seeded on first use; a request samples on one device."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        elif self._generator.device != device:
            raise RuntimeError(f"request sampler moved from {self._generator.device} to {device}")
        return self._generator

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        """Distinct prompt token ids on `device` (only valid when a repetition penalty is set)."""
        assert self._prompt_ids is not None
        if self._prompt_ids_device is None or self._prompt_ids_device.device != device:
            self._prompt_ids_device = self._prompt_ids.to(device)
        return self._prompt_ids_device


class SampleResult(NamedTuple):
    """One step's result, one entry per request in batch order.

    `logprobs` and `top_logprobs` are None unless some request in the batch set `logprobs`. When present,
    `logprobs[i]` is the chosen token's logprob for every request (it is cheap), and `top_logprobs[i]` holds
    `params.logprobs` (token id, logprob) pairs sorted by logprob, highest first — an empty list for
    requests with `logprobs` None or 0. Logprobs are the log-softmax of the raw logits, before penalties
    and temperature.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def committed_token(token: int, logprobs: torch.Tensor | None, params: SamplingParams) -> SampleResult:
    """A token committed by a speculative verify as the sampler would report it: `logprobs` the
    log-softmax of the raw logits at its row [V], for a request that asked for logprobs."""
    if logprobs is None:
        return SampleResult([token], None, None)
    top_n = min(params.logprobs or 0, logprobs.shape[-1])
    values, ids = logprobs.topk(top_n) if top_n else (logprobs[:0], logprobs[:0].long())
    top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampleResult([token], [float(logprobs[token])], [top])


def sample(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (any float dtype, any device); `logits` is not modified."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(samplers)} samplers")
    if not samplers:
        return SampleResult([], None, None)
    scores = logits.to(torch.float32, copy=True)
    want_logprobs = any(s.params.logprobs is not None for s in samplers)
    raw_logprobs = scores.log_softmax(dim=-1) if want_logprobs else None
    if all(plain_greedy(s) for s in samplers):
        # Nothing alters the scores: every row's argmax at once, without the row-index tensors of
        # `_sample_rows`, each a host-to-device copy that can wait for the decode graph before the step's
        # last kernels launch.
        token_ids = greedy_tokens(scores)
    else:
        token_ids = _sample_rows(scores, samplers)
    if raw_logprobs is None:
        return SampleResult(token_ids.tolist(), None, None)
    return _with_logprobs(raw_logprobs, token_ids, samplers)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [B] on the logits' device (the lowest id among equal maxima): the token of a
    plain greedy request."""
    return logits.argmax(dim=-1)


def device_tokens(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """`sample`'s tokens [B], left on the logits' device (no host sync): for requests whose sampling
    reads nothing of their earlier tokens on the host (`reads_only_logits`), as an overlapped decode step
    samples them (engine/overlap.py). The same tokens as `sample`: the same code on the same scores."""
    if all(plain_greedy(s) for s in samplers):
        return greedy_tokens(logits)
    return _sample_rows(logits.to(torch.float32, copy=True), samplers)


def reads_only_logits(sampler: RequestSampler) -> bool:
    """Its token depends on its logits and its own generator alone: no penalty (they count its earlier
    tokens), logit bias or grammar."""
    params = sampler.params
    return (
        params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
        and sampler.grammar is None
    )


def plain_greedy(sampler: RequestSampler) -> bool:
    """Greedy with nothing that alters its scores: its token is the argmax of its logits alone."""
    return sampler.params.greedy and reads_only_logits(sampler)


def _sample_rows(scores: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """Penalties, logit bias and grammar masks applied to fp32 `scores` in place, then each row's token."""
    device = scores.device
    apply_penalties(scores, samplers)
    apply_logit_bias(scores, samplers)
    if any(s.grammar is not None for s in samplers):
        apply_grammar_masks(scores, [s.grammar for s in samplers])
    token_ids = torch.empty(len(samplers), dtype=torch.long, device=device)
    greedy_rows = [i for i, s in enumerate(samplers) if s.params.greedy]
    random_rows = [i for i, s in enumerate(samplers) if not s.params.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        token_ids[rows] = scores[rows].argmax(dim=-1)
    if random_rows:
        rows = torch.tensor(random_rows, device=device)
        chosen = [samplers[i] for i in random_rows]
        token_ids[rows] = _draw(sampling_probs(scores[rows], [s.params for s in chosen]), chosen)
    return token_ids


def apply_penalties(scores: torch.Tensor, samplers: Sequence[RequestSampler]) -> None:
    """Apply repetition, presence and frequency penalties to fp32 `scores` [B, V] in place.

    Repetition (HF/vLLM): a logit of a token seen in the prompt or the output is divided by the penalty
    when positive and multiplied by it otherwise. Presence and frequency (OpenAI): a logit of a token
    generated c > 0 times is lowered by presence_penalty + c * frequency_penalty.
    """
    rows = [i for i, s in enumerate(samplers) if s.params.repetition_penalty != 1.0]
    if rows:
        _apply_repetition_penalty(scores, rows, [samplers[i] for i in rows])
    rows = [
        i
        for i, s in enumerate(samplers)
        if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0) and len(s.output_ids)
    ]
    if rows:
        _apply_output_penalties(scores, rows, [samplers[i] for i in rows])


def apply_logit_bias(scores: torch.Tensor, samplers: Sequence[RequestSampler]) -> None:
    """Adds each request's `logit_bias` to its row of fp32 `scores` [B, V] in place."""
    entries = [(row, token, bias) for row, s in enumerate(samplers) for token, bias in s.params.logit_bias]
    if not entries:
        return
    rows, tokens, biases = zip(*entries, strict=True)
    device = scores.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    scores.index_put_(index, torch.tensor(biases, dtype=scores.dtype, device=device), accumulate=True)


def _apply_repetition_penalty(scores: torch.Tensor, rows: list[int], samplers: list[RequestSampler]) -> None:
    device = scores.device
    prompt_ids = [s.prompt_ids(device) for s in samplers]
    output_ids = [s.output_ids for s in samplers]
    cols = torch.cat([*prompt_ids, torch.from_numpy(np.concatenate(output_ids)).to(device)])
    owner = torch.cat(
        [_owners([len(ids) for ids in prompt_ids], device), _owners([len(ids) for ids in output_ids], device)]
    )
    penalty = torch.tensor([s.params.repetition_penalty for s in samplers], device=device)[owner]
    rows_t = torch.tensor(rows, device=device)[owner]
    # A token in both prompt and output appears twice in (rows_t, cols); both writes carry the same value
    # computed from the unpenalised logit, so it is penalised exactly once.
    seen = scores[rows_t, cols]
    scores[rows_t, cols] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_output_penalties(scores: torch.Tensor, rows: list[int], samplers: list[RequestSampler]) -> None:
    device = scores.device
    cols = torch.from_numpy(np.concatenate([s.output_ids for s in samplers])).to(device)
    counts = torch.from_numpy(np.concatenate([s.output_counts for s in samplers])).to(device)
    owner = _owners([len(s.output_ids) for s in samplers], device)
    presence = torch.tensor([s.params.presence_penalty for s in samplers], device=device)[owner]
    frequency = torch.tensor([s.params.frequency_penalty for s in samplers], device=device)[owner]
    rows_t = torch.tensor(rows, device=device)[owner]
    scores[rows_t, cols] -= presence + counts * frequency


def _owners(lengths: list[int], device: torch.device) -> torch.Tensor:
    """k repeated lengths[k] times: which request each entry of a concatenation of per-request parts is."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.tensor(lengths, dtype=torch.long, device=device),
        output_size=sum(lengths),
    )


def sampling_probs(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution [b, V] that non-greedy rows draw from: temperature, top-k, top-p, min-p.

    `scores` are fp32 penalised logits, one row per entry of `params`. Each row's result depends only on
    that row and its params, not on the other rows.
    """
    device, vocab = scores.device, scores.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    # Shifting by the row max first keeps a tiny temperature from overflowing to inf.
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature

    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
        # top_p == 1 must drop nothing, however the fp32 cumulative sum rounds, or a row's result would
        # depend on whether another row in the batch needed this sort.
        top_p = torch.tensor(
            [p.top_p - _TOP_P_TOLERANCE if p.top_p < 1.0 else math.inf for p in params], device=device
        )
        # Stable, so equal scores rank by token id and the kept set is deterministic.
        sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device)
        drop = rank >= top_k.unsqueeze(1)
        sorted_scores.masked_fill_(drop, -math.inf)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # the best token always stays, even for a top_p below the tolerance
        sorted_scores.masked_fill_(drop, -math.inf)
        scores = scores.scatter(-1, order, sorted_scores)

    if any(p.min_p > 0.0 for p in params):
        # The best score is 0 here (shifted above, never masked), so p < min_p * p_max is
        # score < log(min_p); log(0) = -inf drops nothing.
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device
        )
        scores.masked_fill_(scores < log_min_p.unsqueeze(1), -math.inf)
    return scores.softmax(dim=-1)


def _draw(probs: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """One token per row, with probability `probs`, each row from its own generator.

    argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i / sum(p) (the exponential
    race), and needs no cumulative sum or sort.
    """
    noise = torch.empty_like(probs)
    for row, s in enumerate(samplers):
        noise[row].exponential_(generator=s.generator(probs.device))
    # exponential_ may return exactly 0; 0/0 would be NaN, which argmax treats as the maximum.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _with_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, samplers: Sequence[RequestSampler]
) -> SampleResult:
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    # Token ids and fp32 logprobs are both exact in float64: the step's tokens and their logprobs come back
    # in one device-to-host transfer (one wait for the device), not two.
    ids_and_logprobs = torch.stack((token_ids.to(torch.float64), chosen.to(torch.float64))).tolist()
    tokens = [int(token) for token in ids_and_logprobs[0]]
    wanted = [s.params.logprobs or 0 for s in samplers]
    top_n = min(max(wanted), logprobs.shape[-1])
    if top_n == 0:
        return SampleResult(tokens, ids_and_logprobs[1], [[] for _ in samplers])
    values, ids = logprobs.topk(top_n, dim=-1)
    values_list, ids_list = values.tolist(), ids.tolist()
    top = [list(zip(ids_list[i][:n], values_list[i][:n], strict=True)) for i, n in enumerate(wanted)]
    return SampleResult(tokens, ids_and_logprobs[1], top)


def _fresh_seed() -> int:
    # Drawn from torch's default generator so that torch.manual_seed makes unseeded requests repeatable.
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.long).item())
