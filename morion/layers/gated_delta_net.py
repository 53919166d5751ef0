"""Gated DeltaNet (linear attention) as Qwen3-Next uses it.

Per token: project to q, k (H key heads), v, z (HV = r*H value heads), b, a (per value head); run q, k, v
through a causal depthwise conv (window W) + SiLU; beta = sigmoid(b), g = -exp(A_log) * softplus(a +
dt_bias); apply the gated delta rule (q, k L2-normalised, head h of q/k serving value heads h*r ..
h*r+r-1); normalise each value head and gate it by silu(z) (or sigmoid(z): `output_gate`); out_proj.

Each sequence carries two states between forwards (design.md §3): the conv window (its last W-1
pre-conv q|k|v vectors) and the recurrent state (HV x Dk x Dv). Both come from and go back to the
backend, so a chunk of any length continues exactly where the previous one stopped.

On CUDA the layer runs in-place kernels on the backend's state pools (`state_pool` + `state_indices`,
see hybrid_backend.py): our Triton conv and decode kernels (ops/*_triton.py) and fla-core's chunked
prefill. Elsewhere it runs the pure-torch references through `read_state` / `write_state`.

The projections are not rearranged: `project` returns views of the in_proj outputs as the checkpoint's
layout gives them (`Projections`), and the CUDA kernels read them in place (the conv through
`GroupedChannels`, the step kernels a and b as [T, H, r], the output norm z as [T, H, r, Dv]). A decode
step of the 80B model with FP8 weights and the H200's tuned tiles is 5 kernels: in_proj_qkvz (its input
comes quantized by the decoder layer's add + norm kernel: `reads_fp8_rows`) with in_proj_ba in the same
launch (layers/paired_products.py), the conv step, the gated-delta-rule step (its gates inside), the
gated norm with out_proj's activation quantization (one kernel), out_proj. The FP8 projections are the
skinny kernel each; a shape without a tuned tile takes cuBLAS's GEMM and a row-scale kernel, two.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS, HybridBackend
from morion.layers.linear_fp8 import Fp8Linear, all_fp8, linears_of_one_input
from morion.layers.norm_variants import GatedRMSNorm, SigmoidGatedRMSNorm
from morion.layers.paired_products import fp8_linear_and_product
from morion.ops.causal_conv1d import (
    GroupedChannels,
    causal_conv1d_reference,
    causal_conv1d_update_reference,
)
from morion.ops.fp8 import QuantizedRows, rows_quantized
from morion.ops.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)
from morion.ops.log_once import log_once
from morion.ops.skinny_tiles import linear_forward

logger = logging.getLogger(__name__)

OUTPUT_GATES = ("sigmoid", "silu")

# A conv and delta rule (`GatedDeltaNet._mix_cuda` / `_mix_reference`): (key width, value width, backend,
# conv input, b, a) -> out [T, HV, Dv].
Mix = Callable[[int, int, HybridBackend, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Projections(NamedTuple):
    """A forward's projected inputs, views of the in_proj outputs (no copies). Value head hv = h * r + j
    of H key-head groups of r: z, b and a come either head-major ([T, HV, Dv], [T, HV]) or group-first
    ([T, H, r, Dv], [T, H, r]); both index the same heads in the same order."""

    qkv: GroupedChannels  # the conv input; `.flat()` is mixed_qkv [T, conv_dim] (q | k | v)
    z: torch.Tensor  # the output gate's logits
    b: torch.Tensor  # beta's logits
    a: torch.Tensor  # the decay's logits (before dt_bias and softplus)

    def head_major(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed_qkv [T, conv_dim], z [T, HV, Dv], b [T, HV], a [T, HV]), copied where needed: what the
        references take."""
        tokens, dv = self.z.shape[0], self.z.shape[-1]
        return (
            self.qkv.flat(),
            self.z.reshape(tokens, -1, dv),
            self.b.reshape(tokens, -1),
            self.a.reshape(tokens, -1),
        )


