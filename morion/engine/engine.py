"""The engine: requests in, batched forwards per step, tokens out. Single-threaded and synchronous;
`morion.LLM` drives it in-process, the server from its own process (server/engine_process.py).

This module is the step loop and the finish rules. What an engine is made of, and in which order it is
built, is `engine/assembly.py`; the forwards (CUDA graph or eager) are the model runner's
(runner/model_runner.py); speculative decoding is `spec/speculative.py`, which returns the tokens a
verify accepted for the loop to commit.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from morion.cache.cache_memory import storage_resident_bytes
from morion.cache.copy_engine import Transfer
from morion.cache.page_keys import chain_root
from morion.cache.radix_cache import TOKEN_TYPECODE
from morion.cache.tier_stats import CacheStats
from morion.config import EngineConfig
from morion.engine.assembly import assemble
from morion.engine.forward_groups import FORWARD_GROUP_MAX_TOKENS, forward_groups
from morion.engine.grammar import GrammarRuntime
from morion.engine.outputs import (
    EngineLoad,
    FirstTokenTimes,
    RequestOutput,
    StepOutput,
    Usage,
    internal_error,
)
from morion.engine.overlap import PLACEHOLDER, PendingTokens, patch_input_ids
from morion.engine.overlap import eligible as overlap_eligible
from morion.engine.prompt_logprobs import record_prompt_logprobs
from morion.engine.ranks import Ranks, rank_config
from morion.engine.request import Request
from morion.engine.sampler import RequestSampler, SampleResult, committed_token, device_tokens, sample
from morion.engine.sampling_params import SamplingParams
from morion.engine.scheduler import ScheduledChunk
from morion.engine.step_timing import StepTimes
from morion.engine.stop import StopStringMatcher
from morion.engine.thread_times import read_thread_times, split_wall
from morion.errors import InvalidRequestError, MorionError
from morion.loader import LoadedModel
from morion.loader.load import check_tensor_parallel
from morion.multimodal.image_decode import PreparedImage
from morion.multimodal.processing import ImageProcessing
from morion.multimodal.prompt_images import PromptImages
from morion.ops.log_once import log_once
from morion.parallel.group import TensorParallel
from morion.runner.cuda_graph import DecodeGraphRunner
from morion.runner.forward_batch import ForwardBatch, build_forward_batch
from morion.runner.host_to_device import ToHost
from morion.runner.image_batch import ImageChunk, ImageEncoder
from morion.runner.profile_ranges import SAMPLING
from morion.spec.drafter import Drafter
from morion.spec.forced import ForcedAcceptance
from morion.spec.speculative import VerifiedRow
from morion.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("morion.engine")

_PREFETCH_WAIT_S = 0.05  # a step with nothing to run but disk reads in flight waits this long for them


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        drafter: Drafter | None = None,
        forced_acceptance: ForcedAcceptance | None = None,
    ) -> None:
        """`drafter` (e.g. the synthetic drafter of the tests, or a benchmark's) turns speculative decoding
        on with its proposals; without it, `config.speculative` names the drafter. `forced_acceptance`
        (benchmarks only, spec/forced.py) decides how many drafts each verify step accepts.

        With `config.tensor_parallel_size` N > 1 this engine is rank 0: it starts N - 1 follower processes
        (engine/ranks.py), builds its shard of the model and sends them each step's device work."""
        self._ranks: Ranks | None = None
        if config.tensor_parallel_size > 1:
            if loaded is not None or drafter is not None:
                raise MorionError("a tensor-parallel engine loads its model itself, on every rank")
            check_tensor_parallel(config.model, config.load_format, config.tensor_parallel_size)
            self._ranks = Ranks(config)
            config = rank_config(config, 0)
        group, mirror = TensorParallel(), None
        if self._ranks is not None:
            group, mirror = self._ranks.tensor_parallel, self._ranks.mirror
        try:
            parts = assemble(config, loaded, drafter, forced_acceptance, group, mirror)
        except BaseException:
            if self._ranks is not None:
                self._ranks.close()
            raise
        self.config = parts.config  # its --max-running-requests lowered where state slots would not fit
        self.device = config.torch_device
        loaded = parts.loaded
        self.model, self.tokenizer, self.model_path = loaded.model, loaded.tokenizer, loaded.path
        self.kv_scales = parts.kv_scales
        self.pool, self.state_slots = parts.pool, parts.state_slots
        self.runner = parts.runner
        self.speculative = parts.speculative
        self.prefix_cache, self.tiers, self._cache_stats = parts.prefix_cache, parts.tiers, parts.cache_stats
        self.scheduler = parts.scheduler
        self.pool_tokens = parts.pool_tokens
        self.weight_bytes = parts.weight_bytes
        self.max_model_len, self.max_model_len_limit = parts.max_model_len, parts.max_model_len_limit
        self.step_times = StepTimes()  # engine/step_timing.py: where the steps' time goes
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.grammars = GrammarRuntime(self.tokenizer, self.model.config.vocab_size)
        self.image_encoder = self._image_encoder()
        if self.speculative is not None:
            self.speculative.image_encoder = self.image_encoder
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        # Overlapped decode (engine/overlap.py): the launched step whose tokens are not booked yet, and
        # outputs booked outside a step (an abort reads the pending tokens back first) for the next one.
        self._pending: PendingTokens | None = None
        self._ready: list[StepOutput] = []
        self._tier_jobs_retired = True  # this step's `_retire_tier_jobs` ran (or there are no tiers)

    def _image_encoder(self) -> ImageEncoder | None:
        """Models with a vision tower take images; the processor's settings (the model directory's
        preprocessor_config.json, else Qwen3-VL's) must fit the tower's patches."""
        if getattr(self.model, "visual", None) is None:
            return None
        processing = ImageProcessing.for_model(
            self.model_path if Path(str(self.model_path)).is_dir() else None
        )
        vision = self.model.config.vision
        expected = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
        found = (processing.patch_size, processing.merge_size, processing.temporal_patch_size)
        if found != expected:
            raise MorionError(
                f"the image processor's patch, merge and temporal sizes {found} do not fit the vision "
                f"tower's {expected} (preprocessor_config.json of {self.model_path})"
            )
        return ImageEncoder(self.model, processing, self.device)

    @property
    def follower_pids(self) -> list[int]:
        """The process ids of the follower ranks (tensor parallelism; none at one rank)."""
        return self._ranks.pids if self._ranks is not None else []

    @property
    def graphs(self) -> DecodeGraphRunner | None:
        """The decode CUDA graphs (None: decode runs eagerly)."""
        return self.runner.decode_graphs

    @property
    def verify_graphs(self) -> dict[int, DecodeGraphRunner]:
        """Verify CUDA graphs by tokens per sequence (1 + draft width)."""
        return self.runner.verify_graphs

    @property
    def cache_stats(self) -> CacheStats:
        """Hits by tier (device / host / disk), restores, bytes moved, restore latency, checksum failures,
        evictions, tier sizes: live counters with fresh gauges; `.snapshot()` for a copy to send away."""
        if self.tiers is not None:
            self.tiers.refresh_gauges()
        return self._cache_stats

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: Sequence[PreparedImage] = (),
    ) -> str:
        """Queues a request; raises InvalidRequestError (nothing queued) if it can never run. `images`:
        the images whose tokens the prompt holds, in order (each a run of the model's image token id as
        long as the image's token count: multimodal/prompt_images.py)."""
        added_at = time.perf_counter()  # the request's arrival: its checks below count as its queue time
        ids = _token_array(prompt_token_ids)
        prompt = ids.tolist()
        prompt_images = self._prompt_images(prompt, images)
        vocab_size = self.model.config.vocab_size
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        low, high = _id_bounds(ids)
        if low < 0 or high >= vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens, but at most {self.max_model_len - 1} fit "
                f"(max model len {self.max_model_len}, limited by the context and the KV pool)"
            )
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        tokenizer = self.tokenizer
        try:
            grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        except Exception as error:  # a grammar from another tokenizer, or none to match against
            raise InvalidRequestError(f"grammar: {error}") from None
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            sampler=RequestSampler(params, prompt, grammar),
            max_new_tokens=min(params.max_tokens, self.max_model_len - len(prompt)),
            arrival=arrival,
            added_at=added_at,
            detokenizer=IncrementalDetokenizer(tokenizer, prompt) if tokenizer else None,
            stop_matcher=StopStringMatcher(params.stop) if tokenizer else None,
            chain_root=chain_root(params.cache_salt),
        )
        if prompt_images is None:  # the ids as the prefix cache keys them, packed now in one copy
            request.packed_tokens = array(TOKEN_TYPECODE, ids.tobytes())  # never negative: the same bits
        if params.stop and tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model has none")
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
        if bad_bias is not None:
            raise InvalidRequestError(
                f"logit_bias token id {bad_bias} is not in the vocabulary [0, {vocab_size})"
            )
        request.images = prompt_images
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _prompt_images(self, prompt: list[int], images: Sequence[PreparedImage]) -> PromptImages | None:
        encoder = self.image_encoder
        image_token = None if encoder is None else self.model.config.image_tokens.image
        if not images:
            if image_token is not None and image_token in prompt:
                raise InvalidRequestError(f"the prompt holds image tokens (id {image_token}) but no images")
            return None
        if encoder is None:
            raise InvalidRequestError(
                f"this model ({self.model.config.model_type} from {self.model_path}) has no vision tower: "
                "it takes no images"
            )
        if self.config.tensor_parallel_size > 1:  # a follower's forward gets no image rows (step_mirror)
            raise InvalidRequestError("images are not supported with tensor_parallel_size > 1 yet")
        return PromptImages(prompt, images, image_token, encoder.processing.merge_size)

    def abort(self, request_id: str, after_failed_step: bool = False) -> RequestOutput | None:
        """Ends a request. `after_failed_step`: a step raised, and the request's working state may be
        half a forward ahead of its tokens; none of it goes to the prefix cache (a cached copy would make
        every later hit on it a wrong answer)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if self._pending is not None and not after_failed_step:
            # Its placeholders must be tokens before it is cached; the others' tokens go out next step.
            self._ready += self._resolve_pending()
            if request.is_finished:  # it ended on the token just read
                return _final_output(request)
        if after_failed_step:
            self._pending = None  # a failed step's tokens are not to be booked
            _drop_placeholders(request)
        self._finish(request, "abort", working_state_valid=not after_failed_step)
        return _final_output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ready)

    def profiled(self, by_module: bool) -> contextlib.AbstractContextManager[None]:
        """Named profiler ranges over each step's parts while it lasts (runner/profile_ranges.py); with
        `by_module`, the model's parts too, its forwards eager meanwhile (`morion bench --profile`)."""
        return self.runner.profiled(by_module)

    def forward_counts(self) -> dict[tuple[str, str], int]:
        """(kind, path) -> the forwards run so far, replayed from a CUDA graph or eager
        (runner/forward_counts.py)."""
        return self.runner.forwards.snapshot()

    def load(self) -> EngineLoad:
        """Requests running and waiting, and where the pool's pages are, now."""
        scheduler = self.scheduler
        return EngineLoad(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            pages_free=self.pool.num_free,
            pages_cached=self.prefix_cache.cached_pages,
            pages_held=len(scheduler.pages_held_by_requests()),
            retractions=scheduler.num_retractions,
        )

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        self._tier_jobs_retired = self.tiers is None
        outputs, decode = self._step()
        self._retire_tier_jobs()  # where the step launched no forward of its own
        self.step_times.record(decode, time.perf_counter() - started)
        return outputs

    def _retire_tier_jobs(self) -> None:
        """Once a step: the tiers retire their finished copies and disk jobs (unpin host objects, count the
        writes). Called right after the step's first forward is launched, so that the host does it while
        the device computes: after a long prompt, its pages' thousands of disk writes finish over the next
        steps, and retiring them took 1-1.6 ms a step on the CPU, which the next request's admission waited
        for when it came first. The step's backups (`Scheduler.after_forward`) come after it, and so see
        the host rows it unpinned. Before the scheduling only when disk reads are in flight: a waiting
        request is admitted on their results (`_step`)."""
        if not self._tier_jobs_retired:
            self._tier_jobs_retired = True
            self.tiers.poll()

    def _step(self) -> tuple[list[StepOutput], bool]:
        """One step's outputs, and whether it was a decode step (every scheduled request generating, one
        token each: engine/step_timing.py). Under `overlap_decode` a decode step's outputs come with the
        next step (engine/overlap.py)."""
        ready, self._ready = self._ready, []
        if self.tiers is not None and self.tiers.loads_in_flight():
            self._retire_tier_jobs()  # a waiting request may be admitted on a read's result
        if self.config.overlap_decode and self._overlappable():
            chunks = self.scheduler.schedule()
            if chunks:
                return ready + self._overlapped_decode(chunks), True
        if self._pending is not None:
            ready += self._resolve_pending()
        outputs, decode = self._synchronous_step()
        return ready + outputs, decode

    def _synchronous_step(self) -> tuple[list[StepOutput], bool]:
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.waiting and self.tiers is not None and self.tiers.loads_in_flight():
                self.tiers.poll(_PREFETCH_WAIT_S)  # every waiting request waits for disk: let it come
                return [], False
            if self.scheduler.waiting:
                raise RuntimeError(
                    "waiting requests but nothing schedulable: the pool cannot hold one request"
                )
            self.check_integrity()
            return [], False
        decode = all(c.num_tokens == 1 and c.request.output_token_ids for c in chunks)
        outputs: list[StepOutput] = []
        if self.speculative is not None:
            outputs, chunks = self._speculate(chunks)
            if not chunks:
                return outputs, decode
        restores = self.tiers.take_for_forward() if self.tiers is not None else []
        sampling: list[Request] = []
        logit_rows: list[torch.Tensor] = []
        for group in forward_groups(chunks, FORWARD_GROUP_MAX_TOKENS):
            requests, logits = self._forward(group, restores)
            if requests:
                sampling += requests
                logit_rows.append(logits)
        if not sampling:
            return outputs, decode
        logits = logit_rows[0] if len(logit_rows) == 1 else torch.cat(logit_rows)
        return outputs + self._sample(logits, sampling), decode

    # ------------------------------------------------------- overlapped decode
    def _overlappable(self) -> bool:
        """Whether this step may launch before the pending tokens are booked (engine/overlap.py): every
        running request decodes one token with sampling that reads only its logits, nothing waits for
        admission, and the pool has a free page for every decode (so scheduling retracts nobody)."""
        scheduler = self.scheduler
        running = scheduler.running
        return (
            bool(running)
            and not scheduler.waiting
            and self.pool.num_free >= len(running)
            and all(r.num_uncomputed == 1 and r.output_token_ids and overlap_eligible(r) for r in running)
        )

    def _overlapped_decode(self, chunks: list[ScheduledChunk]) -> list[StepOutput]:
        """Launches this decode step, its inputs patched from the pending step's tokens on the device,
        leaves a placeholder for each of its tokens, then books the pending step's tokens."""
        log_once(
            logger, "decode: overlapped steps (each launched before the last one's tokens are read back)"
        )
        requests: list[Request] = []
        token_rows: list[torch.Tensor] = []
        restores = self.tiers.take_for_forward() if self.tiers is not None else []
        for group in forward_groups(chunks, FORWARD_GROUP_MAX_TOKENS):
            group_requests = [c.request for c in group]
            batch = self._batch(group)
            patch_input_ids(batch, group_requests, self._pending)
            forward = self.runner.forward(batch, restores)
            self._retire_tier_jobs()
            for request in group_requests:
                self.scheduler.after_forward(request, 1)
            with self.runner.ranges.region(SAMPLING):
                logits = self.runner.logits(forward, batch.last_rows)
                token_rows.append(device_tokens(logits, [r.sampler for r in group_requests]))
            requests += group_requests
        tokens = token_rows[0] if len(token_rows) == 1 else torch.cat(token_rows)
        positions = []
        for request in requests:
            positions.append(len(request.output_token_ids))
            request.output_token_ids.append(PLACEHOLDER)
        launched = PendingTokens(requests, positions, tokens, ToHost(tokens))
        outputs = self._resolve_pending() if self._pending is not None else []
        self._pending = launched
        return outputs

    def _resolve_pending(self) -> list[StepOutput]:
        """Reads the pending step's tokens back (waiting for that step only) and books each in place of
        its placeholder; a request that has finished since drops its token."""
        pending, self._pending = self._pending, None
        assert pending is not None
        outputs = []
        for request, position, token in zip(
            pending.requests, pending.positions, pending.host.tolist(), strict=True
        ):
            if request.is_finished:
                continue
            request.output_token_ids[position] = token
            outputs.append(self._append_token(request, 0, SampleResult([token], None, None), position))
        return outputs

    def _speculate(self, chunks: list[ScheduledChunk]) -> tuple[list[StepOutput], list[ScheduledChunk]]:
        """Verify forward for the eligible decoding requests (spec/speculative.py) and the commit of what it
        accepted; returns its outputs and the chunks left for the ordinary forward."""
        speculative = self.speculative
        decoding = [
            c.request
            for c in chunks
            if c.request.output_token_ids
            and c.request.num_uncomputed == 1
            and speculative.eligible(c.request)
        ]
        if not decoding:
            return [], chunks
        verified = speculative.verify(decoding, self.scheduler, self.max_model_len)
        outputs = [output for row in verified.rows for output in self._commit(row)]
        speculative.after_commit(verified)
        done = {row.request.request_id for row in verified.rows}
        return outputs, [c for c in chunks if c.request.request_id not in done]

    def _commit(self, row: VerifiedRow) -> list[StepOutput]:
        """Appends a verified row's tokens one by one, each through the decode bookkeeping and the finish
        rules: a stop inside the accepted drafts ends the request there."""
        request, outputs = row.request, []
        for j, token in enumerate(row.tokens):
            row.use_state_after(j)
            self.scheduler.after_verified_token(request)
            logprobs = row.logprobs[j] if row.logprobs is not None else None
            outputs.append(self._append_token(request, 0, committed_token(token, logprobs, request.params)))
            if request.is_finished:
                break
        return outputs

    def _batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """The forward batch of `chunks`: each request's next `num_tokens` tokens, pages and state slot."""
        return build_forward_batch(
            [(c.request.token_ids, c.request.pages, c.request.num_computed, c.num_tokens) for c in chunks],
            [c.request.state_slot for c in chunks],
            self.config.page_size,
            self.device,
        )

    def _forward(
        self, chunks: list[ScheduledChunk], restores: list[Transfer]
    ) -> tuple[list[Request], torch.Tensor | None]:
        """One forward over `chunks` (one kind: engine/forward_groups.py) and its bookkeeping. Returns the
        requests whose prompt is now computed and their logits rows [n, vocab] (a copy: a graph's output
        buffer is rewritten by its next replay), in that order; None for no request."""
        batch = self._batch(chunks)
        images = None
        if self.image_encoder is not None:
            images = self.image_encoder.rows(
                [ImageChunk(c.request, c.request.num_computed, c.num_tokens) for c in chunks]
            )
        forward = self.runner.forward(batch, restores, images)
        self._retire_tier_jobs()
        hidden = forward.hidden
        sampled: list[tuple[Request, int]] = []
        for chunk, last_row, (start, length) in zip(chunks, batch.last_rows, batch.query_ranges, strict=True):
            if chunk.request.prompt_logprobs is not None and chunk.request.num_computed < len(
                chunk.request.prompt_token_ids
            ):
                record_prompt_logprobs(self.runner, forward, chunk.request, start, length)
            if self.speculative is not None and self.speculative.eligible(chunk.request):
                # An MTP drafter keeps the hidden states of the requests it may draft for.
                rows = slice(start, start + length)
                self.speculative.observe(chunk.request, chunk.request.num_computed, hidden, rows)
            self.scheduler.after_forward(chunk.request, chunk.num_tokens)
            if chunk.request.num_uncomputed == 0:
                sampled.append((chunk.request, last_row))
        if not sampled:
            return [], None
        logits = self.runner.logits(forward, [row for _, row in sampled])
        return [request for request, _ in sampled], logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[StepOutput]:
        """One token for each request (row of `logits`). When the batch's sampling raises, each row is
        sampled alone, so a request whose own sampling fails (its parameters, its grammar) fails alone
        and the others get what they get in any batch: a row's token depends only on its own row and
        generator (engine/sampler.py). The retry draws again: a failure after the draws (while
        gathering logprobs, say; none is known) would move the other rows' seeded streams on by a draw."""
        try:
            with self.runner.ranges.region(SAMPLING):
                result = sample(logits, [request.sampler for request in requests])
        except Exception as error:
            logger.warning("sampling a batch of %d failed (%r): sampling each alone", len(requests), error)
            outputs = []
            for row, request in enumerate(requests):
                try:
                    alone = sample(logits[row : row + 1], [request.sampler])
                except Exception as own_error:
                    outputs.append(self._fail(request, own_error))
                    continue
                outputs.append(self._append_token(request, 0, alone))
            return outputs
        return [self._append_token(request, i, result) for i, request in enumerate(requests)]

    def _append_token(
        self, request: Request, index: int, result: SampleResult, placed: int | None = None
    ) -> StepOutput:
        """Takes the request's sampled token; an error while doing so (its grammar, detokenizer or stop
        strings) fails this request alone. `placed`: the token is already at that index of its output
        (an overlapped step's placeholder, replaced)."""
        try:
            return self._take_token(request, index, result, placed)
        except Exception as error:
            _drop_placeholders(request)
            return self._fail(request, error)

    def _take_token(
        self, request: Request, index: int, result: SampleResult, placed: int | None = None
    ) -> StepOutput:
        token_id = result.token_ids[index]
        if placed is None:
            request.output_token_ids.append(token_id)
        generated = len(request.output_token_ids) if placed is None else placed + 1
        request.sampler.append(token_id)
        if request.params.logprobs is not None and result.logprobs is not None:
            request.output_logprobs.append(result.logprobs[index])
            request.output_top_logprobs.append(result.top_logprobs[index])
        params = request.params
        reason = None
        new_text = ""
        # A grammar that accepted a stop token (under ignore_eos too) allows nothing after it.
        grammar_done = request.sampler.grammar is not None and request.sampler.grammar.terminated
        if (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
            or grammar_done
        ):
            reason = "stop"
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
        elif request.detokenizer is not None and request.stop_matcher is not None:
            check = request.stop_matcher.feed(request.detokenizer.add(token_id))
            new_text = check.emit
            if check.stopped:
                reason = "stop"
                request.stop_reason = request.stop_matcher.matched
        if reason is None and generated >= request.max_new_tokens:
            reason = "length"
        if reason is not None and request.stop_matcher is not None and not request.stop_matcher.stopped:
            # Text held back as a possible stop-string start is final now.
            new_text += request.stop_matcher.flush()
        request.text += new_text
        if reason is None:
            return self._output(request, [token_id], new_text)
        # An overlapped step's token after this one was computed but is not part of the answer.
        del request.output_token_ids[generated:]
        self._finish(request, reason)
        return self._output(request, [token_id], new_text, _final_output(request))

    def _fail(self, request: Request, error: Exception) -> StepOutput:
        """Ends `request` with finish_reason "error" after an unexpected error of its own. The traceback goes
        to the log; the request's error names no internals, only where to look."""
        logger.error("request %s failed in the engine", request.request_id, exc_info=error)
        self._finish(request, "error")
        return self._output(request, [], "", _final_output(request, internal_error(request.request_id)))

    @staticmethod
    def _output(
        request: Request, token_ids: list[int], text: str, final: RequestOutput | None = None
    ) -> StepOutput:
        """`request`'s output of this step: its new tokens and text, their logprobs when it asked for
        them, its prompt's logprobs on its first output, where its time to the first token went on its
        first output with a token, and the final output once it finished."""
        logprobs = top_logprobs = None
        if request.params.logprobs is not None:
            start = len(request.output_logprobs) - len(token_ids)  # not [-n:]: no tokens, no logprobs
            logprobs, top_logprobs = request.output_logprobs[start:], request.output_top_logprobs[start:]
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_reported:
            request.prompt_logprobs_reported = True
            prompt_logprobs = request.prompt_logprobs
        first_token_times = None
        if token_ids and not request.first_token_reported and request.admitted_at is not None:
            request.first_token_reported = True
            prefill_s = time.perf_counter() - request.admitted_at
            thread = split_wall(request.admitted_thread, read_thread_times(), prefill_s)
            first_token_times = FirstTokenTimes(
                request.admitted_at - request.added_at,
                prefill_s,
                request.added_at,
                None if thread is None else thread["on_cpu_s"],
                None if thread is None else thread["runqueue_s"],
            )
        return StepOutput(
            request.request_id,
            token_ids,
            text,
            final is not None,
            final,
            logprobs,
            top_logprobs,
            prompt_logprobs,
            first_token_times,
        )

    def _finish(self, request: Request, reason: str, working_state_valid: bool = True) -> None:
        self.scheduler.finish(request, reason, working_state_valid)
        self._requests.pop(request.request_id, None)
        if self.speculative is not None:
            self.speculative.release(request.request_id)

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Every page and state slot is free, cached, or held by exactly one running request."""
        self.prefix_cache.check_integrity(
            pages_held_by_requests=self.scheduler.pages_held_by_requests() + self.runner.scratch_pages,
            slots_held_by_requests=self.scheduler.slots_held_by_requests() + self.runner.scratch_slots,
        )
        if self.tiers is not None:
            self.tiers.check_integrity()

    def cache_memory_bytes(self) -> int:
        """Host memory its caches hold by design, bounded by their capacity (cache_memory.py): what a
        soak subtracts from the growth of resident memory before calling the rest a leak."""
        storages = self.pool.storages() + (self.state_slots.storages() if self.state_slots else [])
        total = self.prefix_cache.index_bytes()
        if self.tiers is not None:
            total += self.tiers.index_bytes()
            storages += self.tiers.arenas()
        return total + storage_resident_bytes(storages)

    def evict_device_cache(self) -> int:
        """Evicts every page and snapshot of the device prefix cache; returns the number of pages freed.

        For measuring the tiers behind it (`morion bench --workloads restore`): afterwards a request for a
        cached prefix is served from host memory (or disk), or computed when there are no tiers. It goes
        through the radix cache's normal eviction (`RadixCache.evict`), so the bookkeeping is that of any
        eviction under memory pressure: under write-back the eviction listener copies each node to the
        host before its pages go back to the free list; under write-through the host has them already.

        While requests run, what they hold stays: their prefixes are locked (and its pages not counted).
        The server offers it as `POST /v1/cache/evict_device`, so `morion validate restore` can take
        conversations out of GPU memory without flooding the pool.
        """
        # Leaves first, as any eviction; locked nodes are never taken.
        return self.prefix_cache.evict(self.prefix_cache.cached_pages)

    def close(self) -> None:
        """Finish the cache tiers' copies and disk writes (a later engine on the same disk cache then finds
        everything), then stop the follower ranks. Idempotent; the engine must not step afterwards."""
        if self.tiers is not None:
            self.tiers.close()
        if self._ranks is not None:
            self._ranks.close()


# Token ids per torch reduction in `_id_bounds`: below torch's parallel grain (32,768 elements), so that
# each runs on the calling thread. A larger one goes to torch's thread pool, whose wake-up took 1.8 to 8 ms
# now and then in a server's engine process on a busy 2-core host, where a slice takes ~0.01 ms here.
_BOUNDS_SLICE = 16384


def _id_bounds(ids: array) -> tuple[int, int]:
    """The smallest and largest of the (non-empty) `array("q")` ids, in torch over its buffer: 0.02 ms for
    an agent's 33K ids, where min() and max() over them as Python ints took 0.8."""
    values = torch.frombuffer(ids, dtype=torch.int64)
    starts = range(0, len(values), _BOUNDS_SLICE)
    bounds = [values[start : start + _BOUNDS_SLICE].aminmax() for start in starts]
    return min(int(low) for low, _ in bounds), max(int(high) for _, high in bounds)


