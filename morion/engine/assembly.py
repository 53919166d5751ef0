"""An engine's parts, built from its `EngineConfig` in the one order that works.

Each step needs what the steps before it made, and the memory steps must come in this order because
each one sizes itself from what is left:

1. The model (loaded or given): its weights are the first thing on the device, and its parameters tell
   the compute dtype, hence the K/V dtype.
2. The cache spec: what a page and a state slot hold (with the MTP head's layers when it drafts).
3. The activation reserve: a warm-up forward on scratch memory measures the peak of a full chunk
   (runner/warmup.py). It runs before the pool exists, so the peak is measured with nothing else
   allocated, and it compiles the kernels every later forward uses. The piecewise prefill graphs' memory
   is reserved with it, and default buckets whose graphs the device cannot afford are dropped
   (engine/prefill_graph_memory.py).
4. State slots, then the page pool from what is really free after weights, slots and the reserve
   (the pool takes the rest, so everything sized after it must be small or on the host). One page and
   one slot more for CUDA graphs' padding rows. On CUDA, slots sized from --max-running-requests take
   at most half of what is free: the engine lowers that count (and says so) rather than starve the
   pool. An explicit --state-slots or --kv-cache-tokens that does not fit is a one-line error naming
   the flag and what fits, never CUDA's out-of-memory error.
5. The model runner over the pool, then speculative decoding over the runner (an MTP drafter writes its
   K/V into the pool's pages).
6. The prefix cache over the pool, the host/disk tiers behind it (host memory; a write-back policy
   listens to the prefix cache's evictions), and the scheduler over both.
7. What follows from the pool's size: the longest request it can hold (`max_model_len`).
8. The startup summary, then CUDA graphs last: their capture replays the model at every batch bucket up
   to `max_model_len`'s pages, in memory the pool has left, and takes the longest.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

import morion
from morion.cache.copy_engine import make_copy_engine
from morion.cache.disk_format import config_digest, weights_digest
from morion.cache.disk_store import open_disk_store
from morion.cache.page_pool import PagePool
from morion.cache.radix_cache import RadixCache
from morion.cache.spec import CacheSpec
from morion.cache.state_slots import StateSlots
from morion.cache.tier_stats import CacheStats
from morion.cache.tiers import CacheTiers
from morion.config import DTYPES, EngineConfig
from morion.engine.forward_groups import FORWARD_GROUP_MAX_TOKENS
from morion.engine.prefill_graph_memory import affordable_default_buckets, graph_memory_bytes
from morion.engine.scheduler import Scheduler
from morion.engine.startup_report import report_startup
from morion.errors import MorionError
from morion.layers.merged_linears import merge_projections, merged_groups
from morion.layers.moe import StackedExperts, set_moe_kernel
from morion.layers.qsa_attention import QSAAttention, set_qsa_prefill
from morion.loader import LoadedModel, load_model
from morion.ops.pdl import set_pdl_mode
from morion.parallel.group import ONE_RANK, TensorParallel
from morion.parallel.step_mirror import MirroredCopyEngine, StepMirror
from morion.runner.backend import KVScales
from morion.runner.model_runner import ModelRunner
from morion.runner.warmup import measure_forward_peak_bytes
from morion.spec.draft_mirror import DraftMirror
from morion.spec.drafter import Drafter
from morion.spec.forced import ForcedAcceptance
from morion.spec.frspec import load_token_map
from morion.spec.mtp import MtpDrafter
from morion.spec.ngram import NgramDrafter
from morion.spec.policy import WidthPolicy, fixed_width_policy, load_width_policy
from morion.spec.speculative import SpeculativeDecoding

_CPU_DEFAULT_KV_GB = 1.0
# At most this share of the memory free after the weights goes to state slots when the engine sizes them
# from --max-running-requests (a hybrid model's per-request state: 110 MiB a slot on Qwen3.8-Flash-Next);
# it lowers that count rather than leave the K/V pool too small (SGLang caps its state cache alike).
_STATE_SHARE = 0.5
_GRAPH_AND_WORKSPACE_RESERVE = 512 * 2**20  # decode graphs' activations, attention split buffers, cuBLAS


class EngineParts(NamedTuple):
    loaded: LoadedModel
    kv_scales: KVScales
    pool: PagePool
    state_slots: StateSlots | None
    runner: ModelRunner
    speculative: SpeculativeDecoding | None
    prefix_cache: RadixCache
    cache_stats: CacheStats
    tiers: CacheTiers | None
    scheduler: Scheduler
    weight_bytes: int  # the model's parameters and buffers as stored (packed NVFP4 and FP8 included)
    pool_tokens: int  # the tokens requests can hold: the pool less the CUDA-graph scratch page
    max_model_len: int
    max_model_len_limit: str  # what limits it: "max_model_len", "context" or "kv_pool"
    # As given, but --max-running-requests lowered where state slots would not fit, and the default prefill
    # graph buckets cut to those the device affords.
    config: EngineConfig


def assemble(
    config: EngineConfig,
    loaded: LoadedModel | None,
    drafter: Drafter | None,
    forced_acceptance: ForcedAcceptance | None,
    tensor_parallel: TensorParallel = ONE_RANK,
    mirror: StepMirror | None = None,
) -> EngineParts:
    """The parts in build order (module docstring). `drafter` (tests, benchmarks) turns speculative
    decoding on with its proposals; without it, `config.speculative` names the drafter.

    At tensor parallelism every rank assembles the same parts from the same config, with its shard of the
    model (`config.device` is the rank's own); rank 0 passes the `mirror` its followers repeat its device
    work from (parallel/step_mirror.py), and the ranks agree on the pool's size."""
    device = config.torch_device
    # 1. The model.
    loaded = loaded or load_model(
        config.model,
        config.torch_dtype,
        device,
        config.load_format,
        config.seed,
        weight_dtype=config.weight_dtype,
        host_table_placement=config.ple_placement,
        tensor_parallel=tensor_parallel,
    )
    model = loaded.model
    set_moe_kernel(model, config.moe_kernel)
    if _merges_projections(config):
        merge_projections(model)  # before the warm-up: the merged weights' kernels compile there
    set_qsa_prefill(model, config.qsa_prefill)  # before the warm-up too: its kernels compile there
    # Before the warm-up and graph capture, which compile and record the kernels' launches.
    if set_pdl_mode(config.pdl, device) != config.pdl and config.pdl != "auto":
        print(
            f"morion: --pdl {config.pdl} needs a CUDA device of compute capability 9.0 or later; off",
            file=sys.stderr,
        )
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    # The compute dtype: FP8 weights (--weight-dtype fp8) are e4m3, embeddings and norms never are.
    compute_dtype = next(p.dtype for p in model.parameters() if p.dtype.itemsize > 1)
    kv_dtype = compute_dtype if config.kv_cache_dtype == "auto" else config.kv_torch_dtype
    # FP8 K/V is stored unscaled (scale 1.0, as SGLang and vLLM default to without calibration): K/V
    # of these models stay well inside e4m3's +-448 range after their norms.
    kv_scales = KVScales()
    if config.speculative == "mtp" and getattr(model, "mtp", None) is None:
        raise MorionError(
            f"speculative mtp needs a model with an MTP head; {model.config.model_type} from "
            f"{loaded.path} has none (try --speculative ngram)"
        )
    # 2. The cache spec. The MTP head's K/V (and QSA side caches) are paged with the trunk's: further
    # layers of its token components.
    draft_layers = {"draft_layers": True} if config.speculative == "mtp" else {}
    spec = model.cache_spec(config.page_size, kv_dtype, DTYPES[config.state_dtype], **draft_layers)
    use_graphs = config.cuda_graph and device.type == "cuda"
    speculating = drafter is not None or config.speculative != "off"
    policy = _width_policy(config) if speculating else None
    # 3. The activation reserve (a warm-up forward on scratch memory), the prefill graphs' memory in it.
    config, activation_reserve = _activation_reserve_bytes(config, model, spec, device, kv_scales)
    # 4. State slots, then the pool from what is free.
    state_slots = None
    if spec.has_state:
        # Each running request holds a working slot and a page-boundary copy (and with speculation a
        # slot per draft position); the rest are snapshots.
        per_request = 4 + (policy.max_width if policy else 0)
        if device.type == "cuda" and not config.state_slots:
            room = _device_room(device, activation_reserve)
            fits = _running_requests_that_fit(spec.bytes_per_slot, per_request, int(use_graphs), room)
            fits = tensor_parallel.min_over_ranks(fits, device)  # slot ids mean the same on every rank
            if 0 < fits < config.max_running_requests:
                print(
                    f"morion: --max-running-requests {config.max_running_requests} lowered to {fits}: "
                    f"each running request holds {per_request} state slots of "
                    f"{spec.bytes_per_slot / 2**20:.1f} MiB, and they may take at most "
                    f"{_STATE_SHARE:.0%} of the {room / 2**30:.2f} GiB free (the rest is the K/V pool's)",
                    file=sys.stderr,
                )
                config = dataclasses.replace(config, max_running_requests=fits)
        num_slots = config.state_slots or per_request * config.max_running_requests
        if device.type == "cuda":
            _require_room_for_state_slots(
                config, spec.bytes_per_slot, num_slots + int(use_graphs), per_request,
                _device_room(device, activation_reserve),
            )  # fmt: skip
        state_slots = StateSlots(spec, num_slots + int(use_graphs), device)
    state_bytes = state_slots.num_bytes if state_slots else 0
    num_pages = _num_pages(config, spec.bytes_per_page, state_bytes, activation_reserve, weight_bytes)
    # Page ids mean the same memory on every rank: the pool is as large as the smallest rank's.
    num_pages = tensor_parallel.min_over_ranks(num_pages, device)
    pool = PagePool(spec, num_pages + int(use_graphs), device)
    # CUDA-graph padding rows write into a scratch page and slot that nobody else ever gets.
    scratch_pages = pool.alloc(1) if use_graphs else []
    scratch_slots = [state_slots.alloc()] if use_graphs and state_slots else []
    # 5. The runner, and speculative decoding over it.
    runner = ModelRunner(model, pool, state_slots, kv_scales, scratch_pages, scratch_slots)
    runner.mirror = mirror
    if state_slots is not None:
        state_slots.mirror = mirror
    speculative = None
    if policy is not None:
        drafts = _drafter(config, drafter, model, pool, kv_scales)
        speculative = SpeculativeDecoding(drafts, policy, spec.has_state, runner, forced_acceptance)
        if mirror is not None and isinstance(drafts, MtpDrafter):  # the head's forwards on every rank
            speculative.mirror = DraftMirror(mirror)
            drafts.flush_mirror = mirror.flush
    # 6. The prefix cache, the tiers behind it, the scheduler over both.
    prefix_cache = RadixCache(pool, state_slots)
    cache_stats = CacheStats()
    tiers = None
    if config.enable_prefix_cache:
        tiers = _build_tiers(
            config, spec, loaded, pool, state_slots, prefix_cache, cache_stats, tensor_parallel, mirror
        )
    scheduler = Scheduler(
        prefix_cache,
        config.chunk_size,
        config.max_running_requests,
        config.enable_prefix_cache,
        tiers,
        cache_stats,
    )
    # 7. The longest request the pool holds.
    pool_tokens = (pool.num_pages - len(scratch_pages)) * config.page_size
    context = model.config.max_position_embeddings
    longest, limit = max_model_len(context, pool_tokens, config.max_model_len)
    # 8. The summary (rank 0's), then the graphs.
    if tensor_parallel.rank == 0:
        report_startup(
            config, model, pool, state_slots, tiers, cache_stats, weight_bytes, activation_reserve, longest,
            spec.bytes_per_token,
        )  # fmt: skip
    if use_graphs:
        runner.capture_decode_graphs(
            min(config.cuda_graph_max_batch, config.max_running_requests), -(-longest // config.page_size)
        )
        # Verify forwards of speculative decoding, one graph per draft width the policy may pick.
        if runner.decode_graphs is not None and speculative is not None:
            speculative.capture_graphs(config.page_size)
        runner.capture_short_graphs()
        if config.prefill_graph_buckets:
            runner.capture_prefill_graphs(config.prefill_graph_buckets)
    return EngineParts(
        loaded, kv_scales, pool, state_slots, runner, speculative, prefix_cache, cache_stats, tiers,
        scheduler, weight_bytes, pool_tokens, longest, limit, config,
    )  # fmt: skip


def _merges_projections(config: EngineConfig) -> bool:
    """Whether the engine merges linear layers of one input (layers/merged_linears.py): on CUDA, unless
    `--no-merged-projections`."""
    return config.merge_projections and config.torch_device.type == "cuda"


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


def _drafter(
    config: EngineConfig,
    given: Drafter | None,
    model: torch.nn.Module,
    pool: PagePool,
    kv_scales: KVScales,
) -> Drafter:
    if given is not None:
        if config.speculative != "off":
            raise MorionError(f"a drafter was given, and speculative is {config.speculative!r}: pick one")
        return given
    if config.speculative == "mtp":
        token_map = None
        if config.spec_token_map is not None:
            token_map = load_token_map(config.spec_token_map, model.config.vocab_size)
        try:
            mtp = MtpDrafter(model, pool, kv_scales, token_map)
        except ValueError as error:  # a token map with an FP8 LM head
            raise MorionError(str(error)) from None
        return mtp
    return NgramDrafter()  # config.speculative == "ngram"


def _activation_reserve_bytes(
    config: EngineConfig, model: torch.nn.Module, spec: CacheSpec, device: torch.device, kv_scales: KVScales
) -> tuple[EngineConfig, int]:
    """CUDA memory kept free for activations: the peak of one warm-up forward of a full chunk, plus a
    margin for CUDA graphs and allocator fragmentation, plus the piecewise prefill graphs' memory
    (engine/prefill_graph_memory.py); the warm-up compiles the kernels of every shape of forward
    (runner/warmup.py). The config comes back with the default prefill graph buckets cut to those the
    device affords (and a line saying so)."""
    if device.type != "cuda":
        return config, 0
    if config.activation_reserve_gb is not None:
        return config, int(config.activation_reserve_gb * 2**30)
    tokens = min(config.chunk_size, model.config.max_position_embeddings)
    started = time.perf_counter()
    peak = measure_forward_peak_bytes(
        model,
        spec,
        tokens,
        device,
        kv_scales,
        FORWARD_GROUP_MAX_TOKENS,
        config.max_running_requests,
    )
    reserve = int(peak * 1.1) + _GRAPH_AND_WORKSPACE_RESERVE
    graphs = ""
    if config.cuda_graph and config.prefill_graph_buckets:
        config = affordable_default_buckets(config, peak, tokens, _device_room(device, reserve))
    if config.cuda_graph and config.prefill_graph_buckets:
        largest = max(config.prefill_graph_buckets)
        graph_bytes = graph_memory_bytes(peak, tokens, largest)
        reserve += graph_bytes
        graphs = f", {graph_bytes / 2**30:.2f} GiB of it for prefill graphs up to {largest} tokens"
    print(
        f"morion: warm-up forward of {tokens} tokens: activation peak {peak / 2**30:.2f} GiB "
        f"({time.perf_counter() - started:.1f} s, includes kernel compilation); "
        f"reserving {reserve / 2**30:.2f} GiB{graphs}",
        file=sys.stderr,
    )
    return config, reserve


def _device_room(device: torch.device, activation_reserve: int) -> int:
    """Bytes free on the device now, less the activation reserve (never negative)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free - activation_reserve)


def _running_requests_that_fit(bytes_per_slot: int, per_request: int, scratch_slots: int, room: int) -> int:
    """The most running requests whose state slots (`per_request` each, plus the CUDA graphs' scratch
    slots) take at most _STATE_SHARE of `room`, the bytes free after the weights and the activation
    reserve; the rest stays for the K/V pool. 0 where not even one fits."""
    return max(0, (int(room * _STATE_SHARE) // bytes_per_slot - scratch_slots) // per_request)


def _require_room_for_state_slots(
    config: EngineConfig, bytes_per_slot: int, slots: int, per_request: int, room: int
) -> None:
    """A MorionError naming the flag when `slots` state slots do not fit the `room` left after the weights
    and the activation reserve (the K/V pool comes after them), rather than CUDA's out-of-memory error;
    it says how many running requests would fit."""
    need = slots * bytes_per_slot
    if need <= room:
        return
    flag = (
        f"--state-slots {config.state_slots}"
        if config.state_slots
        else f"--max-running-requests {config.max_running_requests}"
    )
    fits = room // bytes_per_slot // per_request
    raise MorionError(
        f"{flag} needs {slots} state slots of {bytes_per_slot / 2**20:.1f} MiB ({need / 2**30:.2f} GiB), "
        f"more than the {room / 2**30:.2f} GiB free after the weights and the activation reserve; "
        f"{fits} running requests would fill it and leave no K/V pool: try --max-running-requests "
        f"{max(1, fits // 2)}"
    )


def _num_pages(
    config: EngineConfig, bytes_per_page: int, state_bytes: int, activation_reserve: int, weight_bytes: int
) -> int:
    """Pages for the K/V pool: an explicit token count or size, or what is really free on the device
    (after weights, state slots and the activation reserve) times `mem_fraction`."""
    device = config.torch_device
    if config.kv_cache_tokens is not None:
        pages = -(-config.kv_cache_tokens // config.page_size)
        if device.type == "cuda":
            room = _device_room(device, activation_reserve)
            if pages * bytes_per_page > room:
                raise MorionError(
                    f"--kv-cache-tokens {config.kv_cache_tokens} needs "
                    f"{pages * bytes_per_page / 2**30:.2f} GiB, more than the {room / 2**30:.2f} GiB free "
                    f"after weights, state slots and the activation reserve "
                    f"({activation_reserve / 2**30:.2f} GiB): at most "
                    f"{room // bytes_per_page * config.page_size} tokens fit; leave it out to take what is "
                    "free"
                )
        return pages
    if config.kv_cache_gb is not None:
        budget = config.kv_cache_gb * 2**30 - state_bytes
    elif device.type == "cuda":
        budget = _device_room(device, activation_reserve) * config.mem_fraction
    else:
        budget = _CPU_DEFAULT_KV_GB * 2**30 - state_bytes
    if budget < bytes_per_page:
        raise MorionError(
            f"no memory left for the KV pool: {budget / 2**30:.2f} GiB after weights "
            f"({weight_bytes / 2**30:.2f} GiB), state slots ({state_bytes / 2**30:.2f} GiB) "
            f"and the "
            f"activation reserve ({activation_reserve / 2**30:.2f} GiB); try --weight-dtype fp8, "
            "--kv-cache-dtype fp8, fewer --state-slots or a smaller --chunk-size"
        )
    return int(budget // bytes_per_page)


def _build_tiers(
    config: EngineConfig,
    spec: CacheSpec,
    loaded: LoadedModel,
    pool: PagePool,
    state_slots: StateSlots | None,
    prefix_cache: RadixCache,
    stats: CacheStats,
    tensor_parallel: TensorParallel,
    mirror: StepMirror | None,
) -> CacheTiers | None:
    if config.host_cache_gb is None:
        return None
    device = config.torch_device
    model = loaded.model
    host_bytes = int(config.host_cache_gb * 2**30)
    try:
        num_pages, num_snapshots = CacheTiers.host_rows(spec, host_bytes, config.host_cache_state_fraction)
    except ValueError as error:
        raise MorionError(f"host_cache_gb {config.host_cache_gb}: {error}") from None
    copy_engine = make_copy_engine(device)
    if mirror is not None:
        copy_engine = MirroredCopyEngine(copy_engine, mirror)
    tiers = CacheTiers(
        pool,
        state_slots,
        copy_engine,
        num_pages,
        num_snapshots,
        pin_memory=device.type == "cuda",
        write_policy=config.host_cache_write_policy,
        stats=stats,
    )
    tiers.mirror = mirror
    if config.host_cache_write_policy == "write_back":
        prefix_cache.evict_listener = tiers.on_device_evict
    if config.disk_cache_dir is not None:
        root = Path(config.disk_cache_dir).expanduser()
        # Each rank keeps its shard in a namespace of its own on the same disk: a share of the budget each.
        ranks = tensor_parallel.size
        budget = int(config.disk_cache_gb * 2**30 / ranks) if config.disk_cache_gb is not None else None
        identity = {
            "model": {
                "config_digest": config_digest(loaded.hf_config),
                "weights_digest": weights_digest(model),
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "weight_dtype": config.weight_dtype,
            }
        }
        if merged_groups(model):
            # Merged decode projections may round a column differently (layers/merged_linears.py): a
            # conversation cached by one setting is never restored under the other. Read off the model,
            # not the flag: a model an earlier engine merged stays merged under `--no-merged-projections`.
            identity["model"]["merged_projections"] = True
        if config.qsa_prefill != "split" and any(isinstance(m, QSAAttention) for m in model.modules()):
            # Another prefill kernel sums a QSA row's keys in another order: a conversation cached by one
            # is never restored under the other.
            identity["model"]["qsa_prefill"] = config.qsa_prefill
        if config.moe_kernel != "auto":
            # Another expert kernel for some batch sizes: other bits for the prompts computed there.
            identity["model"]["moe_kernel"] = config.moe_kernel
        experts = [m.prefill_identity() for m in model.modules() if isinstance(m, StackedExperts)]
        moe_prefill = sorted({kernel for kernel in experts if kernel is not None})
        if moe_prefill:
            # The fused kernels' grouped mode (a device's tuned entry under auto) computes a prompt's
            # chunks in other bits than torch's grouped GEMMs, and one entry's tiles in other bits than
            # another's: a conversation cached under one is never restored under another.
            identity["model"]["moe_prefill"] = moe_prefill
        if tensor_parallel.size > 1:  # a rank's shard: never read by another layout or another rank
            identity["tensor_parallel"] = {"size": tensor_parallel.size, "rank": tensor_parallel.rank}
        info = {
            "model_name": Path(str(loaded.path)).name,
            "model_type": model.config.model_type,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "morion_version": morion.__version__,
        }
        store = open_disk_store(
            root, identity, info, spec, budget, direct_io=config.disk_cache_direct_io, budget_share=1 / ranks
        )
        tiers.attach_disk(store)
    return tiers
