"""The hashed n-gram row ids of Qwen3.8-Flash-Next's per-layer embedding (PLE), exactly as transformers'
`Qwen4ExpTextNGramEmbedding` computes them.

Context: for a token at position p, c_0 = token p and c_s (s = 1 .. n-1) = token p - s, unless an EOS
lies in p-s .. p-1 (the context does not cross an earlier EOS; the token's own EOS does not count) or
p - s precedes the sequence: then c_s = EOS. A sequence therefore starts as if preceded by n-1 EOS, and
the last n-1 token ids are all the state a sequence needs between steps.

Row ids: for each order m = 2 .. n, `heads_per_ngram` heads h share mix_m = XOR_{i<m} (c_i * mult_i), in
int64 arithmetic that wraps around (torch's), and take row (mix_m mod P_h) + offset_h (a non-negative
modulo: `torch.remainder`). P_h are distinct primes >= `ngram_vocab_size_base`, the (g+1)-th for global
head g = ple_index * heads + h; offset_h their running sum; mult_i derived from the seed by splitmix64.
Checkpoints also store multipliers, primes and offsets (int64 buffers); `load_constant` takes those.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_LAYER_SEED_STRIDE = 10007
CONSTANTS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers below (2^63 - 1) / vocab_size, so token * multiplier never overflows int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_SEED_STRIDE * ple_index
    return [
        2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)
    ]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def primes_from(start: int, count: int) -> list[int]:
    """The `count` smallest primes >= `start`."""
    primes, value = [], start
    while len(primes) < count:
        if _is_prime(value):
            primes.append(value)
        value += 1
    return primes


class NGramHash:
    """Row ids for `heads = (ngram_size - 1) * heads_per_ngram` heads, on the host (int64 tensors)."""

    def __init__(
        self,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        vocab_size_base: int,
        ple_index: int,
        seed: int,
        eos_token_id: int,
    ) -> None:
        self.ngram_size = ngram_size
        self.heads_per_ngram = heads_per_ngram
        self.num_heads = (ngram_size - 1) * heads_per_ngram
        self.eos_token_id = eos_token_id
        primes = primes_from(vocab_size_base, (ple_index + 1) * self.num_heads)[ple_index * self.num_heads :]
        offsets = [sum(primes[:h]) for h in range(self.num_heads)]
        # Host tensors (an explicit device: models are built under `torch.device("meta")`).
        multipliers = layer_multipliers(vocab_size, ngram_size, ple_index, seed)
        self.constants = {
            name: torch.tensor(values, dtype=torch.int64, device="cpu")
            for name, values in zip(CONSTANTS, (multipliers, primes, offsets), strict=True)
        }

    @property
    def num_rows(self) -> int:
        """Rows the ids address (the table may be padded past them)."""
        sizes, offsets = self.constants["ngram_heads_vocab_sizes"], self.constants["ngram_heads_offsets"]
        return int((sizes + offsets).max())

    def load_constant(self, name: str, value: torch.Tensor) -> None:
        """Takes a checkpoint's copy of one of `CONSTANTS` (it wins over the derived one)."""
        current = self.constants[name]
        if tuple(value.shape) != tuple(current.shape) or value.dtype != torch.int64:
            raise ValueError(
                f"{name} is {tuple(value.shape)} {value.dtype}, expected {tuple(current.shape)} int64"
            )
        self.constants[name] = value.detach().to("cpu", copy=True)

    def rows(self, contexts: torch.Tensor) -> torch.Tensor:
        """contexts [T, n] int64 -> global table rows [T, heads] int64, heads ordered by n-gram order."""
        multipliers = self.constants["layer_multipliers"]
        sizes = self.constants["ngram_heads_vocab_sizes"]
        offsets = self.constants["ngram_heads_offsets"]
        mix = contexts[:, 0] * multipliers[0]
        blocks = []
        for order in range(2, self.ngram_size + 1):
            mix = torch.bitwise_xor(mix, contexts[:, order - 1] * multipliers[order - 1])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            blocks.append(torch.remainder(mix[:, None], sizes[heads]) + offsets[heads])
        return torch.cat(blocks, dim=1)
