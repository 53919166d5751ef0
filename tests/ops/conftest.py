"""Shared helpers of the op tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from morion.ops.moe_tiles import ExpertShape
from morion.ops.moe_tune import capture_graph, random_batch, random_experts

# The MoE kernels' GPU tests run at Qwen3-Next shapes: E=512, top-10, H=2048, I=512.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 512, 2048, 512, 10
SHAPE = ExpertShape(EXPERTS, HIDDEN, INTERMEDIATE, "fp8")
MOE_KINDS = {"bf16": "bfloat16", "fp8": "fp8"}
CUDA = torch.device("cuda")
MoEBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PoolBackend:
    """One Gated DeltaNet layer's state pools behind both halves of `HybridBackend`: read/write_state
    gather and scatter the very rows the in-place kernels update, so one backend drives both paths."""

    def __init__(self, pools: dict[str, torch.Tensor], slots: list[int], lengths: list[int]) -> None:
        device = pools["recurrent"].device
        self.pools = pools
        self._rows = torch.tensor(slots, device=device)
        starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
        self.query_ranges = list(zip(starts[:-1], lengths, strict=True))
        self.decode_only = all(length == 1 for length in lengths)
        self.cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
        self.state_indices = torch.tensor(slots, dtype=torch.int32, device=device)

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.pools[component][self._rows].clone()

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        self.pools[component][self._rows] = value.to(self.pools[component].dtype)

    verify_slots = None  # never a speculative verify forward

    def outside_graph(self, op, *inputs: torch.Tensor) -> torch.Tensor:
        return op(self, *inputs)

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.pools[component]


@pytest.fixture(autouse=True)
def fp32_references_without_tf32():
    """Op tests compare against fp32 references; on a GPU, cuDNN and cuBLAS may run those in TF32
    (10-bit mantissa) unless told not to."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def pool_backend() -> type[PoolBackend]:
    """The `PoolBackend` class (test modules here do not import each other)."""
    return PoolBackend


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.fixture(scope="module")
def moe_experts() -> dict[str, dict[str, torch.Tensor]]:
    """The same random experts of the real shapes in bf16 and in FP8 with per-(expert, row) scales, on the
    GPU: {"bf16": {"gate_up", "down"}, "fp8": {"gate_up", "down", "gate_up_scale", "down_scale"}}."""
    return {kind: random_experts(SHAPE._replace(dtype=dtype), CUDA) for kind, dtype in MOE_KINDS.items()}


def make_moe_batch(tokens: int, seed: int) -> MoEBatch:
    """hidden [T, H] bf16 and a softmax top-k routing over random router logits, on the GPU."""
    return random_batch(SHAPE, tokens, TOP_K, CUDA, seed)


def graph_replays_with_new_routings(
    step: Callable[[list[torch.Tensor]], torch.Tensor], warmups: int = 2
) -> Iterator[tuple[MoEBatch, torch.Tensor]]:
    """`step(batch)` captured in a CUDA graph on a static batch of 16 tokens, then replayed with three new
    batches (new routings) copied into it: yields each batch with the replay's output, and checks that
    the output moved with the routing."""
    static = [t.clone() for t in make_moe_batch(16, seed=0)]
    outputs: list[torch.Tensor] = []
    graph = capture_graph(lambda: outputs.append(step(static)), warmups)
    previous = None
    for seed in (1, 2, 3):
        batch = make_moe_batch(16, seed)
        for buffer, value in zip(static, batch, strict=True):
            buffer.copy_(value)
        graph.replay()
        replayed = outputs[-1]
        yield batch, replayed
        if previous is not None:
            assert rel_l2(replayed, previous) > 0.5  # the new routing was used
        previous = replayed.clone()
