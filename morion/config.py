"""The one frozen engine configuration that CLI flags map onto, with automatic choices resolved.

torch is imported only where a value needs it: the server's front end builds and pickles an
`EngineConfig` to start the engine process before it imports anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from morion.errors import MorionError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("auto", "fp8", "nvfp4")
KV_CACHE_DTYPES = ("auto", "fp8", *DTYPE_NAMES)
# Speculative decoding drafters selectable by name (the synthetic benchmark drafter is passed in code).
SPECULATIVE_METHODS = ("off", "ngram", "mtp")
# Where tables a model keeps in host memory live (Qwen3.8-Flash-Next's PLE table; layers/host_table.py).
PLE_PLACEMENTS = ("ram", "mmap")
# Routed-expert kernels on CUDA (layers/moe.py): auto is grouped until H200 measurements favour triton.
MOE_KERNELS = ("auto", "grouped", "triton")
QSA_PREFILL_KERNELS = ("split", "selected")
# Programmatic dependent launch of the Triton kernels (ops/pdl.py): auto (prefetch where the device has
# PDL, else off, silently), off, the launch overlap, or that and the skinny linears' weights prefetched
# into L2 before each waits.
PDL_MODES = ("auto", "off", "launch", "prefetch")
# Token buckets of piecewise prefill graphs where none are given (runner/prefill_graph.py), those below the
# chunk size and the chunk size itself, so that a whole chunk replays. Qualified on the H200 with the 80B
# (run 13: every restored answer identical to cold; 1K TTFT through the server 262-304 -> 151 ms).
DEFAULT_PREFILL_GRAPH_TOKENS = (256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a path, a known model name, preset:NAME, or None for the default model
    load_format: str = "auto"  # auto: read the weights; dummy: random weights of the real shapes
    seed: int = 0  # for dummy weights
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    state_dtype: str = "float32"  # recurrent state of Gated DeltaNet layers (float32 or bfloat16)
    page_size: int = 16  # tokens per K/V page
    kv_cache_tokens: int | None = None  # pool capacity in tokens; None: sized from kv_cache_gb
    kv_cache_gb: float | None = None  # None: 1 GiB on CPU, mem_fraction of free memory on CUDA
    mem_fraction: float = 0.85  # share of free device memory the pool may take (CUDA)
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    chunk_size: int = 4096  # token budget of one engine step (chunked prefill)
    max_running_requests: int = 64
    state_slots: int | None = None  # per-request state slots (hybrid models); None: 4 per running request
    enable_prefix_cache: bool = True
    host_cache_gb: float | None = None  # host-RAM tier (pinned on CUDA) behind the device cache; None: off
    host_cache_write_policy: str = "write_through"  # or write_back: copy to host only on device eviction
    host_cache_state_fraction: float = 0.25  # share of host_cache_gb for state snapshots (hybrid models)
    disk_cache_dir: str | None = None  # disk tier root (a namespace directory per model inside); needs host
    disk_cache_gb: float | None = None  # disk tier budget; None: half of (free space + its objects) at start
    disk_cache_direct_io: bool = False  # write disk objects with O_DIRECT (else buffered: page-cache warm)
    # auto: the model dtype; fp8: dense projections, experts, LM head in e4m3; nvfp4: the same with the
    # routed experts in NVFP4 (4-bit codes, e4m3 scales per 16: ops/nvfp4.py)
    weight_dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model dtype; fp8: e4m3 K/V with per-layer scales
    cuda_graph: bool = True  # decode steps replay CUDA graphs captured per batch-size bucket (CUDA only)
    cuda_graph_max_batch: int = 64  # largest decode batch captured; larger batches run eager
    # Token buckets of piecewise prefill graphs (runner/prefill_graph.py): a prefill forward of up to the
    # largest replays the smallest bucket that holds it. None: DEFAULT_PREFILL_GRAPH_TOKENS (see
    # `prefill_graph_buckets`); empty: off, prefill runs eagerly. CUDA with decode graphs only.
    prefill_graph_tokens: tuple[int, ...] | None = None
    activation_reserve_gb: float | None = None  # CUDA memory kept for activations; None: measured
    moe_kernel: str = "auto"  # CUDA: fused Triton kernels to 64 tokens, else grouped GEMMs (layers/moe.py)
    # CUDA: linear layers of one input (attention's q/k/v, ...) as one weight and one decode launch
    # (layers/merged_linears.py); False keeps one launch per layer (for A/B measurements)
    merge_projections: bool = True
    pdl: str = "auto"  # ops/pdl.py: auto is prefetch on Hopper and later (measured on the H200), else off
    # Qwen3.8-Flash-Next's long prefill pieces on CUDA: QSA's split-KV kernel (split), or the selected-blocks
    # kernel up to a context limit (selected: layers/qsa_attention.py; H200: +23 % at 8K, +5 % at 32K; not
    # yet qualified through the server)
    qsa_prefill: str = "split"
    # Decode steps launched before the previous step's tokens reach the host, for requests whose sampling
    # reads only their logits (engine/overlap.py; H200: no gain on the 80B, whose step is the device's time)
    overlap_decode: bool = False
    speculative: str = "off"  # off | ngram: draft tokens verified in one forward (docs/speculative.md)
    spec_policy: str | None = None  # width policy JSON file; None: the default policy
    spec_width: int | None = None  # a fixed draft width instead of the policy
    spec_token_map: str | None = None  # FR-Spec reduced draft vocabulary for the MTP head (frspec build)
    ple_placement: str = "ram"  # PLE n-gram table: ram (pinned on CUDA), or mmap of the checkpoint files
    tensor_parallel_size: int = 1  # ranks the model is split over, one process and device each (issue #28)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise MorionError(f"unsupported dtype {self.dtype!r} (choose auto, {', '.join(DTYPE_NAMES)})")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise MorionError(f"state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise MorionError(f"page_size must be a power of two, got {self.page_size}")
        positive = {
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_cache_gb": self.kv_cache_gb,
            "max_model_len": self.max_model_len,
            "chunk_size": self.chunk_size,
            "max_running_requests": self.max_running_requests,
            "state_slots": self.state_slots,
            "cuda_graph_max_batch": self.cuda_graph_max_batch,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise MorionError(f"{name} must be positive, got {value}")
        if self.chunk_size < self.page_size:
            raise MorionError(
                f"chunk_size ({self.chunk_size}) must be at least page_size ({self.page_size}): prefill "
                "chunks end on page boundaries"
            )
        if not 0 < self.mem_fraction <= 1:
            raise MorionError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        for name in ("host_cache_gb", "disk_cache_gb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise MorionError(f"{name} must be positive, got {value}")
        if self.host_cache_write_policy not in ("write_through", "write_back"):
            raise MorionError(
                "host_cache_write_policy must be write_through or write_back, "
                f"got {self.host_cache_write_policy!r}"
            )
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise MorionError(
                f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise MorionError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        buckets = self.prefill_graph_buckets
        if list(buckets) != sorted(set(buckets)) or any(not 0 < b <= self.chunk_size for b in buckets):
            raise MorionError(
                f"prefill_graph_tokens must be distinct token counts in increasing order, each in [1, "
                f"chunk_size {self.chunk_size}], got {','.join(map(str, buckets))}"
            )
        if self.activation_reserve_gb is not None and self.activation_reserve_gb < 0:
            raise MorionError(f"activation_reserve_gb must be >= 0, got {self.activation_reserve_gb}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise MorionError(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}"
            )
        if self.spec_token_map is not None and self.speculative != "mtp":
            raise MorionError("spec_token_map is for the MTP drafter: set speculative to mtp")
        if self.spec_width is not None and self.spec_width < 1:
            raise MorionError(f"spec_width must be >= 1, got {self.spec_width}")
        if not 0 < self.host_cache_state_fraction < 1:
            raise MorionError(
                f"host_cache_state_fraction must be in (0, 1), got {self.host_cache_state_fraction}"
            )
        if self.disk_cache_dir is not None and self.host_cache_gb is None:
            raise MorionError(
                "disk_cache_dir needs host_cache_gb: disk objects are restored through host memory"
            )
        if self.moe_kernel not in MOE_KERNELS:
            raise MorionError(f"moe_kernel must be one of {', '.join(MOE_KERNELS)}, got {self.moe_kernel!r}")
        if self.qsa_prefill not in QSA_PREFILL_KERNELS:
            raise MorionError(
                f"qsa_prefill must be one of {', '.join(QSA_PREFILL_KERNELS)}, got {self.qsa_prefill!r}"
            )
        if self.pdl not in PDL_MODES:
            raise MorionError(f"pdl must be one of {', '.join(PDL_MODES)}, got {self.pdl!r}")
        if self.overlap_decode and (self.tensor_parallel_size > 1 or self.speculative != "off"):
            raise MorionError(
                "overlap_decode runs on one rank without speculative decoding (engine/overlap.py): set "
                "tensor_parallel_size 1 and speculative off, or leave overlap_decode off"
            )
        if self.tensor_parallel_size > 1 and self.spec_token_map is not None:
            # The reduced head takes rows of the LM head, which each rank holds a vocabulary block of.
            raise MorionError(
                "spec_token_map is not supported with tensor_parallel_size > 1 yet (docs/parallel.md)"
            )
        if self.ple_placement not in PLE_PLACEMENTS:
            raise MorionError(
                f"ple_placement must be one of {', '.join(PLE_PLACEMENTS)}, got {self.ple_placement!r}"
            )

    @property
    def prefill_graph_buckets(self) -> tuple[int, ...]:
        """The prefill graphs' token buckets: those given, else the defaults below the chunk size and the
        chunk size itself; none by default with tensor parallelism, where no GPU run has checked them
        yet (the qualification runs one GPU)."""
        if self.prefill_graph_tokens is not None:
            return self.prefill_graph_tokens
        if self.tensor_parallel_size > 1:
            return ()
        below = (tokens for tokens in DEFAULT_PREFILL_GRAPH_TOKENS if tokens < self.chunk_size)
        return (*below, self.chunk_size)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise MorionError(f"invalid device {self.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise MorionError(f"device {self.device!r} requested but CUDA is not available")
        return device

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        if self.kv_cache_dtype == "fp8":
            return torch.float8_e4m3fn
        return getattr(torch, self.kv_cache_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> torch dtype, built when first asked for (it imports torch)
        import torch

        value = {dtype: getattr(torch, dtype) for dtype in DTYPE_NAMES}
        globals()[name] = value
        return value
    raise AttributeError(f"module 'morion.config' has no attribute {name!r}")
