"""Random weights of the real shapes (`--load-format dummy`): for benchmarks, never for answers.

Generated on the model's device with a generator seeded from the seed and the parameter's name, so
building a full-size model takes seconds, the same seed gives the same weights, and a tensor's values do
not depend on the others (a stacked shared expert, layers/moe.py, adds a slot without moving any other
tensor's draw; a tensor-parallel rank draws what one rank would). Values are scaled like a trained
model's (fan-in scaled matrices, norms near their identity) so activations stay finite through many
layers; nothing is zero.
FP8 parameters (`--weight-dtype fp8`) and NVFP4 experts (`nvfp4`) are drawn in the model dtype one matrix
(one expert) at a time and quantized, so the full-precision model never exists at once. Tables the model
keeps in host memory (`host_tables`) live there, shard by shard: drawn on the device a chunk at a time
and copied over, never held on the device whole.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.layers.host_table import HostRowTable, host_tables
from morion.layers.norm import RMSNorm
from morion.models.checkpoint import Nvfp4Scales, fp8_scales, nvfp4_scales, quantize_nvfp4_into
from morion.ops.fp8 import FP8_DTYPE, quantize_fp8_
from morion.parallel.shards import RankParts
from morion.progress import Progress

# Host tables are drawn on the model's device this many bytes at a time (a multiple of every dtype's size).
_HOST_TABLE_CHUNK_BYTES = 256 * 2**20


def fill_dummy_weights(model: nn.Module, seed: int, rank_parts: RankParts | None = None) -> None:
    """With `rank_parts` (a tensor-parallel rank's model), every parameter is drawn whole, from its own
    generator as at one rank, and the rank keeps its part: the ranks together hold the weights one rank
    would."""
    params = list(model.named_parameters())
    device = params[0][1].device
    unit_norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    scales = fp8_scales(model)
    nvfp4 = nvfp4_scales(model)
    # Quantized weights are drawn in the dtype of the rest of the model (embeddings and norms never convert).
    dtype = next(
        (p.dtype for _, p in params if p.dtype.is_floating_point and p.dtype != FP8_DTYPE), torch.float32
    )
    progress = Progress("random weights", len(params), " tensors")
    with torch.no_grad():
        for name, param in params:
            generator = torch.Generator(device=device).manual_seed(_seed_of(seed, name))
            if name in nvfp4:
                if rank_parts is not None:
                    raise ModelLoadError("random NVFP4 experts are not split over tensor-parallel ranks yet")
                _fill_nvfp4(name, param, nvfp4[name], dtype, generator)
            elif name in scales:
                _fill_fp8(name, param, scales[name], dtype, generator, rank_parts)
            elif rank_parts is not None:
                whole = torch.empty(rank_parts.whole_shapes[name], dtype=param.dtype, device=param.device)
                _fill(name, whole, id(param) in unit_norms, generator)
                param.copy_(rank_parts.cut(name, whole))  # copy_ reads any strides
                del whole
            else:
                _fill(name, param, id(param) in unit_norms, generator)
            progress.advance()
    progress.finish()
    for table in host_tables(model):
        _fill_host_table(table, dtype, torch.Generator(device=device).manual_seed(seed), device)


def _seed_of(seed: int, name: str) -> int:
    """The seed of parameter `name`'s generator: `seed` and a stable hash of the name (not Python's
    `hash`, which changes between processes)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _fill_host_table(
    table: HostRowTable, model_dtype: torch.dtype, generator: torch.Generator, device: torch.device
) -> None:
    """In the table's declared dtype (else the model's), scaled like fan-in scaled weights (std
    dim^-0.5). FP8 tables get random e4m3 codes with bit 6 cleared (magnitudes up to 1.875, never NaN),
    drawn as int64 words (8 codes per draw: ~20x faster than normals on a CPU) with that std as their
    global scale. Drawn on the model's device in chunks and copied into the host shards: a GPU draws the
    47.7 GiB table of the full-size preset in seconds where one CPU thread takes minutes."""
    dtype = table.dummy_dtype or model_dtype
    std = table.dim**-0.5
    progress = Progress("random host table", table.num_shards, " shards")
    for index in range(table.num_shards):
        shard = table.new_shard(index, dtype).view(torch.uint8).view(-1)
        for start in range(0, shard.numel(), _HOST_TABLE_CHUNK_BYTES):
            piece = shard[start : start + _HOST_TABLE_CHUNK_BYTES]
            if dtype == FP8_DTYPE:
                words = torch.empty(-(-piece.numel() // 8), dtype=torch.int64, device=device)
                words.random_(-(2**63), 2**63 - 1, generator=generator)
                draw = words.view(torch.uint8)[: piece.numel()] & 0xBF
            else:
                values = torch.empty(piece.numel() // dtype.itemsize, dtype=dtype, device=device)
                draw = values.normal_(0.0, std, generator=generator).view(torch.uint8)
            piece.copy_(draw)
        progress.advance()
    if dtype == FP8_DTYPE:
        table.scale = std
    progress.finish()


def _fill_fp8(
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator,
    rank_parts: RankParts | None,
) -> None:
    """Draws the weight in `dtype` and quantizes it: stacked experts (per-row scales [E, N]) one expert
    at a time, other matrices whole; the draw is freed before the next one. A rank draws the whole
    matrix (expert) and quantizes its part."""
    stacked = scale.dim() == 2
    pieces = zip(weight, scale, strict=True) if stacked else [(weight, scale)]
    for piece, piece_scale in pieces:
        shape = piece.shape
        if rank_parts is not None:
            shape = rank_parts.whole_shapes[name][1:] if stacked else rank_parts.whole_shapes[name]
        draw = torch.empty(shape, dtype=dtype, device=piece.device)
        _fill(name, draw, False, generator)
        if rank_parts is not None:
            draw = rank_parts.cut(name, draw, leading=int(stacked)).contiguous()
        quantize_fp8_(draw, piece, piece_scale)
        del draw


def _fill_nvfp4(
    name: str, codes: torch.Tensor, scales: Nvfp4Scales, dtype: torch.dtype, generator: torch.Generator
) -> None:
    """Draws stacked experts' weights (codes [E, N, K/2]) one expert at a time in `dtype` and quantizes
    each of its parts (gate and up rows apart) with its own global scale."""
    for expert in range(codes.shape[0]):
        draw = torch.empty(codes.shape[1], codes.shape[2] * 2, dtype=dtype, device=codes.device)
        _fill(name, draw, False, generator)
        quantize_nvfp4_into(draw, codes[expert], Nvfp4Scales(scales.block[expert], scales.parts[expert]))
        del draw


def _fill(name: str, param: torch.Tensor, unit_norm: bool, generator: torch.Generator) -> None:
    if name.endswith("A_log"):  # decay rates A in [1, 16], the Gated DeltaNet initialisation
        param.uniform_(0.0, math.log(16.0), generator=generator)
    elif name.endswith("dt_bias"):
        param.fill_(1.0)
    elif param.dim() >= 2:
        fan_in = math.prod(param.shape[1:]) if param.dim() > 2 and "conv" in name else param.shape[-1]
        param.normal_(0.0, fan_in**-0.5, generator=generator)
    elif unit_norm:  # weight multiplies the normalised value directly
        param.normal_(1.0, 0.02, generator=generator)
    else:  # biases, and zero-centred norms whose scale is (1 + weight)
        param.normal_(0.0, 0.02, generator=generator)