class GatedDeltaNet(nn.Module):
    """`output_gate` "sigmoid" gates the normalised heads by sigmoid(z) instead of silu(z) (Qwen3.5's
    option). Subclasses with other projections override `_add_projections` and `project`."""

    def __init__(
        self,
        linear_ordinal: int,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        output_gate: str = "silu",
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads do not group over {num_k_heads} key heads")
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"output gate {output_gate!r} is not one of {', '.join(OUTPUT_GATES)}")
        self.linear_ordinal = linear_ordinal
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self._add_projections(hidden_size)
        # Only its weight [conv_dim, 1, W] is used (the checkpoint's layout); the conv runs in ops/.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False
        )
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        norm = SigmoidGatedRMSNorm if output_gate == "sigmoid" else GatedRMSNorm
        self.norm = norm(head_v_dim, rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _add_projections(self, hidden_size: int) -> None:
        """The input projections `project` reads (Qwen3-Next's group-first layout)."""
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    @property
    def reads_fp8_rows(self) -> bool:
        """Whether `forward` reads x quantized per row (FP8 input projections other than b and a, set by
        `--weight-dtype fp8`'s conversion): then a caller that has the rows quantized passes them."""
        return all_fp8(self._quantized_projections())

    def _quantized_projections(self) -> tuple[nn.Module, ...]:
        """The projections `project` gives x's quantized rows to under FP8 (b and a stay in the model
        dtype: models' `fp8_keep`)."""
        return (self.in_proj_qkvz,)

    def project(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> Projections:
        """The group-first projections as views: qkv [T, H, X] grouped, z [T, H, r, Dv], b and a [T, H, r];
        `quantized`: x's rows quantized per row, for an FP8 in_proj_qkvz (`linears_of_one_input`).

        The checkpoint orders in_proj_qkvz by key-head group: for group h, [q_h | k_h | v for its r
        value heads | z for its r value heads]; in_proj_ba likewise [b for its r heads | a for its r heads].
        Value head index = h * r + j.
        """
        tokens = x.shape[0]
        r = self.num_v_heads // self.num_k_heads
        qkvz, ba = self._project_qkvz_and_ba(x, quantized)
        qkvz = qkvz.view(tokens, self.num_k_heads, -1)
        value_width = r * self.head_v_dim
        z = qkvz[..., 2 * self.head_k_dim + value_width :].unflatten(-1, (r, self.head_v_dim))
        ba = ba.view(tokens, self.num_k_heads, 2 * r)
        qkv = GroupedChannels(qkvz, self.head_k_dim, value_width)
        return Projections(qkv, z, ba[..., :r], ba[..., r:])

    def _project_qkvz_and_ba(
        self, x: torch.Tensor, quantized: QuantizedRows | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj_qkvz(x) and in_proj_ba(x) for x [T, hidden]: with an FP8 in_proj_qkvz and a plain
        in_proj_ba, through one launch where both run the skinny kernel (layers/paired_products.py)."""
        qkvz_layer, ba_layer = self.in_proj_qkvz, self.in_proj_ba
        plain_ba = type(ba_layer) is nn.Linear and ba_layer.bias is None
        if isinstance(qkvz_layer, Fp8Linear) and plain_ba and x.shape[0] > 0:
            q, row_scale = rows_quantized(x, quantized)
            return fp8_linear_and_product(qkvz_layer, q, row_scale, x.dtype, x, ba_layer.weight)
        (qkvz,) = linears_of_one_input(x, (qkvz_layer,), quantized)
        return qkvz, linear_forward(ba_layer, x)

    def forward(
        self, x: torch.Tensor, backend: HybridBackend, quantized: QuantizedRows | None = None
    ) -> torch.Tensor:
        """x: [T, hidden], the new tokens of every sequence in `backend.query_ranges`; `quantized` as
        `project`'s. Returns [T, hidden]."""
        verify_slots = backend.verify_slots
        if verify_slots is not None:
            return self._forward_verify(x, backend, verify_slots, quantized)
        mix = self._mix_cuda if x.is_cuda else self._mix_reference
        return self._forward_mixing(mix, x, backend, quantized)

    def _forward_mixing(
        self, mix: Mix, x: torch.Tensor, backend: HybridBackend, quantized: QuantizedRows | None = None
    ) -> torch.Tensor:
        """The forward with `mix` (`_mix_cuda` or `_mix_reference`) as its conv and delta rule: they read
        the batch's sequence layout and update the state slots, the part a piecewise prefill graph runs
        eagerly between its pieces (`HybridBackend.outside_graph`). They take only the conv's columns of
        qkv (Qwen3-Next's z columns stay with the output gate)."""
        projections = self.project(x, quantized)
        qkv = projections.qkv
        op = functools.partial(mix, qkv.key_width, qkv.value_width)
        conv_input = qkv.x[..., : 2 * qkv.key_width + qkv.value_width]
        out = backend.outside_graph(op, conv_input, projections.b, projections.a)
        return self._gate_and_project(out, projections.z)

    def _mix_reference(
        self,
        key_width: int,
        value_width: int,
        backend: HybridBackend,
        conv_input: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
    ) -> torch.Tensor:
        """The causal conv and the gated delta rule by the references, through `read_state` /
        `write_state`: out [T, HV, Dv]. `conv_input` is `GroupedChannels.x` of `project`'s qkv cut to the
        conv's columns (`key_width`, `value_width` per group); b and a as `project` gives them."""
        log_once(
            logger, f"Gated DeltaNet on {conv_input.device.type}: pure-torch references (no in-place kernels)"
        )
        qkv = GroupedChannels(conv_input, key_width, value_width)
        tokens = conv_input.shape[0]
        ranges = list(backend.query_ranges)
        cu_seqlens = _cu_seqlens(ranges, tokens)
        decode_only = all(length == 1 for _, length in ranges)
        mixed_qkv = self._conv(qkv.flat(), ranges, decode_only, backend)
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)
        beta = b.reshape(tokens, -1).sigmoid()
        # fp32: in bf16, exp(A_log) * softplus(...) loses the decay's precision (and fp16 overflows).
        g = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, -1).float() + self.dt_bias)

        state = backend.read_state("recurrent", self.linear_ordinal)
        if decode_only:
            # One token per sequence: a batch of N one-token sequences, each with its own state.
            out, new_state = recurrent_gated_delta_rule_reference(
                q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            out = out[:, 0]
        else:
            out, new_state = chunk_gated_delta_rule_reference(
                q[None], k[None], v[None], g[None], beta[None],
                initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            out = out[0]
        backend.write_state("recurrent", self.linear_ordinal, new_state.to(state.dtype))
        return out

    def _mix_cuda(
        self,
        key_width: int,
        value_width: int,
        backend: HybridBackend,
        conv_input: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
    ) -> torch.Tensor:
        """`_mix_reference`'s contract by in-place kernels: every state is read from and written back to
        its pool slot by the kernels.

        A decode step (`backend.decode_only`) is CUDA-graph capturable: it reads only the backend's
        device tensors (`state_indices`, the pools), never syncs with the host and makes no tensor
        from Python data. Prefill is not captured (a piecewise prefill graph runs it between its
        pieces); it passes fla the host copy of cu_seqlens. Short chunks (every sequence at most
        SHORT_CHUNK_TOKENS new tokens: a prompt's tail after its last page boundary, which the engine
        runs in forwards of their own) step token by token in our kernel rather than fla's autotuned
        one, so their result is the same in every batch and every process.
        """
        # Imported here: Triton (and fla) are only needed, and on CPU installs only present, for CUDA.
        from morion.ops.causal_conv1d_triton import causal_conv1d_update_, causal_conv1d_varlen_
        from morion.ops.gated_delta_rule_triton import fused_gdn_chunks_, fused_gdn_decode_, gdn_prefill_

        qkv = GroupedChannels(conv_input, key_width, value_width)
        tokens = conv_input.shape[0]
        decode_only = backend.decode_only
        short = max((length for _, length in backend.query_ranges), default=0) <= SHORT_CHUNK_TOKENS
        state_indices = backend.state_indices
        conv_pool = backend.state_pool("conv", self.linear_ordinal)
        recurrent_pool = backend.state_pool("recurrent", self.linear_ordinal)
        weight = self.conv1d.weight[:, 0, :]
        scale = self.head_k_dim**-0.5

        if decode_only:
            log_once(
                logger, "Gated DeltaNet decode: Triton conv update + fused gated-delta-rule step (in place)"
            )
            mixed_qkv = causal_conv1d_update_(qkv, conv_pool, weight, state_indices, "silu")
        else:
            log_once(logger, "Gated DeltaNet prefill: Triton varlen conv + fla-core chunk_gated_delta_rule")
            cu_seqlens = backend.cu_seqlens
            mixed_qkv = causal_conv1d_varlen_(qkv, conv_pool, weight, state_indices, cu_seqlens, "silu")
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)
        if decode_only:
            return fused_gdn_decode_(
                q, k, v, a, b, self.A_log, self.dt_bias, recurrent_pool, state_indices, scale
            )
        if short:
            log_once(logger, "Gated DeltaNet short chunks: Triton varlen conv + token-by-token fused steps")
            return fused_gdn_chunks_(
                q, k, v, a, b, self.A_log, self.dt_bias, recurrent_pool, state_indices, backend.cu_seqlens,
                scale,
            )  # fmt: skip
        return gdn_prefill_(
            q, k, v, a, b, self.A_log, self.dt_bias, recurrent_pool, state_indices, backend.cu_seqlens,
            scale, cu_seqlens_cpu=_cu_seqlens(list(backend.query_ranges), tokens),
        )  # fmt: skip

    def _forward_verify(
        self,
        x: torch.Tensor,
        backend: HybridBackend,
        slots: torch.Tensor,
        quantized: QuantizedRows | None = None,
    ) -> torch.Tensor:
        """A speculative verify forward: every sequence has the same number n of new tokens (its last
        sampled token, then n - 1 drafts), and the state after each of them is kept: after token t it
        is in slot `slots[b, t]` (column 0 is the working slot). Whatever number of drafts is accepted,
        the state after the last accepted token is already in a slot: rollback costs nothing and
        nothing is recomputed (spec/speculative.py).

        On CUDA one conv launch and one gated-delta-rule launch cover all n tokens, each carrying the
        window and state from token to token and writing them to every token's slot. Elsewhere the
        references go token by token: the state after token t - 1 is copied into slot t, which the
        one-token step then advances in place. No host sync: a CUDA graph can capture it.
        """
        weight = self.conv1d.weight[:, 0, :]
        conv_pool = backend.state_pool("conv", self.linear_ordinal)
        recurrent_pool = backend.state_pool("recurrent", self.linear_ordinal)
        projections = self.project(x, quantized)
        verify = self._verify_kernels if x.is_cuda else self._verify_reference
        out = verify(projections, conv_pool, recurrent_pool, weight, slots)
        return self._gate_and_project(out, projections.z)

    def _gate_and_project(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj(norm(out, z)) for out [T, HV, Dv] and z in either head layout (`Projections`; the
        norm reads it where in_proj put it, out viewed alike). With FP8 out_proj weights on CUDA, the
        gated norm and the activation's FP8 quantization run as one kernel (ops/gated_norm_fp8_triton.py)
        and out_proj takes the quantized rows (tensor parallelism's all-reduce hooks the whole layer, not
        out_proj, so it still sees the result)."""
        out_proj, norm = self.out_proj, self.norm
        if isinstance(out_proj, Fp8Linear) and out.is_cuda and out.shape[0] > 0:
            from morion.ops import gated_norm_fp8_triton as fused
            from morion.ops import row_kernels_triton as rows

            mode = rows.SIGMOID_GATED if isinstance(norm, SigmoidGatedRMSNorm) else rows.GATED
            if fused.supports(out, z):
                log_once(logger, "Gated DeltaNet output: gated norm + FP8 quantization in one kernel")
                q, row_scale = fused.gated_rms_norm_fp8_rows(out, z, norm.weight, norm.eps, mode)
                return out_proj.forward_quantized(q, row_scale, out.dtype)
        normed = self.norm(out.view(z.shape), z)
        return out_proj(normed.reshape(out.shape[0], self.value_dim))

    def _verify_kernels(
        self,
        projections: Projections,
        conv_pool: torch.Tensor,
        recurrent_pool: torch.Tensor,
        weight: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The verify forward's conv and gated delta rule in one launch each (the Triton kernels, reading
        the projections in place); returns out [B * n, HV, V]."""
        from morion.ops.causal_conv1d_triton import causal_conv1d_steps_
        from morion.ops.gated_delta_rule_triton import fused_gdn_steps_

        tokens = slots.numel()
        convolved = causal_conv1d_steps_(projections.qkv, conv_pool, weight, slots, "silu")
        q, k, v = convolved.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return fused_gdn_steps_(
            q.reshape(tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(tokens, self.num_v_heads, self.head_v_dim),
            projections.a, projections.b, self.A_log, self.dt_bias, recurrent_pool, slots,
            self.head_k_dim**-0.5,
        )  # fmt: skip

    def _verify_reference(
        self,
        projections: Projections,
        conv_pool: torch.Tensor,
        recurrent_pool: torch.Tensor,
        weight: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The verify forward's conv and gated delta rule by the references, token column by column;
        returns out [B * n, HV, V]."""
        num_seqs, width = slots.shape
        mixed_qkv, _, b, a = projections.head_major()
        columns = slots.t().long()
        mixed_qkv = mixed_qkv.view(num_seqs, width, -1)
        convolved = torch.empty_like(mixed_qkv)
        for t in range(width):
            if t:
                _copy_slots(conv_pool, columns[t - 1], columns[t])
            convolved[:, t] = _conv_step(mixed_qkv[:, t], conv_pool, weight, columns[t])
        q, k, v = convolved.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_seqs, width, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_seqs, width, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_seqs, width, self.num_v_heads, self.head_v_dim)
        a = a.view(num_seqs, width, self.num_v_heads)
        b = b.view(num_seqs, width, self.num_v_heads)
        out = torch.empty_like(v)
        for t in range(width):
            if t:
                _copy_slots(recurrent_pool, columns[t - 1], columns[t])
            rows = columns[t]
            g = -self.A_log.float().exp() * F.softplus(a[:, t].float() + self.dt_bias)
            step_out, state = recurrent_gated_delta_rule_reference(
                q[:, t, None], k[:, t, None], v[:, t, None], g[:, None], b[:, t].sigmoid()[:, None],
                initial_state=recurrent_pool[rows], output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            recurrent_pool[rows] = state.to(recurrent_pool.dtype)
            out[:, t] = step_out[:, 0]
        return out.view(num_seqs * width, self.num_v_heads, self.head_v_dim)

    def _conv(
        self,
        mixed_qkv: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        decode_only: bool,
        backend: HybridBackend,
    ) -> torch.Tensor:
        weight = self.conv1d.weight[:, 0, :]
        # The state is stored token-major [N, W-1, conv_dim]; the ops take [N, conv_dim, W-1] views.
        conv_state = backend.read_state("conv", self.linear_ordinal)
        channels_first = conv_state.transpose(1, 2)
        if decode_only:
            out = causal_conv1d_update_reference(mixed_qkv, channels_first, weight, activation="silu")
        else:
            out = torch.empty_like(mixed_qkv)
            for n, (start, length) in enumerate(ranges):
                if length == 0:
                    continue  # no new tokens: the window stays as it is
                span = slice(start, start + length)
                result = causal_conv1d_reference(
                    mixed_qkv[span].T[None],
                    weight,
                    initial_states=channels_first[n : n + 1],
                    activation="silu",
                )
                out[span] = result.out[0].T
                channels_first[n] = result.final_states[0]
        backend.write_state("conv", self.linear_ordinal, conv_state)
        return out


def _copy_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[n]] = pool[src[n]] for every n (distinct destinations); device-side, no host sync."""
    pool.index_copy_(0, dst.long(), pool.index_select(0, src.long()))


def _conv_step(
    x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """One token per sequence through the causal conv + SiLU (the reference), the window of sequence n
    rolled in place in `pool[indices[n]]` ([W-1, C] token-major)."""
    rows = indices.long()
    window = pool[rows]
    out = causal_conv1d_update_reference(x, window.transpose(1, 2), weight, activation="silu")
    pool[rows] = window
    return out


def _cu_seqlens(ranges: Sequence[tuple[int, int]], tokens: int) -> torch.Tensor:
    bounds = [0]
    for start, length in ranges:
        if start != bounds[-1] or length < 0:
            raise ValueError(f"query ranges {list(ranges)} do not tile the {tokens} tokens in order")
        bounds.append(start + length)
    if bounds[-1] != tokens:
        raise ValueError(f"query ranges {list(ranges)} do not tile the {tokens} tokens in order")
    return torch.tensor(bounds, dtype=torch.long)
