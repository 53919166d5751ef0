"""Model loading: resolve what the user named, read its config/tokenizer, build and fill the model."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.layers.host_table import PLACEMENTS, host_tables
from morion.loader.dummy_weights import fill_dummy_weights
from morion.loader.fp8_block import block_fp8_size, dequantized_weights
from morion.loader.gguf_loader import GGUFModel
from morion.loader.nvfp4 import is_nvfp4_checkpoint, nvfp4_weights
from morion.loader.resolve import resolve_model_path
from morion.loader.safetensors_loader import HFDirectory
from morion.loader.safetensors_mmap import mapped_weights
from morion.loader.source import read_source
from morion.models.presets import is_preset, preset_config
from morion.models.registry import architecture_config, build_model, tensor_split
from morion.parallel.group import TensorParallel
from morion.parallel.shards import RankParts
from morion.progress import Progress
from morion.text.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "dummy")

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    model: nn.Module
    tokenizer: Tokenizer | None
    hf_config: dict[str, Any]
    path: Path


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    weight_dtype: str = "auto",
    host_table_placement: str = "ram",
    tensor_parallel: TensorParallel | None = None,
) -> LoadedModel:
    """`load_format` "dummy" (implied by `preset:NAME`) builds random weights instead of reading them.

    `weight_dtype` "fp8" keeps linear layers, experts and the LM head in e4m3 (layers/fp8_convert.py):
    each weight is quantized on `device` as it is read or drawn, so device memory peaks at about the
    FP8 model plus one tensor's temporaries, and those are freed before this returns.

    Tables a model keeps in host memory and never on `device` (its `host_tables` hook: Qwen3.8-Flash-Next's
    PLE table) are copied into RAM (page-locked when `device` is CUDA), or with `host_table_placement`
    "mmap" left in the checkpoint files, memory-mapped (layers/host_table.py).

    With `tensor_parallel` of more than one rank, the model is that rank's part (models/registry.py): each
    checkpoint tensor is cut to the rank's part as it streams in, before it is quantized; random weights
    are drawn whole, as at one rank, and cut.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r} (choose {', '.join(LOAD_FORMATS)})")
    if host_table_placement not in PLACEMENTS:
        raise ModelLoadError(
            f"unknown host table placement {host_table_placement!r} (choose {', '.join(PLACEMENTS)})"
        )
    if is_preset(model):
        hf_config, tokenizer, path, weights = preset_config(model), None, Path(model), None
    else:
        path = resolve_model_path(model)
        source = read_source(path, require_weights=load_format != "dummy")
        hf_config, tokenizer = source.hf_config, source.tokenizer
        weights = None if load_format == "dummy" else source
    module = build_model(hf_config, dtype, device, weight_dtype, tensor_parallel)
    tables = host_tables(module)
    for table in tables:
        table.place(host_table_placement, pin_memory=device.type == "cuda", model_dtype=dtype)
    if weights is None:
        fill_dummy_weights(module, seed, _rank_parts_of(hf_config, dtype, weight_dtype, tensor_parallel))
    else:
        map_files = bool(tables) and host_table_placement == "mmap"
        _load_checkpoint(
            module,
            weights,
            hf_config,
            path,
            weight_dtype,
            dtype,
            device,
            map_files,
            _rank_parts_of(hf_config, dtype, weight_dtype, tensor_parallel),
        )
    for table in tables:
        print(f"morion: host table {table.describe()}", file=sys.stderr)
    if device.type == "cuda":
        # Quantization and dequantization temporaries go back to the driver before the KV pool is
        # sized from the memory that is really free (design.md §4).
        torch.cuda.empty_cache()
    return LoadedModel(module, tokenizer, hf_config, path)


def check_tensor_parallel(model: str | None, load_format: str, size: int) -> None:
    """Raises a MorionError, before any rank starts, where `model` cannot be split over `size` ranks: an
    architecture without a split, or a count of heads (value heads, intermediate rows) `size` does not
    divide."""
    if is_preset(model):
        hf_config = preset_config(model)
    else:
        hf_config = read_source(resolve_model_path(model), require_weights=load_format != "dummy").hf_config
    split = tensor_split(hf_config["model_type"])
    split.local_config(architecture_config(hf_config), size)
    if hf_config.get("tie_word_embeddings"):
        raise ModelLoadError("tensor parallelism needs an untied LM head (this model ties it)")


def _load_checkpoint(
    module: nn.Module,
    weights: HFDirectory | GGUFModel,
    hf_config: dict[str, Any],
    path: Path,
    weight_dtype: str,
    dtype: torch.dtype,
    device: torch.device,
    map_files: bool = False,
    rank_parts: RankParts | None = None,
) -> None:
    """`map_files`: hand over every tensor as a map of its file (safetensors only) instead of reading it,
    so host tables placed "mmap" keep those maps; everything else is copied from them as usual."""
    progress = Progress(f"loading {path.name}", weights.num_tensors, " tensors")

    def counted(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in tensors:
            yield item
            progress.advance()

    mapped = map_files and isinstance(weights, HFDirectory)
    tensors = counted(mapped_weights(weights.shards) if mapped else weights.weights())
    if is_nvfp4_checkpoint(hf_config, path):
        if weight_dtype == "nvfp4":
            logger.info("NVFP4 checkpoint: codes and scales go to the device as they are")
        else:
            logger.info("NVFP4 checkpoint: quantized weights dequantized to %s as they load", dtype)
        tensors = nvfp4_weights(tensors, device, None if weight_dtype == "nvfp4" else dtype)
    block = block_fp8_size(hf_config)
    if block and weight_dtype == "fp8":
        logger.info("block-FP8 checkpoint: each weight is dequantized, then requantized per tensor / per row")
    tensors = dequantized_weights(tensors, block) if block else tensors
    if rank_parts is not None:
        tensors = ((name, rank_parts.cut(name, tensor)) for name, tensor in tensors)
    module.load_weights(tensors)
    progress.finish()


def _rank_parts_of(
    hf_config: dict[str, Any], dtype: torch.dtype, weight_dtype: str, tensor_parallel: TensorParallel | None
) -> RankParts | None:
    """What a rank's random weights are cut from: the whole model's shapes (built on the meta device)."""
    if tensor_parallel is None or tensor_parallel.size == 1:
        return None
    whole = build_model(hf_config, dtype, torch.device("meta"), weight_dtype)
    split, config = tensor_split(hf_config["model_type"]), architecture_config(hf_config)
    return RankParts(
        {name: parameter.shape for name, parameter in whole.named_parameters()},
        lambda name: split.shard_of(name, config),
        tensor_parallel.rank,
        tensor_parallel.size,
    )
