"""The commonest GGUF block types (Q8_0, Q4_0, Q4_1) dequantized in torch, bit for bit as the `gguf`
package's numpy code does (the reference: tests/loader/test_gguf_dequant_torch.py).

Why our own: loading is on the path of every start, and gguf's numpy code runs one thread and many
whole-array temporaries. For the default model (106M Q4_1 and 28M Q8_0 weights) it took 0.9 s on the
2-core CPU, a third of what `morion generate` spends outside torch's import before its first token. Here
torch's elementwise kernels use every core. Every other type still goes through gguf.
"""

from __future__ import annotations

import warnings

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from morion.loader.gguf_header import GGUFTensor

_BLOCK = 32  # elements per block, in all three types
# Blocks dequantized per pass: float32 temporaries of a few x 16 MiB, like the numpy path's chunks.
_CHUNK_BLOCKS = (1 << 22) // _BLOCK


def dequantize_torch(tensor: GGUFTensor) -> torch.Tensor | None:
    """A new float32 tensor in numpy's order (slowest dim first), or None for a type not handled here."""
    dequantize = _DEQUANTIZERS.get(tensor.tensor_type)
    if dequantize is None:
        return None
    with warnings.catch_warnings():  # a view of the read-only file: only ever read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(tensor.data)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[tensor.tensor_type][1])  # (elements, bytes) per block
    out = torch.empty(blocks.shape[0], _BLOCK, dtype=torch.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        dequantize(blocks[start : start + _CHUNK_BLOCKS], out[start : start + _CHUNK_BLOCKS])
    return out.reshape(tuple(reversed(tensor.shape)))


# Each writes its blocks' values into `out` [blocks, 32] in place: the codes converted there, then scaled,
# so no float32 temporary of the chunk is made. Multiply, then add, in float32: the numpy code's two
# roundings (a fused multiply-add would round once and differ in the last bit).


def _half(chunk: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 [blocks, 1]."""
    return chunk[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, out: torch.Tensor) -> None:
    """[blocks, 16] bytes -> out [blocks, 32] = values 0..15: low nibbles are elements 0-15, high 16-31."""
    out[:, :16].copy_(packed & 0x0F)
    out[:, 16:].copy_(packed >> 4)


def _q8_0(chunk: torch.Tensor, out: torch.Tensor) -> None:  # d (fp16), 32 x int8: d * q
    out.copy_(chunk[:, 2:].view(torch.int8)).mul_(_half(chunk, 0))


def _q4_0(chunk: torch.Tensor, out: torch.Tensor) -> None:  # d (fp16), 16 bytes of nibbles: d * (q - 8)
    _nibbles(chunk[:, 2:], out)
    out.sub_(8).mul_(_half(chunk, 0))  # q - 8 is exact in float32, as in int8


def _q4_1(chunk: torch.Tensor, out: torch.Tensor) -> None:  # d, m (fp16), 16 bytes of nibbles: d * q + m
    _nibbles(chunk[:, 4:], out)
    out.mul_(_half(chunk, 0)).add_(_half(chunk, 2))


_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}
