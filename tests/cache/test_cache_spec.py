from __future__ import annotations

import pytest
import torch

from morion.cache.spec import CacheSpec, StateComponent, TokenComponent

KV = TokenComponent("kv", 24, (2, 8, 64), torch.bfloat16)
CONV = StateComponent("conv", 3, (4, 128), torch.bfloat16)
SSM = StateComponent("ssm", 3, (8, 16, 16), torch.float32)


def test_sizes() -> None:
    spec = CacheSpec(16, (KV,), (CONV, SSM))
    assert KV.bytes_per_token == 24 * 2 * 8 * 64 * 2
    assert spec.bytes_per_token == KV.bytes_per_token
    assert spec.bytes_per_page == 16 * KV.bytes_per_token
    assert spec.bytes_per_slot == 3 * 4 * 128 * 2 + 3 * 8 * 16 * 16 * 4
    assert spec.has_state


def test_sizes_sum_over_token_components() -> None:
    index_keys = TokenComponent("index_k", 24, (128,), torch.float8_e4m3fn)
    spec = CacheSpec(4, (KV, index_keys))
    assert spec.bytes_per_token == KV.bytes_per_token + 24 * 128
    assert spec.bytes_per_slot == 0
    assert not spec.has_state


def test_describe_is_one_line_with_sizes() -> None:
    text = CacheSpec(16, (KV,), (CONV, SSM)).describe()
    assert "\n" not in text
    assert "page 16 tokens" in text and "48.0 KiB/token" in text and "768.0 KiB/page" in text
    assert "kv 24x(2, 8, 64) bfloat16" in text
    assert "27.0 KiB/state slot" in text and "ssm 3x(8, 16, 16) float32" in text
    assert "state slot" not in CacheSpec(16, (KV,)).describe()


def test_lists_become_tuples_and_spec_is_hashable() -> None:
    spec = CacheSpec(8, [TokenComponent("kv", 2, [2, 4], torch.float16)])  # type: ignore[arg-type]
    assert spec.token_components[0].token_shape == (2, 4)
    assert isinstance(spec.token_components, tuple)
    assert hash(spec) == hash(CacheSpec(8, (TokenComponent("kv", 2, (2, 4), torch.float16),)))


@pytest.mark.parametrize("page_size", [0, -4, 3, 12, 2.0])
def test_page_size_must_be_power_of_two(page_size: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        CacheSpec(page_size, (KV,))  # type: ignore[arg-type]


def test_names_must_be_unique_across_kinds() -> None:
    with pytest.raises(ValueError, match="repeated: kv"):
        CacheSpec(16, (KV,), (StateComponent("kv", 1, (4,), torch.float32),))
    with pytest.raises(ValueError, match="repeated: kv"):
        CacheSpec(16, (KV, KV))


def test_needs_a_token_component() -> None:
    with pytest.raises(ValueError, match="at least one token component"):
        CacheSpec(16, (), (CONV,))


@pytest.mark.parametrize(
    ("num_layers", "shape", "dtype", "message"),
    [
        (0, (4,), torch.float32, "num_layers"),
        (2, (4, 0), torch.float32, "shape"),
        (2, (4,), "float32", "dtype"),
    ],
)
def test_component_validation(num_layers: int, shape: tuple[int, ...], dtype: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenComponent("x", num_layers, shape, dtype)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        StateComponent("x", num_layers, shape, dtype)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        TokenComponent("", 1, (1,), torch.float32)
