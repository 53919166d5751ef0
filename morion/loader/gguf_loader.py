"""GGUF files: config from `{arch}.*` metadata, tensors dequantized (Q8_0, Q4_0, Q4_1 in torch,
`gguf_dequant_torch.py`; the rest by the `gguf` package), HF names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import gguf.quants
import numpy as np

if TYPE_CHECKING:  # torch only where weights are read: the server's front end reads the tokenizer without it
    import torch

from morion.errors import ModelLoadError
from morion.loader.gguf_header import GGUFTensor, read_gguf_header
from morion.loader.gguf_tokenizer import build_gguf_tokenizer
from morion.text.tokenizer import Tokenizer

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_DEQUANTIZE_CHUNK_ELEMENTS = 1 << 22  # rows dequantized per call: temporaries of a few x 16 MiB
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFModel(NamedTuple):
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    tensors: list[GGUFTensor]

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantizes one tensor at a time, so peak memory stays near the largest tensor."""
        import torch  # only where weights are read: the server's front end reads the tokenizer without it

        from morion.loader.gguf_dequant_torch import dequantize_torch

        config = self.hf_config
        for tensor in self.tensors:
            name = hf_tensor_name(tensor.name)
            dequantized = dequantize_torch(tensor)  # the commonest block types, on every core
            array = _dequantize(tensor) if dequantized is None else dequantized.numpy()
            # llama.cpp's converter interleaves the rotary halves of Llama q/k rows; undo it so the
            # rotate-half RoPE of the HF layout applies.
            if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
                array = _unpermute_rotary_rows(array, heads)
            yield name, torch.from_numpy(np.ascontiguousarray(array))


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of a supported architecture")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A new float32 array (never a view of the read-only file) in numpy's order, slowest dim first.

    Block types go through gguf's `dequantize_rows` a chunk of rows at a time: `gguf.quants.dequantize`
    works in groups of 16 rows, whose per-call overhead tripled the default model's load time, while one
    call per tensor would hold several float32 temporaries of a whole embedding matrix at once.
    """
    shape = tuple(reversed(tensor.shape))
    quant = getattr(gguf.quants, tensor.tensor_type.name, None)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.array(array, dtype=np.float32).reshape(shape)
    quant.init_grid()  # the lattice tables of the IQ types; a no-op for the others
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    step = max(1, _DEQUANTIZE_CHUNK_ELEMENTS // shape[-1])
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = quant.dequantize_rows(rows[start : start + step])
    return out.reshape(shape)


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    head_half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("GGUF files with a rope_freqs tensor (Llama 3.1 scaling) are not supported yet")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden_size = int(get("embedding_length"))
    return {
        "model_type": arch,
        "vocab_size": int(get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])) or None)),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden_size // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }


def read_gguf(path: Path) -> GGUFModel:
    try:
        header = read_gguf_header(path)
    except Exception as error:  # ValueError, struct.error, UnicodeDecodeError, mmap's OSError...
        raise ModelLoadError(f"{path} is not a valid GGUF file ({type(error).__name__}: {error})") from None
    tensor_names = {tensor.name for tensor in header.tensors}
    hf_config = _hf_config(header.metadata, tensor_names)
    return GGUFModel(hf_config, build_gguf_tokenizer(header.metadata), header.tensors)