def _token_array(token_ids: Sequence[int]) -> array:
    """A prompt's token ids as `array("q")`, from any sequence of integers (a list, the server's
    `array("q")`, numpy or torch integers), in a C loop (`.tolist()` then gives Python ints in another:
    0.9 ms for 33K ids, where `int()` per id took 1.6). Anything but an integer (a float, a string) is
    refused, never rounded."""
    try:
        return array("q", token_ids)
    except (TypeError, OverflowError) as error:
        raise InvalidRequestError(f"prompt token ids must be integers: {error}") from None


def _drop_placeholders(request: Request) -> None:
    """Removes the tokens of an overlapped step that are still on the device (engine/overlap.py): the
    output ends at the last booked token, and only its tokens count as computed (what a finish caches)."""
    while request.output_token_ids and request.output_token_ids[-1] == PLACEHOLDER:
        request.output_token_ids.pop()
    request.num_computed = min(request.num_computed, request.num_tokens)


def _final_output(request: Request, error: str | None = None) -> RequestOutput:
    wants_logprobs = request.params.logprobs is not None
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=list(request.output_token_ids),
        text=request.text,
        finish_reason=request.finish_reason,
        usage=Usage(
            len(request.prompt_token_ids),
            len(request.output_token_ids),
            request.num_cached_tokens,
            0 if request.images is None else request.images.num_image_tokens,
        ),
        logprobs=list(request.output_logprobs) if wants_logprobs else None,
        top_logprobs=list(request.output_top_logprobs) if wants_logprobs else None,
        prompt_logprobs=request.prompt_logprobs,
        stop_reason=request.stop_reason,
        error=error,
    )
