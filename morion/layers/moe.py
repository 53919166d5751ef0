"""Sparse mixture-of-experts block with a gated shared expert (Qwen3-Next / Qwen3-MoE family).

    probs   = softmax(router(x)) over all experts, in fp32
    top-k   = the k largest probs, renormalised to sum 1 when `norm_topk_prob`
    out     = sum_top-k p_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

When the shared expert is as wide as a routed one it is stacked as one more expert (`SparseMoE`'s
`shared_slot`), and the last sum is the routed kernels' k + 1-th term. Under `--weight-dtype nvfp4` it is
the one expert of an FP8 stack beside the NVFP4 ones (`shared_experts`), its term the k + 1-th slot
still.

Routed expert weights are stacked ([E, 2I, H] gate|up and [E, H, I] down) so a grouped GEMM can take
them whole; the loader scatters per-expert checkpoint tensors into them. Under `--weight-dtype fp8` they
are e4m3 with one fp32 scale per (expert, output channel); under `--weight-dtype nvfp4` packed E2M1 codes
with e4m3 block scales and a global scale per (expert, projection) (ops/nvfp4.py), which stay packed on
CUDA: the NVFP4 Triton kernels expand them in registers (ops/moe_nvfp4_triton.py), and no path
dequantizes a copy. Which kernel runs them on CUDA is the engine's `--moe-kernel` choice, set on every
`StackedExperts` of a model by `set_moe_kernel`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from morion.config import MOE_KERNELS
from morion.layers.mlp import SwiGLU
from morion.layers.narrow_linear import NarrowLinear
from morion.ops.fp8 import FP8_DTYPE, QuantizedRows
from morion.ops.log_once import log_once
from morion.ops.moe import moe_experts_dense, moe_experts_grouped, moe_experts_reference
from morion.ops.moe_tiles import tuned_grouped_on
from morion.ops.nvfp4 import GROUP_SIZE
from morion.ops.skinny_tiles import linear_forward
from morion.ops.slot_partials import SlotPartials

# How stacked experts store their weights: the model dtype, e4m3 with per-row scales, or NVFP4.
EXPERT_FORMATS = ("model", "fp8", "nvfp4")

logger = logging.getLogger(__name__)

# `auto` runs the fused kernels up to this many tokens, larger batches the grouped GEMMs (which read the
# weights faster once most experts are hit). The fused kernels' tiles never depend on the token count
# (ops/moe_tiles.py), so up to here a token's result is the same in every batch: the engine's decode and
# short-chunk forwards stay within it, and a request answers the same whatever else runs beside it
# (a restored conversation as its cold run did). The H200 measured the fused kernels ahead of the grouped
# GEMMs up to 16 tokens at the 80B preset's expert shapes (FP8: 2.3x at 1 token, 1.45x at 4, 1.14x at 16;
# results/2026-11-30-h200-moe-kernels.md); from 17 to 64 they are kept for that invariance.
AUTO_TRITON_MAX_TOKENS = 64


class StackedExperts(nn.Module):
    """gate_up_proj [E, 2I, H], down_proj [E, H, I] in the model dtype, or as `weights` says:

    - "fp8": e4m3, with fp32 scale buffers gate_up_proj_scale [E, 2I] and down_proj_scale [E, H].
    - "nvfp4": uint8 codes gate_up_proj [E, 2I, H/2] and down_proj [E, H, I/2] (two a byte), e4m3 block
      scales gate_up_proj_scale [E, 2I, H/16] and down_proj_scale [E, H, I/16], and fp32 global scales
      gate_up_proj_scale_2 [E, 2] (gate rows, up rows: ModelOpt quantizes them apart) and
      down_proj_scale_2 [E, 1].

    Scales are buffers: checkpoint tensors of an NVFP4 checkpoint, derived at load otherwise. `kernel` is
    one of MOE_KERNELS (`set_moe_kernel`); it matters only on CUDA."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, weights: str = "model"
    ) -> None:
        super().__init__()
        if weights not in EXPERT_FORMATS:
            raise ValueError(f"expert weights must be one of {', '.join(EXPERT_FORMATS)}, got {weights!r}")
        self.kernel = "auto"
        self.weights = weights
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        gate_up_shape = (num_experts, 2 * intermediate_size, hidden_size)
        down_shape = (num_experts, hidden_size, intermediate_size)
        scales: dict[str, torch.Tensor | None] = {"gate_up_proj_scale": None, "down_proj_scale": None}
        if weights == "nvfp4":
            gate_up = torch.empty(*gate_up_shape[:2], hidden_size // 2, dtype=torch.uint8)
            down = torch.empty(*down_shape[:2], intermediate_size // 2, dtype=torch.uint8)
            e4m3 = torch.float8_e4m3fn
            scales = {
                "gate_up_proj_scale": torch.ones(*gate_up_shape[:2], hidden_size // GROUP_SIZE, dtype=e4m3),
                "down_proj_scale": torch.ones(*down_shape[:2], intermediate_size // GROUP_SIZE, dtype=e4m3),
                "gate_up_proj_scale_2": torch.ones(num_experts, 2, dtype=torch.float32),
                "down_proj_scale_2": torch.ones(num_experts, 1, dtype=torch.float32),
            }
        else:
            dtype = FP8_DTYPE if weights == "fp8" else None
            gate_up = torch.empty(gate_up_shape, dtype=dtype)
            down = torch.empty(down_shape, dtype=dtype)
            if weights == "fp8":
                scales = {
                    "gate_up_proj_scale": torch.ones(gate_up_shape[:2], dtype=torch.float32),
                    "down_proj_scale": torch.ones(down_shape[:2], dtype=torch.float32),
                }
        trainable = weights == "model"
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=trainable)
        self.down_proj = nn.Parameter(down, requires_grad=trainable)
        self.gate_up_proj_scale: torch.Tensor | None
        self.down_proj_scale: torch.Tensor | None
        for name, scale in scales.items():
            self.register_buffer(name, scale)

    @property
    def fp8(self) -> bool:
        return self.weights == "fp8"

    @property
    def nvfp4(self) -> bool:
        return self.weights == "nvfp4"

    def _scales(self) -> dict[str, torch.Tensor | None]:
        scales = {"gate_up_scale": self.gate_up_proj_scale, "down_scale": self.down_proj_scale}
        if self.nvfp4:
            scales.update(gate_up_scale_2=self.gate_up_proj_scale_2, down_scale_2=self.down_proj_scale_2)
        return scales

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quantized: QuantizedRows | None = None,
        unsummed: bool = False,
    ) -> torch.Tensor | SlotPartials:
        """x [T, H] through the routed experts; `quantized`: FP8 experts only, x's rows already quantized
        per row (`quantize_fp8(x, per_row=True)`'s values), which every FP8 path reads instead of
        quantizing x again. With `unsummed`, the fused decode kernels (the "triton" path, FP8, bf16 or
        NVFP4) return each token's slots before their sum (`SlotPartials`) for a caller that adds them in
        its next kernel; the other paths return [T, H] as always."""
        if quantized is not None and not self.fp8:
            raise ValueError(
                f"pre-quantized rows were given to {self.weights} experts, which do not read them"
            )
        path = self._path(x, topk_ids.numel())
        if path == "dense":
            return moe_experts_dense(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        if self.nvfp4 and path != "reference":
            from morion.ops.moe_nvfp4_triton import moe_experts_nvfp4

            experts = functools.partial(
                moe_experts_nvfp4, grouped=path == "grouped", unsummed=unsummed and path == "triton"
            )
        elif path in ("triton", "triton-grouped"):
            from morion.ops import moe_decode_triton as fused

            fused_experts = fused.moe_expert_partials if unsummed else fused.moe_experts_triton
            experts = functools.partial(fused_experts, grouped=path == "triton-grouped")
        else:
            experts = moe_experts_grouped if path == "grouped" else moe_experts_reference
        options: dict[str, torch.Tensor | QuantizedRows | None] = {**self._scales()}
        if self.fp8:  # the kernels of other formats read x as it is
            options["quantized"] = quantized
        return experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, **options)

    def _path(self, x: torch.Tensor, num_pairs: int) -> str:
        """ "triton" on CUDA for at most AUTO_TRITON_MAX_TOKENS tokens under `kernel == "auto"` (any number
        under "triton") within the fused kernels' MAX_PAIRS (token, expert) pairs (any weight dtype and
        shapes); past them under "triton", "triton-grouped" (the same kernels' grouped mode) for all but
        NVFP4 experts, which have grouped kernels of their own, and under "auto" too where this device's
        tuned file holds grouped tiles measured ahead of torch's grouped GEMMs at this shape
        (ops/moe_tune_grouped.py); otherwise "grouped" where a
        grouped kernel exists: CUDA with bf16 or FP8 weights (other dtypes take `_grouped_mm`'s per-expert
        loop, which syncs with the host) and 16-byte aligned rows, or NVFP4 weights (their own grouped
        Triton kernels, any shape); "dense" for other unquantized weights on CUDA (no host sync, so decode
        stays capturable); else "reference"."""
        dtype = self.gate_up_proj.dtype
        if not x.is_cuda:
            log_once(logger, f"MoE experts on {x.device.type}: reference (a loop over the routed experts)")
            return "reference"
        fused_limit = {"triton": x.shape[0], "auto": AUTO_TRITON_MAX_TOKENS}.get(self.kernel, 0)
        if x.shape[0] <= fused_limit:
            from morion.ops import moe_decode_triton as fused

            if num_pairs <= fused.MAX_PAIRS:
                weights = ", nvfp4 weights expanded in registers" if self.nvfp4 else ""
                log_once(logger, f"MoE experts on cuda: fused Triton kernels ({self.kernel}{weights})")
                return "triton"
        if self.nvfp4:
            log_once(logger, "MoE experts on cuda: grouped Triton kernels, nvfp4 expanded in registers")
            return "grouped"
        if self.kernel == "triton":
            log_once(
                logger, "MoE experts on cuda: grouped Triton kernels past the fused ones' pairs (triton)"
            )
            return "triton-grouped"
        if self.kernel == "auto" and self._tuned_grouped_faster(x):
            log_once(
                logger,
                "MoE experts on cuda: grouped Triton kernels past the fused ones' pairs (auto: this device's "
                "tuned grouped tiles measured ahead of torch's grouped GEMMs)",
            )
            return "triton-grouped"
        # FP8 wants multiples of 16 elements (1 byte each), bf16 multiples of 8 (2 bytes each).
        multiple = 16 if self.fp8 else 8
        aligned = self.hidden_size % multiple == 0 and self.intermediate_size % multiple == 0
        if aligned and dtype in (torch.bfloat16, FP8_DTYPE):
            kernel = "torch._scaled_grouped_mm (fp8 rowwise)" if self.fp8 else "torch._grouped_mm (bf16)"
            log_once(logger, f"MoE experts on cuda: grouped GEMM, {kernel}")
            return "grouped"
        why = (
            f"{dtype} weights" if aligned else f"H={self.hidden_size}, I={self.intermediate_size} not aligned"
        )
        if self.fp8:
            log_once(logger, f"MoE experts on cuda: reference (a loop over the routed experts), {why}")
            return "reference"
        log_once(logger, f"MoE experts on cuda: every expert on every token, masked ({why})")
        return "dense"

    def prefill_identity(self) -> str | None:
        """What this module runs for a prefill chunk past the fused kernels (`_path` on its weights'
        device), where the disk tier's namespace must name it (engine/assembly.py): the fused kernels'
        grouped mode, or NVFP4's grouped kernels with a device's tuned entry, with their rows, promotion
        and tiles. Another kernel or tile computes a prompt's K/V and states in other bits, and a
        conversation cached under one is never restored under another. None where prefill runs what it
        always has by default (torch's grouped GEMMs, NVFP4's default tiles, the CPU's reference)."""
        from morion.ops.moe_decode_triton import MAX_PAIRS, grouped_choice

        rows = self.gate_up_proj.new_empty(AUTO_TRITON_MAX_TOKENS + 1, 0)
        path = self._path(rows, MAX_PAIRS + 1)
        if path == "triton-grouped":
            tiles = grouped_choice(rows, self.gate_up_proj, self.down_proj)
        elif path == "grouped" and self.nvfp4:
            tiles = tuned_grouped_on(rows.device, self.gate_up_proj, self.down_proj)
            if tiles is None:
                return None
            path = "nvfp4-grouped"
        else:
            return None
        return (
            f"{path} block_m={tiles.block_m} promote_k={tiles.promote_k} "
            f"gate_up={tuple(tiles.gate_up)} down={tuple(tiles.down)}"
        )

    def _tuned_grouped_faster(self, x: torch.Tensor) -> bool:
        tuned = tuned_grouped_on(x.device, self.gate_up_proj, self.down_proj)
        return tuned is not None and tuned.faster


def set_moe_kernel(model: nn.Module, kernel: str) -> None:
    """Sets which kernel every routed-experts module of `model` (MTP head included) runs on CUDA:
    EngineConfig.moe_kernel, one of MOE_KERNELS."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"moe kernel must be one of {', '.join(MOE_KERNELS)}, got {kernel!r}")
    for module in model.modules():
        if isinstance(module, StackedExperts):
            module.kernel = kernel


class SparseMoE(nn.Module):
    """The routed experts, the router (`gate`) and the gated shared expert, in one of three layouts:

    - separate: `shared_expert` (a SwiGLU) and `shared_expert_gate` (one output) beside the routed experts,
      `out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)`;
    - stacked (`stack_shared_expert`, when the shared expert is as wide as a routed one): the shared
      expert is expert `shared_slot` = E of `experts` (E + 1 stacked) and its gate's weight row E of the
      router's (`router_logits`). `route` appends slot E to every token's top-k with weight
      sigmoid(gate logit), so the routed kernels compute the whole block and the shared expert launches
      only its gate's product (of a decode step's ~12 kernels per layer: docs/models.md). The same sum;
      only the rounding of the final add differs (the experts' kernels accumulate the k + 1 terms
      together).
    - beside (`set_shared_expert_beside`, built by `--weight-dtype nvfp4`): the shared expert is the one
      expert of a stack of its own, `shared_experts` (FP8 under nvfp4, while the routed `experts` are
      NVFP4), its gate row E of the router as when stacked. `route_apart` gives each stack its own
      columns; on the fused decode kernels each stack leaves its slots unsummed and the block returns
      the k + 1 slots in the stacked order for the kernel after the block to add. So the shared expert
      costs three kernels a layer (its row quantization, gate_up, down) instead of a SwiGLU's dozen.
    """

    shared_expert: SwiGLU | None
    shared_expert_gate: NarrowLinear | None
    shared_experts: StackedExperts | None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_expert_intermediate_size: int,
        norm_topk_prob: bool,
        stack_shared_expert: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the {num_experts} experts")
        if stack_shared_expert and shared_expert_intermediate_size != intermediate_size:
            raise ValueError(
                f"a shared expert of width {shared_expert_intermediate_size} cannot stack with routed "
                f"experts of width {intermediate_size}"
            )
        self.hidden_size = hidden_size
        self.num_experts = num_experts  # routed experts, the shared slot not counted
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        # Where the shared expert sits in `experts` and its gate's row in `gate`; None: not stacked.
        self.shared_slot: int | None = num_experts if stack_shared_expert else None
        stacked = int(stack_shared_expert)
        self.gate = nn.Linear(hidden_size, num_experts + stacked, bias=False)  # the router
        self.experts = StackedExperts(num_experts + stacked, hidden_size, intermediate_size)
        self.shared_experts = None
        if stack_shared_expert:
            self.shared_expert = self.shared_expert_gate = None
        else:
            self.shared_expert = SwiGLU(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = NarrowLinear(hidden_size, 1, bias=False)  # batch-invariant rows

    def set_shared_expert_beside(self) -> None:
        """Rebuilds the block in the beside layout, unfilled, on the same device and dtype (the meta
        device: called by `--weight-dtype nvfp4`'s conversion, which makes `shared_experts` FP8 and the
        routed experts NVFP4). Any width of shared expert goes beside; a beside block stays as it is."""
        if self.shared_experts is not None:
            return
        weight = self.gate.weight
        with torch.device(weight.device):
            self.gate = nn.Linear(self.hidden_size, self.num_experts + 1, bias=False, dtype=weight.dtype)
            if self.shared_slot is not None:  # the routed experts alone
                self.experts = StackedExperts(
                    self.num_experts, self.hidden_size, self.experts.intermediate_size
                ).to(weight.dtype)
            self.shared_experts = StackedExperts(
                1, self.hidden_size, self.shared_expert_intermediate_size
            ).to(weight.dtype)
        self.shared_expert = self.shared_expert_gate = None
        self.shared_slot = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] in x's dtype, topk_ids [T, k]); stacked, [T, k + 1] with the shared slot
        last, weighted by sigmoid(its logit) (outside the renormalisation of the routed k)."""
        logits, shared_logits = self.router_logits(x)
        if logits.is_cuda:
            from morion.ops import router_triton

            if router_triton.supports(logits, self.top_k):
                log_once(logger, "MoE router: one Triton kernel (softmax, top-k, renormalisation)")
                return router_triton.route(logits, self.top_k, self.norm_topk_prob, shared_logits)
        return route_reference(logits, self.top_k, self.norm_topk_prob, shared_logits)

    def route_apart(
        self, x: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The beside layout's route: ((weights, ids) [T, k] of the routed experts, (weights, ids) [T, 1]
        of `shared_experts`, ids 0): `route`'s weights, each stack's columns contiguous."""
        logits, shared_logits = self.router_logits(x)
        if shared_logits is None:
            raise ValueError("route_apart is for a block whose router has the shared expert's gate row")
        if logits.is_cuda:
            from morion.ops import router_triton

            if router_triton.supports(logits, self.top_k):
                return router_triton.route_apart(logits, self.top_k, self.norm_topk_prob, shared_logits)
        weights, ids = route_reference(logits, self.top_k, self.norm_topk_prob, shared_logits)
        k = self.top_k
        shared = (weights[:, k:].contiguous(), torch.zeros_like(ids[:, k:]))
        return (weights[:, :k].contiguous(), ids[:, :k].contiguous()), shared

    def router_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the routed experts' logits [T, E], the shared expert's gate logit [T, 1] where the router holds
        its row (stacked, beside), else None): one product over the gate's E (+ 1) rows, its column E the
        shared gate's logit. At decode sizes on CUDA it is the skinny kernel (`skinny_tiles.product`),
        each column summed in one fixed order whatever N and M, so a token routes the same in every batch.
        cuBLAS with N = E + 1 did not (the H200's decode-invariance test failed:
        `results/2026-12-02-h200-gpu-check-b158263.md`); it now runs only long prefill chunks, which a
        cache hit never recomputes."""
        logits = linear_forward(self.gate, x)
        if logits.shape[-1] == self.num_experts:
            return logits, None
        return logits[:, : self.num_experts], logits[:, self.num_experts :]

    @property
    def reads_fp8_rows(self) -> bool:
        """Whether `forward` reads x quantized per row (FP8 routed experts, set by `--weight-dtype fp8`'s
        conversion, or the FP8 shared stack beside NVFP4 experts): then a caller that has the rows
        quantized passes them (`quantized`). The router reads x itself, in the model dtype."""
        return self.experts.fp8 or (self.shared_experts is not None and self.shared_experts.fp8)

    def forward(
        self, x: torch.Tensor, quantized: QuantizedRows | None = None, unsummed: bool = False
    ) -> torch.Tensor | SlotPartials:
        """x [T, H]; `quantized`: x's rows quantized per row, for FP8 experts (`reads_fp8_rows`).
        `unsummed`: the caller adds the output to its residual stream in a kernel that takes the experts'
        unsummed slots (`SlotPartials`, from the fused decode kernels of a stacked or beside block; any
        other path returns [T, H])."""
        if self.shared_experts is not None:
            return self._forward_beside(x, quantized, unsummed)
        if self.shared_expert is None or self.shared_expert_gate is None:
            topk_weights, topk_ids = self.route(x)
            # The shared expert is one of them.
            return self.experts(x, topk_weights, topk_ids, quantized, unsummed=unsummed)
        shared = self.shared_expert(x)
        topk_weights, topk_ids = self.route(x)
        routed = self.experts(x, topk_weights, topk_ids, quantized)
        return routed + F.sigmoid(self.shared_expert_gate(x)) * shared

    def _forward_beside(
        self, x: torch.Tensor, quantized: QuantizedRows | None, unsummed: bool
    ) -> torch.Tensor | SlotPartials:
        """Each stack on its own columns of the route. Where both return their slots (the fused decode
        kernels) the block's k + 1 slots are theirs side by side, summed by the caller's kernel, or here
        by the same sum (so a token's output never depends on which caller reads it); elsewhere the two
        sums are added."""
        assert self.shared_experts is not None
        (routed_weights, routed_ids), (shared_weights, shared_ids) = self.route_apart(x)
        routed = self.experts(
            x, routed_weights, routed_ids, quantized if self.experts.fp8 else None, unsummed=True
        )
        shared = self.shared_experts(
            x, shared_weights, shared_ids, quantized if self.shared_experts.fp8 else None, unsummed=True
        )
        if isinstance(routed, SlotPartials) and isinstance(shared, SlotPartials):
            slots = SlotPartials(torch.cat((routed.values, shared.values), dim=1), routed.dtype)
            return slots if unsummed else slots.summed()
        return _summed(routed) + _summed(shared)


def _summed(output: torch.Tensor | SlotPartials) -> torch.Tensor:
    return output.summed() if isinstance(output, SlotPartials) else output


def route_reference(
    logits: torch.Tensor, top_k: int, normalize: bool, shared_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The route in torch (ops/router_triton.py's reference): softmax over the routed logits [T, E] in
    fp32, the top k, renormalised with `normalize`, in the logits' dtype. With `shared_logits` [T, 1] (the
    shared expert's gate), its slot E is appended to every token's top-k with weight sigmoid(logit) (fp32,
    then the logits' dtype, as `F.sigmoid` of the separate gate rounds it)."""
    num_routed = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    if shared_logits is None:
        return weights, ids
    gate = torch.sigmoid(shared_logits.float()).to(logits.dtype)
    return torch.cat((weights, gate), dim=-1), torch.cat(
        (ids, torch.full_like(ids[:, :1], num_routed)), dim=-1
    )
