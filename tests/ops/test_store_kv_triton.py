"""The K/V store kernel (ops/store_kv_triton.py) against the torch code it replaces on CUDA: BF16 and FP8
pools, scales, values past e4m3's range, only the given slots written. On a GPU every bit is equal. On the
CPU it runs in Triton's interpreter, whose cast to e4m3 is not torch's: ties round away from zero rather
than to even, and a value that rounds up into the next power of two comes out as half of it (126.9 to 64,
not 128); there an element may be one e4m3 step off, or half a power-of-two value."""

from __future__ import annotations

import pytest
import torch

from morion.ops.paged_attention import FP8_KV_DTYPE, store_kv_reference
from morion.ops.store_kv_triton import store_kv_, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal on a GPU; in the interpreter, within one e4m3 step of the torch value or half of it where
    that value is a power of two."""
    got, want = got.float(), want.float()
    if DEVICE == "cuda":
        return torch.equal(got, want)
    mantissa, exponent = torch.frexp(want)
    step = torch.maximum(torch.exp2(exponent.float() - 4), torch.tensor(2.0**-9))
    near = (got - want).abs() <= step
    return bool((near | ((mantissa.abs() == 0.5) & (got == want / 2))).all())


@pytest.mark.parametrize("pool_dtype", [torch.float16, FP8_KV_DTYPE], ids=["fp16", "fp8"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 3.0)])
def test_the_kernel_writes_what_the_torch_code_writes(pool_dtype, scales):
    generator = torch.Generator().manual_seed(3)
    tokens, heads, dim, slots = 5, 2, 48, 20
    k = (torch.randn(tokens, heads, dim, generator=generator) * 40).to(DEVICE, torch.float16)  # past 448 too
    v = torch.randn(tokens, heads, dim, generator=generator).to(DEVICE, torch.float16)
    out_slots = torch.tensor([7, 0, 19, 3, 12], device=DEVICE)
    fill = torch.randn(slots, 2, heads, dim, generator=generator)
    kernel_pool = fill.to(DEVICE, pool_dtype)
    torch_pool = kernel_pool.clone()
    assert supports(kernel_pool, k, v)
    store_kv_(kernel_pool, out_slots, k, v, pool_dtype == FP8_KV_DTYPE, *scales)
    store_kv_reference(torch_pool, out_slots, k, v, *scales)
    untouched = [s for s in range(slots) if s not in out_slots.tolist()]
    assert torch.equal(kernel_pool[untouched].float(), torch_pool[untouched].float())
    if pool_dtype == FP8_KV_DTYPE:
        assert _same_fp8(kernel_pool[out_slots], torch_pool[out_slots])
        assert kernel_pool.float().abs().max() <= 448 and not kernel_pool.float().isnan().any()
    else:
        assert torch.equal(kernel_pool, torch_pool)


def test_shapes_without_contiguous_token_rows_keep_the_torch_code():
    pool = torch.zeros(4, 2, 2, 8)
    k = torch.zeros(3, 2, 8)
    assert supports(pool, k, k)
    assert not supports(pool, torch.zeros(3, 8, 2).transpose(1, 2), k)
    assert not supports(pool, torch.zeros(3, 2, 4), k)
