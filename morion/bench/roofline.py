"""Decode and prefill rooflines computed from a model's modules (never from its name).

A decode step at batch B and context L must read at least

    bytes(B, L) = W_dense + sum over MoE layers of D(B) * w_expert + B * (2 * S_state + kv_per_token * L)
    D(B)        = E * (1 - (1 - k/E)^B)        distinct experts that B independently routed tokens touch

where W_dense is every weight a step reads in full (at its storage dtype: an FP8 weight is 1 byte per
element, its scales count too), w_expert one routed expert of one layer, S_state one request's recurrent
state (read and written every step: 2x) and kv_per_token the K/V of one token over all attention layers.
Then t_floor = bytes / BW, the per-request bound is 1 / t_floor, the aggregate bound B / t_floor, and
MBU = bytes / (measured step time * BW).

Prefill is compute-bound: FLOPs per prompt token of an N-token prompt

    2 * N_active + sum over attention layers of 4 * n_heads * head_dim * N / 2

with N_active the weights one token multiplies (dense + k experts per MoE layer; no embedding, no LM head,
which runs for the last token only). The Gated DeltaNet scan is left out: small, and not at tensor-core
peak (performance-anchors.md §3).

A shared expert stacked with the routed ones (layers/moe.py's `shared_slot`) runs for every token: its
slot counts in W_dense, not as one of the E routed experts; so does one beside them in a stack of its
own (`shared_experts`).

Weights a plain decode step does not read are left out and listed: the input embedding (a gather of B
rows; unless tied, when the LM head reads it in full) and a speculative draft head (`model.mtp`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from morion.cache.spec import CacheSpec
from morion.layers.attention import SelfAttention
from morion.layers.gated_attention import GatedAttention
from morion.layers.moe import StackedExperts

# Attributes holding a speculative draft head, whose weights a plain decode step never reads.
DRAFT_HEAD_ATTRIBUTES = ("mtp",)
_ATTENTION_TYPES = (SelfAttention, GatedAttention)
_FP8_ITEMSIZE = 1


class MoELayer(NamedTuple):
    num_experts: int
    top_k: int
    bytes_per_expert: int
    params_per_expert: int
    # The shared expert rides the routed experts' kernels as one more expert of their stack (its bytes
    # are in ModelCost.dense_bytes all the same): what those kernels read counts it (`expert_kernel_bytes`).
    stacked_shared: bool = False


class ModelCost(NamedTuple):
    """What one decode step reads and one prompt token computes, for one model in one storage format."""

    dense_bytes: int  # read in full by every step, whatever the batch (LM head included)
    dense_params: int  # the same tensors in elements
    lm_head_params: int  # part of dense_params; skipped by prefill except for the last token
    moe_layers: tuple[MoELayer, ...]
    state_bytes: int  # one request's per-request state over all layers
    kv_bytes_per_token: int  # one token's per-token cache components over all layers
    attention_query_dims: tuple[int, ...]  # n_heads * head_dim of each attention layer
    excluded: dict[str, int]  # bytes a plain decode step does not read, by reason
    source: str  # "model": storage as loaded; "config": storage modelled from the flags

    @property
    def active_params(self) -> int:
        """Weights one token multiplies: dense (LM head included) + top-k experts of every MoE layer."""
        return self.dense_params + sum(layer.top_k * layer.params_per_expert for layer in self.moe_layers)


class DecodeBound(NamedTuple):
    bytes_per_step: float
    floor_step_s: float
    per_request_tok_s: float
    aggregate_tok_s: float


class PrefillBound(NamedTuple):
    flops_per_token: float
    tok_s: float


# ------------------------------------------------------------------------------------------ the model


def _tensors(module: nn.Module) -> Iterable[tuple[nn.Module, torch.Tensor]]:
    """(owning module, tensor) for every parameter and buffer under `module`."""
    for owner in module.modules():
        for tensor in (*owner.parameters(recurse=False), *owner.buffers(recurse=False)):
            yield owner, tensor


def _is_expert_stack(module: nn.Module) -> bool:
    if isinstance(module, StackedExperts):
        return True
    # Another expert container (an FP8 or NVFP4 variant) is recognised by its stacked leading dim.
    num = getattr(module, "num_experts", None)
    direct = list(module.parameters(recurse=False))
    return isinstance(num, int) and bool(direct) and all(p.dim() >= 2 and p.shape[0] == num for p in direct)


def _stored_bytes(owner: nn.Module, tensor: torch.Tensor, fp8_weights: bool) -> int:
    """Bytes as stored. With `fp8_weights` (a model built from a config, not yet converted), linear and
    expert weight matrices count 1 byte per element, as the FP8 loader stores them (scales left out)."""
    linear_weight = isinstance(owner, nn.Linear) and tensor is owner.weight
    if fp8_weights and tensor.dim() >= 2 and (linear_weight or _is_expert_stack(owner)):
        return tensor.numel() * _FP8_ITEMSIZE
    return tensor.numel() * tensor.element_size()


def from_model(model: nn.Module, spec: CacheSpec, fp8_weights: bool = False) -> ModelCost:
    """The cost of `model` with the cache layout `spec` (the engine's own spec in offline mode)."""
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    counted: set[int] = set()
    excluded: dict[str, int] = {}

    def exclude(reason: str, module: nn.Module) -> None:
        for owner, tensor in _tensors(module):
            if id(tensor) not in counted:
                counted.add(id(tensor))
                excluded[reason] = excluded.get(reason, 0) + _stored_bytes(owner, tensor, fp8_weights)

    for attribute in DRAFT_HEAD_ATTRIBUTES:
        head = getattr(model, attribute, None)
        if isinstance(head, nn.Module):
            exclude(f"draft head (model.{attribute}): not run by a plain decode step", head)
    tower = getattr(model, "visual", None)
    if isinstance(tower, nn.Module):
        exclude("vision tower (model.visual): runs once per image, in prefill", tower)
    if not tied:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                exclude("input embedding: a gather of B rows per step", module)

    excluded_ids = set(counted)
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    moe_layers = []
    attention_query_dims = []
    shared_bytes = shared_params = 0
    for module in model.modules():
        excluded_module = any(id(t) in excluded_ids for _, t in _tensors(module))
        if isinstance(module, _ATTENTION_TYPES) and not excluded_module:
            attention_query_dims.append(module.num_heads * module.head_dim)
        if not _is_expert_stack(module):
            continue
        block = parents.get(module)
        if block is not None and getattr(block, "shared_experts", None) is module:
            continue  # a shared expert's own stack (the beside layout): dense bytes, read every step
        tensors = [(o, t) for o, t in _tensors(module) if id(t) not in counted]
        if not tensors:
            continue  # inside an excluded subtree
        num_experts = module.num_experts
        stacked = [(o, t) for o, t in tensors if t.dim() >= 1 and t.shape[0] == num_experts]
        bytes_per_expert = sum(_stored_bytes(o, t, fp8_weights) for o, t in stacked) // num_experts
        params_per_expert = sum(t.numel() for _, t in stacked) // num_experts
        counted.update(id(t) for _, t in stacked)  # anything else (a global scale) stays dense
        shared_slot = getattr(block, "shared_slot", None)
        if shared_slot is not None:  # the stacked shared expert: read every step, like a dense weight
            shared_bytes += bytes_per_expert
            shared_params += params_per_expert
        top_k = getattr(block, "top_k", None) or getattr(config, "num_experts_per_tok", 0)
        routed = num_experts if shared_slot is None else shared_slot
        moe_layers.append(
            MoELayer(routed, int(top_k), bytes_per_expert, params_per_expert, shared_slot is not None)
        )

    dense_bytes, dense_params = shared_bytes, shared_params
    for owner, tensor in _tensors(model):
        if id(tensor) not in counted:
            counted.add(id(tensor))
            dense_bytes += _stored_bytes(owner, tensor, fp8_weights)
            dense_params += tensor.numel()
    vocab, hidden = getattr(config, "vocab_size", 0), getattr(config, "hidden_size", 0)
    return ModelCost(
        dense_bytes=dense_bytes,
        dense_params=dense_params,
        lm_head_params=vocab * hidden,
        moe_layers=tuple(moe_layers),
        state_bytes=spec.bytes_per_slot,
        kv_bytes_per_token=spec.bytes_per_token,
        attention_query_dims=tuple(attention_query_dims),
        excluded=excluded,
        source="config" if fp8_weights or any(p.is_meta for p in model.parameters()) else "model",
    )


def from_config(
    hf_config: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    weight_dtype: str = "auto",
    kv_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    page_size: int = 16,
) -> ModelCost:
    """The cost of a model described by its HF config, built on the meta device (no memory, no weights),
    with `weight_dtype` applied as the loader applies it."""
    from morion.models.registry import build_model

    meta = torch.device("meta")
    if "weight_dtype" in inspect.signature(build_model).parameters:
        model, modelled_fp8 = build_model(hf_config, dtype, meta, weight_dtype=weight_dtype), False
    else:  # a registry without FP8 conversion: count linear and expert weights at 1 byte instead
        model, modelled_fp8 = build_model(hf_config, dtype, meta), weight_dtype == "fp8"
    spec = model.cache_spec(page_size, kv_dtype or dtype, state_dtype)
    return from_model(model, spec, fp8_weights=modelled_fp8)._replace(source="config")


def read_hf_config(source: str) -> dict[str, Any]:
    """`preset:NAME`, a config.json, a model directory or a GGUF file (or a known model name)."""
    from morion.errors import MorionError
    from morion.models.presets import is_preset, preset_config

    if is_preset(source):
        return preset_config(source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise MorionError(f"cannot read the config {source}: {error}") from None
    from morion.loader import read_source, resolve_model_path

    return read_source(resolve_model_path(source), require_weights=False).hf_config


# ---------------------------------------------------------------------------------------- the bounds


def distinct_experts(batch: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts touched by `batch` tokens, each routed independently to `top_k`."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_bytes(cost: ModelCost, batch: int, context: float) -> float:
    experts = sum(
        distinct_experts(batch, layer.num_experts, layer.top_k) * layer.bytes_per_expert
        for layer in cost.moe_layers
    )
    per_request = 2 * cost.state_bytes + cost.kv_bytes_per_token * context
    return cost.dense_bytes + experts + batch * per_request


def expert_kernel_bytes(cost: ModelCost, batch: int) -> float:
    """Expert weight bytes the MoE kernels of one decode step of `batch` tokens read: the distinct routed
    experts expected (`distinct_experts`), and a shared expert stacked with them, in every MoE layer. A
    shared expert in a stack of its own (the beside layout) runs in kernels of its own and is not counted."""
    return sum(
        (distinct_experts(batch, layer.num_experts, layer.top_k) + layer.stacked_shared)
        * layer.bytes_per_expert
        for layer in cost.moe_layers
    )


def decode_bound(cost: ModelCost, batch: int, context: float, bandwidth_gbs: float) -> DecodeBound:
    num_bytes = decode_bytes(cost, batch, context)
    step_s = num_bytes / (bandwidth_gbs * 1e9)
    return DecodeBound(num_bytes, step_s, 1.0 / step_s, batch / step_s)


def mbu(cost: ModelCost, batch: int, context: float, step_s: float, bandwidth_gbs: float) -> float:
    """Achieved memory-bandwidth utilisation: modelled bytes / (measured step time * bandwidth)."""
    return decode_bytes(cost, batch, context) / (step_s * bandwidth_gbs * 1e9)


def prefill_flops_per_token(cost: ModelCost, prompt_tokens: int) -> float:
    linear = 2.0 * (cost.active_params - cost.lm_head_params)
    attention = sum(4.0 * dim * prompt_tokens / 2 for dim in cost.attention_query_dims)
    return linear + attention


def prefill_bound(cost: ModelCost, prompt_tokens: int, peak_tflops: float) -> PrefillBound:
    flops = prefill_flops_per_token(cost, prompt_tokens)
    return PrefillBound(flops, peak_tflops * 1e12 / flops)


def describe(cost: ModelCost) -> dict[str, Any]:
    """The cost as plain JSON values."""
    return {
        "source": cost.source,
        "dense_bytes": cost.dense_bytes,
        "dense_params": cost.dense_params,
        "lm_head_params": cost.lm_head_params,
        "active_params": cost.active_params,
        "moe_layers": len(cost.moe_layers),
        "experts": sorted({(m.num_experts, m.top_k, m.bytes_per_expert) for m in cost.moe_layers}),
        "expert_bytes_total": sum(m.num_experts * m.bytes_per_expert for m in cost.moe_layers),
        "state_bytes_per_request": cost.state_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "attention_layers": len(cost.attention_query_dims),
        "attention_query_dims": sorted(set(cost.attention_query_dims)),
        "excluded_bytes": dict(cost.excluded),
    }
