"""The engine: requests in, one batched forward per step, tokens out. Single-threaded and synchronous;
`morion.LLM` drives it in-process, the server from its own process."""

from __future__ import annotations

import itertools
import logging
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

import morion
from morion.cache.cache_memory import storage_resident_bytes
from morion.cache.copy_engine import Transfer, make_copy_engine
from morion.cache.disk_format import config_digest, weights_digest
from morion.cache.disk_store import open_disk_store
from morion.cache.page_pool import PagePool
from morion.cache.radix_cache import RadixCache
from morion.cache.spec import CacheSpec
from morion.cache.state_slots import StateSlots
from morion.cache.tier_stats import CacheStats
from morion.cache.tiers import CacheTiers
from morion.config import DTYPES, EngineConfig
from morion.engine.cuda_graph import DecodeGraphRunner
from morion.engine.forward_batch import KVScales, PagedAttentionBackend, build_forward_batch
from morion.engine.forward_groups import FORWARD_GROUP_MAX_TOKENS, forward_groups
from morion.engine.grammar import GrammarRuntime
from morion.engine.image_batch import ImageChunk, ImageEncoder
from morion.engine.outputs import PromptLogprob, RequestOutput, StepOutput, Usage, internal_error
from morion.engine.request import Request
from morion.engine.restore_wait import BackendAfterRestores
from morion.engine.sampler import RequestSampler, SampleResult, sample
from morion.engine.sampling_params import SamplingParams
from morion.engine.scheduler import ScheduledChunk, Scheduler
from morion.engine.speculative import SpeculativeDecoding
from morion.engine.step_timing import StepTimes
from morion.engine.stop import StopStringMatcher
from morion.engine.warmup import measure_forward_peak_bytes
from morion.errors import InvalidRequestError, MorionError
from morion.layers.moe import set_moe_kernel
from morion.loader import LoadedModel, load_model
from morion.multimodal.image_decode import PreparedImage
from morion.multimodal.processing import ImageProcessing
from morion.multimodal.prompt_images import PromptImages
from morion.spec.drafter import Drafter
from morion.spec.forced import ForcedAcceptance
from morion.spec.frspec import load_token_map
from morion.spec.mtp import MtpDrafter
from morion.spec.mtp_graph import MtpDraftGraphs
from morion.spec.ngram import NgramDrafter
from morion.spec.policy import WidthPolicy, fixed_width_policy, load_width_policy
from morion.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("morion.engine")

_CPU_DEFAULT_KV_GB = 1.0
_GRAPH_AND_WORKSPACE_RESERVE = 512 * 2**20  # decode graphs' activations, attention split buffers, cuBLAS
_PROMPT_LOGPROB_ROWS = 256  # prompt rows turned into logits at once (a [rows, vocab] fp32 temporary)
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
        (benchmarks only, spec/forced.py) decides how many drafts each verify step accepts."""
        self.config = config
        self.device = config.torch_device
        loaded = loaded or load_model(
            config.model,
            config.torch_dtype,
            self.device,
            config.load_format,
            config.seed,
            weight_dtype=config.weight_dtype,
            host_table_placement=config.ple_placement,
        )
        self.model = loaded.model
        set_moe_kernel(self.model, config.moe_kernel)
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        self._weight_bytes = sum(
            t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())
        )
        # The compute dtype: FP8 weights (--weight-dtype fp8) are e4m3, embeddings and norms never are.
        compute_dtype = next(p.dtype for p in self.model.parameters() if p.dtype.itemsize > 1)
        kv_dtype = compute_dtype if config.kv_cache_dtype == "auto" else config.kv_torch_dtype
        # FP8 K/V is stored unscaled (scale 1.0, as SGLang and vLLM default to without calibration): K/V
        # of these models stay well inside e4m3's +-448 range after their norms.
        self.kv_scales = KVScales()
        if config.speculative == "mtp" and getattr(self.model, "mtp", None) is None:
            raise MorionError(
                f"speculative mtp needs a model with an MTP head; {self.model.config.model_type} from "
                f"{self.model_path} has none (try --speculative ngram)"
            )
        # The MTP head's K/V (and QSA side caches) are paged with the trunk's: further layers of its token
        # components.
        draft_layers = {"draft_layers": True} if config.speculative == "mtp" else {}
        spec = self.model.cache_spec(config.page_size, kv_dtype, DTYPES[config.state_dtype], **draft_layers)
        use_graphs = config.cuda_graph and self.device.type == "cuda"
        speculating = drafter is not None or config.speculative != "off"
        policy = _width_policy(config) if speculating else None
        self._activation_reserve = self._activation_reserve_bytes(spec)
        self.state_slots = None
        if spec.has_state:
            # Each running request holds a working slot and a page-boundary copy (and with speculation a
            # slot per draft position); the rest are snapshots.
            per_request = 4 + (policy.max_width if policy else 0)
            num_slots = config.state_slots or per_request * config.max_running_requests
            self.state_slots = StateSlots(spec, num_slots + int(use_graphs), self.device)
        state_bytes = self.state_slots.num_bytes if self.state_slots else 0
        num_pages = self._num_pages(spec.bytes_per_page, state_bytes) + int(use_graphs)
        self.pool = PagePool(spec, num_pages, self.device)
        # CUDA-graph padding rows write into a scratch page and slot that nobody else ever gets.
        self._scratch_pages = self.pool.alloc(1) if use_graphs else []
        self._scratch_slots = [self.state_slots.alloc()] if use_graphs and self.state_slots else []
        self.speculative = None
        if policy is not None:
            drafts = self._drafter(drafter)
            self.speculative = SpeculativeDecoding(drafts, policy, spec.has_state, forced_acceptance)
        self.prefix_cache = RadixCache(self.pool, self.state_slots)
        self._cache_stats = CacheStats()
        self.step_times = StepTimes()  # engine/step_timing.py: where the steps' time goes
        self.tiers = self._build_tiers(spec, loaded) if config.enable_prefix_cache else None
        self.scheduler = Scheduler(
            self.prefix_cache,
            config.chunk_size,
            config.max_running_requests,
            config.enable_prefix_cache,
            self.tiers,
            self._cache_stats,
        )
        # The tokens requests can hold: the pool less the CUDA-graph scratch page.
        self.pool_tokens = (self.pool.num_pages - len(self._scratch_pages)) * config.page_size
        context = self.model.config.max_position_embeddings
        self.max_model_len, self.max_model_len_limit = max_model_len(
            context, self.pool_tokens, config.max_model_len
        )
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.grammars = GrammarRuntime(self.tokenizer, self.model.config.vocab_size)
        self.image_encoder = self._image_encoder()
        if self.speculative is not None:
            self.speculative.image_encoder = self.image_encoder
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._report_startup(spec.bytes_per_token)
        self.graphs: DecodeGraphRunner | None = None
        if use_graphs:
            self.graphs = DecodeGraphRunner(
                self.model,
                self.pool,
                self.state_slots,
                self.kv_scales,
                min(config.cuda_graph_max_batch, config.max_running_requests),
                -(-self.max_model_len // config.page_size),
                self._scratch_pages[0],
                self._scratch_slots[0] if self._scratch_slots else None,
            )
            try:
                self.graphs.capture()
            except RuntimeError as error:  # a model path that syncs with the host: decode still works
                _report_capture_failure("CUDA graph capture FAILED, decode runs eagerly", error)
                self.graphs = None
        # Verify forwards of speculative decoding, one runner per draft width the policy may pick.
        self.verify_graphs: dict[int, DecodeGraphRunner] = {}
        if self.graphs is not None and self.speculative is not None:
            self._capture_verify_graphs()

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

    def _capture_verify_graphs(self) -> None:
        config, decode = self.config, self.graphs
        for width in self.speculative.policy.candidate_widths:
            if width + 1 > config.page_size:
                continue  # padding rows keep their tokens in one scratch page
            runner = DecodeGraphRunner(
                self.model, self.pool, self.state_slots, self.kv_scales, decode.max_batch, decode.max_pages,
                self._scratch_pages[0], self._scratch_slots[0] if self._scratch_slots else None,
                query_len=width + 1,
            )  # fmt: skip
            runner.share_memory_pool(decode)
            try:
                runner.capture()
            except RuntimeError as error:
                _report_capture_failure("verify CUDA graph capture FAILED, verify runs eagerly", error)
                return
            self.verify_graphs[width + 1] = runner
            drafter = self.speculative.drafter
            if isinstance(drafter, MtpDrafter):
                self._capture_draft_graphs(drafter, width, decode)

    def _capture_draft_graphs(self, drafter: MtpDrafter, width: int, decode: DecodeGraphRunner) -> None:
        """The MTP head's after-verify draft of this width as CUDA graphs (spec/mtp_graph.py), in the
        decode graphs' memory pool; eager where capture fails. Its hidden-state buffer is as wide as what
        the model's forward returns (`hidden_width`: Qwen3.8-Flash-Next's n pre-mixer streams), in the
        embeddings' dtype (never FP8)."""
        dtype = self.model.model.embed_tokens.weight.dtype
        graphs = MtpDraftGraphs(
            drafter.draft_after_verify, width, decode.max_batch, decode.max_pages, self.model.hidden_width,
            dtype, self._scratch_pages[0], self.device,
        )  # fmt: skip
        try:
            graphs.capture(decode.memory_pool)
        except RuntimeError as error:
            _report_capture_failure("MTP draft CUDA graph capture FAILED, drafts run eagerly", error)
            return
        drafter.graphs[width] = graphs

    def _drafter(self, given: Drafter | None) -> Drafter:
        config = self.config
        if given is not None:
            if config.speculative != "off":
                raise MorionError(f"a drafter was given, and speculative is {config.speculative!r}: pick one")
            return given
        if config.speculative == "mtp":
            token_map = None
            if config.spec_token_map is not None:
                token_map = load_token_map(config.spec_token_map, self.model.config.vocab_size)
            try:
                mtp = MtpDrafter(self.model, self.pool, self.kv_scales, token_map)
            except ValueError as error:  # a token map with an FP8 LM head
                raise MorionError(str(error)) from None
            return mtp
        return NgramDrafter()  # config.speculative == "ngram"

    def _activation_reserve_bytes(self, spec: CacheSpec) -> int:
        """CUDA memory kept free for activations: the peak of one warm-up forward of a full chunk, plus a
        margin for CUDA graphs and allocator fragmentation; the warm-up compiles the kernels of every
        shape of forward (engine/warmup.py)."""
        config = self.config
        if self.device.type != "cuda":
            return 0
        if config.activation_reserve_gb is not None:
            return int(config.activation_reserve_gb * 2**30)
        tokens = min(config.chunk_size, self.model.config.max_position_embeddings)
        started = time.perf_counter()
        peak = measure_forward_peak_bytes(
            self.model,
            spec,
            tokens,
            self.device,
            self.kv_scales,
            FORWARD_GROUP_MAX_TOKENS,
            config.max_running_requests,
        )
        reserve = int(peak * 1.1) + _GRAPH_AND_WORKSPACE_RESERVE
        print(
            f"morion: warm-up forward of {tokens} tokens: activation peak {peak / 2**30:.2f} GiB "
            f"({time.perf_counter() - started:.1f} s, includes kernel compilation); "
            f"reserving {reserve / 2**30:.2f} GiB",
            file=sys.stderr,
        )
        return reserve

    def _num_pages(self, bytes_per_page: int, state_bytes: int) -> int:
        """Pages for the K/V pool: an explicit token count or size, or what is really free on the device
        (after weights, state slots and the activation reserve) times `mem_fraction`."""
        config = self.config
        if config.kv_cache_tokens is not None:
            return -(-config.kv_cache_tokens // config.page_size)
        if config.kv_cache_gb is not None:
            budget = config.kv_cache_gb * 2**30 - state_bytes
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = (free - self._activation_reserve) * config.mem_fraction
        else:
            budget = _CPU_DEFAULT_KV_GB * 2**30 - state_bytes
        if budget < bytes_per_page:
            raise MorionError(
                f"no memory left for the KV pool: {budget / 2**30:.2f} GiB after weights "
                f"({self._weight_bytes / 2**30:.2f} GiB), state slots ({state_bytes / 2**30:.2f} GiB) "
                f"and the "
                f"activation reserve ({self._activation_reserve / 2**30:.2f} GiB); try --weight-dtype fp8, "
                "--kv-cache-dtype fp8, fewer --state-slots or a smaller --chunk-size"
            )
        return int(budget // bytes_per_page)

    @property
    def cache_stats(self) -> CacheStats:
        """Hits by tier (device / host / disk), restores, bytes moved, restore latency, checksum failures,
        evictions, tier sizes: live counters with fresh gauges; `.snapshot()` for a copy to send away."""
        if self.tiers is not None:
            self.tiers.refresh_gauges()
        return self._cache_stats

    def _build_tiers(self, spec, loaded: LoadedModel) -> CacheTiers | None:
        config = self.config
        if config.host_cache_gb is None:
            return None
        host_bytes = int(config.host_cache_gb * 2**30)
        try:
            num_pages, num_snapshots = CacheTiers.host_rows(
                spec, host_bytes, config.host_cache_state_fraction
            )
        except ValueError as error:
            raise MorionError(f"host_cache_gb {config.host_cache_gb}: {error}") from None
        tiers = CacheTiers(
            self.pool,
            self.state_slots,
            make_copy_engine(self.device),
            num_pages,
            num_snapshots,
            pin_memory=self.device.type == "cuda",
            write_policy=config.host_cache_write_policy,
            stats=self._cache_stats,
        )
        if config.host_cache_write_policy == "write_back":
            self.prefix_cache.evict_listener = tiers.on_device_evict
        if config.disk_cache_dir is not None:
            root = Path(config.disk_cache_dir).expanduser()
            budget = int(config.disk_cache_gb * 2**30) if config.disk_cache_gb is not None else None
            identity = {
                "model": {
                    "config_digest": config_digest(loaded.hf_config),
                    "weights_digest": weights_digest(self.model),
                    "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                    "weight_dtype": config.weight_dtype,
                }
            }
            info = {
                "model_name": Path(str(loaded.path)).name,
                "model_type": self.model.config.model_type,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "morion_version": morion.__version__,
            }
            store = open_disk_store(root, identity, info, spec, budget, direct_io=config.disk_cache_direct_io)
            tiers.attach_disk(store)
        return tiers

    def _report_startup(self, bytes_per_token: int) -> None:
        config, pool, slots = self.config, self.pool, self.state_slots
        prefix_cache = "on" if config.enable_prefix_cache else "off"
        state = ""
        if slots is not None:
            per_slot = pool.spec.bytes_per_slot
            state = f"; state slots {slots.num_slots} x {per_slot} B ({slots.num_bytes / 2**30:.2f} GiB)"
        kv_dtype = str(pool.spec.token_components[0].dtype).removeprefix("torch.")
        print(
            f"morion: {self.model.config.model_type} on {self.device}; weights "
            f"{self._weight_bytes / 2**30:.2f} GiB; KV pool {pool.num_pages} pages x {config.page_size} = "
            f"{pool.num_pages * config.page_size} tokens at {bytes_per_token} B/token {kv_dtype} "
            f"({pool.num_bytes / 2**30:.2f} GiB){state}; activation reserve "
            f"{self._activation_reserve / 2**30:.2f} GiB; max model len {self.max_model_len}; "
            f"chunk {config.chunk_size}; max running {config.max_running_requests}; "
            f"prefix cache {prefix_cache}",
            file=sys.stderr,
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            print(f"morion: CUDA memory {free / 2**30:.2f} of {total / 2**30:.2f} GiB free", file=sys.stderr)
        tiers = self.tiers
        if tiers is None:
            return
        line = (
            f"morion: host cache {tiers.host.num_rows} pages x {tiers.host.layout.row_bytes} B"
            f"{' (pinned)' if self.device.type == 'cuda' else ''}"
        )
        if tiers.snapshots is not None:
            line += f" + {tiers.snapshots.num_rows} snapshots x {tiers.snapshots.layout.row_bytes} B"
        line += f" = {self.cache_stats.host_bytes / 2**30:.2f} GiB, {config.host_cache_write_policy}"
        disk = tiers.disk
        if disk is not None and disk.enabled:
            origin = "" if config.disk_cache_gb is not None else " (auto: half of free space + own objects)"
            line += (
                f"; disk cache {disk.dir} ({disk.num_objects} objects, {disk.used_bytes / 2**30:.2f} of "
                f"{disk.budget_bytes / 2**30:.2f} GiB{origin}, "
                f"{'O_DIRECT' if disk.direct_io else 'buffered'})"
            )
        elif disk is not None:
            line += f"; disk cache SKIPPED: {disk.skip_reason}"
        print(line, file=sys.stderr)

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
        prompt = [int(t) for t in prompt_token_ids]
        prompt_images = self._prompt_images(prompt, images)
        vocab_size = self.model.config.vocab_size
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if any(not 0 <= t < vocab_size for t in prompt):
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
            detokenizer=IncrementalDetokenizer(tokenizer, prompt) if tokenizer else None,
            stop_matcher=StopStringMatcher(params.stop) if tokenizer else None,
        )
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
        return PromptImages(prompt, images, image_token, encoder.processing.merge_size)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._finish(request, "abort")
        return _final_output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        outputs, decode = self._step()
        self.step_times.record(decode, time.perf_counter() - started)
        return outputs

    def _step(self) -> tuple[list[StepOutput], bool]:
        """One step's outputs, and whether it was a decode step (every scheduled request generating, one
        token each: engine/step_timing.py)."""
        if self.tiers is not None:
            self.tiers.poll()  # retire finished copies and disk jobs before scheduling
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

    def _forward(
        self, chunks: list[ScheduledChunk], restores: list[Transfer]
    ) -> tuple[list[Request], torch.Tensor | None]:
        """One forward over `chunks` (one kind: engine/forward_groups.py) and its bookkeeping. Returns the
        requests whose prompt is now computed and their logits rows [n, vocab] (a copy: a graph's output
        buffer is rewritten by its next replay), in that order; None for no request."""
        batch = build_forward_batch(
            [(c.request.token_ids, c.request.pages, c.request.num_computed, c.num_tokens) for c in chunks],
            [c.request.state_slot for c in chunks],
            self.config.page_size,
            self.device,
        )
        images = None
        if self.image_encoder is not None:
            images = self.image_encoder.rows(
                [ImageChunk(c.request, c.request.num_computed, c.num_tokens) for c in chunks]
            )
        # Graphs take sequence indices as positions: a forward with positions per axis runs eagerly.
        if images is None and self.graphs is not None and self.graphs.can_run(batch):
            # A graph replays its layers without the per-layer restore waits: the whole forward waits (on
            # the GPU) for this step's restores instead.
            for restore in restores:
                restore.wait_all()
            logits = self.graphs.run(batch)  # decode-only: every row is a sequence's last token
            hidden = self.graphs.last_hidden(len(batch.query_ranges))
        else:
            backend = PagedAttentionBackend(self.pool, batch, self.state_slots, self.kv_scales)
            if restores:
                components = [c.name for c in self.pool.spec.token_components]
                backend = BackendAfterRestores(backend, restores, components)
            extra = {} if images is None else {"images": images}
            hidden = self.model(batch.input_ids, batch.positions, backend, **extra)
            logits = None
        sampled: list[tuple[Request, int]] = []
        for chunk, last_row, (start, length) in zip(chunks, batch.last_rows, batch.query_ranges, strict=True):
            if chunk.request.prompt_logprobs is not None and chunk.request.num_computed < len(
                chunk.request.prompt_token_ids
            ):
                self._record_prompt_logprobs(chunk.request, hidden[start : start + length])
            if self.speculative is not None and self.speculative.eligible(chunk.request):
                # An MTP drafter keeps the hidden states of the requests it may draft for.
                rows = hidden[start : start + length]
                self.speculative.observe(chunk.request, chunk.request.num_computed, rows)
            self.scheduler.after_forward(chunk.request, chunk.num_tokens)
            if chunk.request.num_uncomputed == 0:
                sampled.append((chunk.request, last_row))
        if not sampled:
            return [], None
        if logits is None:
            logits = self.model.compute_logits(hidden[[row for _, row in sampled]])
        else:
            logits = logits[[row for _, row in sampled]]
        return [request for request, _ in sampled], logits

    def _record_prompt_logprobs(self, request: Request, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this chunk's rows predict (row j predicts the token after it),
        from the raw logits as for generated tokens; the logits are made a slice of rows at a time."""
        first = request.num_computed
        # The last prompt row predicts the first output token, not a prompt token.
        rows = min(len(hidden), len(request.prompt_token_ids) - 1 - first)
        top_n = request.params.prompt_logprobs
        for offset in range(0, rows, _PROMPT_LOGPROB_ROWS):
            count = min(_PROMPT_LOGPROB_ROWS, rows - offset)
            logprobs = self.model.compute_logits(hidden[offset : offset + count]).log_softmax(dim=-1)
            targets = torch.tensor(request.prompt_token_ids[first + offset + 1 : first + offset + 1 + count])
            chosen = logprobs.gather(1, targets.to(logprobs.device).unsqueeze(1))
            ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
            chosen = chosen.squeeze(1).tolist()
            values, ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
            for j in range(count):
                top = list(zip(ids[j].tolist(), values[j].tolist(), strict=True)) if top_n else []
                request.prompt_logprobs[first + offset + 1 + j] = PromptLogprob(chosen[j], ranks[j], top)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[StepOutput]:
        """One token for each request (row of `logits`). When the batch's sampling raises, each row is
        sampled alone, so a request whose own sampling fails (its parameters, its grammar) fails alone
        and the others get what they get in any batch: a row's token depends only on its own row and
        generator (engine/sampler.py). The retry draws again: a failure after the draws (while
        gathering logprobs, say; none is known) would move the other rows' seeded streams on by a draw."""
        try:
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

    def _speculate(self, chunks: list[ScheduledChunk]) -> tuple[list[StepOutput], list[ScheduledChunk]]:
        """Verify forward for the eligible decoding requests (engine/speculative.py); returns its outputs
        and the chunks left for the ordinary forward."""
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
        outputs, plain = speculative.step(
            decoding, self.model, self.scheduler, self.max_model_len, self.kv_scales, self._append_token,
            self.verify_graphs,
        )  # fmt: skip
        verified = {id(r) for r in decoding} - {id(r) for r in plain}
        return outputs, [c for c in chunks if id(c.request) not in verified]

    def _append_token(self, request: Request, index: int, result: SampleResult) -> StepOutput:
        """Takes the request's sampled token; an error while doing so (its grammar, detokenizer or stop
        strings) fails this request alone."""
        try:
            return self._take_token(request, index, result)
        except Exception as error:
            return self._fail(request, error)

    def _take_token(self, request: Request, index: int, result: SampleResult) -> StepOutput:
        token_id = result.token_ids[index]
        request.output_token_ids.append(token_id)
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
        if reason is None and len(request.output_token_ids) >= request.max_new_tokens:
            reason = "length"
        if reason is not None and request.stop_matcher is not None and not request.stop_matcher.stopped:
            # Text held back as a possible stop-string start is final now.
            new_text += request.stop_matcher.flush()
        request.text += new_text
        if reason is None:
            return StepOutput(request.request_id, [token_id], new_text, False, None)
        self._finish(request, reason)
        return StepOutput(request.request_id, [token_id], new_text, True, _final_output(request))

    def _fail(self, request: Request, error: Exception) -> StepOutput:
        """Ends `request` with finish_reason "error" after an unexpected error of its own. The traceback goes
        to the log; the request's error names no internals, only where to look."""
        logger.error("request %s failed in the engine", request.request_id, exc_info=error)
        self._finish(request, "error")
        final = _final_output(request, internal_error(request.request_id))
        return StepOutput(request.request_id, [], "", True, final)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self._requests.pop(request.request_id, None)
        if self.speculative is not None:
            self.speculative.release(request.request_id)

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Every page and state slot is free, cached, or held by exactly one running request."""
        self.prefix_cache.check_integrity(
            pages_held_by_requests=self.scheduler.pages_held_by_requests() + self._scratch_pages,
            slots_held_by_requests=self.scheduler.slots_held_by_requests() + self._scratch_slots,
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
        everything). Idempotent; the engine must not step afterwards."""
        if self.tiers is not None:
            self.tiers.close()


def max_model_len(context: int, pool_tokens: int, requested: int | None) -> tuple[int, str]:
    """The longest prompt + generation, and what limits it: "max_model_len" (asked for; it wins ties),
    "context" (the model's) or "kv_pool" (the tokens the pool can hold for requests)."""
    limits = [(context, "context"), (pool_tokens, "kv_pool")]
    if requested is not None:
        limits.insert(0, (requested, "max_model_len"))
    return min(limits, key=lambda limit: limit[0])


def _width_policy(config: EngineConfig) -> WidthPolicy:
    if config.spec_width is not None:
        return fixed_width_policy(config.spec_width)
    return load_width_policy(config.spec_policy)


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


# CUDA errors after which the context is unusable: no eager fallback can follow them.
_DEVICE_FAULTS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
)


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` is a sticky CUDA fault (a kernel read or wrote out of bounds, or asserted)."""
    text = str(error).lower()
    return any(fault in text for fault in _DEVICE_FAULTS)


def _report_capture_failure(what: str, error: RuntimeError) -> None:
    """One line for the operator, then where it failed (the innermost frames: the op that synced or
    faulted), so a failed capture can be traced without a rerun. A device fault is raised instead: the
    CUDA context is lost, so running eagerly would only fail later and further from the cause."""
    print(f"morion: {what}: {error}", file=sys.stderr)
    frames = traceback.extract_tb(error.__traceback__)[-6:]
    print("".join(traceback.format_list(frames)).rstrip(), file=sys.stderr)
    if is_device_fault(error):
        raise MorionError(
            f"a kernel faulted during CUDA graph capture ({str(error).splitlines()[0]}); the CUDA context "
            "is unusable, so the engine stops here (the frames above show where)"
        ) from error
