"""The causal depthwise conv references: carried windows, chunk continuation, the decode update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from morion.ops.causal_conv1d import causal_conv1d_reference, causal_conv1d_update_reference

WIDTH = 4


def make_inputs(batch=2, channels=6, tokens=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, tokens, generator=gen)
    weight = torch.randn(channels, WIDTH, generator=gen)
    bias = torch.randn(channels, generator=gen)
    state = torch.randn(batch, channels, WIDTH - 1, generator=gen)
    return x, weight, bias, state


def naive(x, weight, bias, state, activation):
    """out[b, c, t] = sum_i weight[c, i] * window[b, c, t + i] over the window (state, x)."""
    window = torch.cat((state, x), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[-1]):
        out[..., t] = (window[..., t : t + WIDTH] * weight).sum(-1) + bias
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize("tokens", (1, 2, 3, 20))
@pytest.mark.parametrize("activation", (None, "silu"))
def test_conv_with_initial_state_equals_naive(tokens, activation):
    x, weight, bias, state = make_inputs(tokens=tokens)
    out, final = causal_conv1d_reference(x, weight, bias, initial_states=state, activation=activation)
    assert torch.allclose(out, naive(x, weight, bias, state, activation), atol=1e-6)
    # The new window is the last W-1 tokens of (state, x), however short x is.
    assert torch.equal(final, torch.cat((state, x), dim=-1)[..., -(WIDTH - 1) :])


def test_no_initial_state_means_zeros():
    x, weight, bias, state = make_inputs()
    out, _ = causal_conv1d_reference(x, weight, bias, activation="silu")
    assert torch.allclose(out, naive(x, weight, bias, torch.zeros_like(state), "silu"), atol=1e-6)


@pytest.mark.parametrize("splits", ((1,), (2, 9), (7, 8, 16)))
def test_chunks_continue_through_the_final_state(splits):
    x, weight, bias, _ = make_inputs(tokens=24)
    whole, whole_final = causal_conv1d_reference(x, weight, bias, activation="silu")
    state, outs = None, []
    for start, end in zip((0, *splits), (*splits, 24), strict=True):
        out, state = causal_conv1d_reference(x[..., start:end], weight, bias, state, activation="silu")
        outs.append(out)
    assert torch.allclose(torch.cat(outs, dim=-1), whole, atol=1e-6)
    assert torch.equal(state, whole_final)


@pytest.mark.parametrize("state_len", (WIDTH - 1, WIDTH + 1))
def test_update_token_by_token_equals_whole(state_len):
    x, weight, bias, state = make_inputs(tokens=12)
    whole, _ = causal_conv1d_reference(x, weight, bias, state, activation="silu")
    conv_state = torch.cat((torch.randn(2, 6, state_len - (WIDTH - 1)), state), dim=-1)
    outs = [causal_conv1d_update_reference(x[..., t], conv_state, weight, bias, "silu") for t in range(12)]
    assert torch.allclose(torch.stack(outs, dim=-1), whole, atol=1e-6)
    assert torch.equal(conv_state, x[..., -state_len:])


def test_update_of_several_tokens_and_of_a_token_major_view():
    x, weight, bias, state = make_inputs(tokens=5)
    whole, final = causal_conv1d_reference(x, weight, bias, state, activation=None)
    storage = state.transpose(1, 2).contiguous()  # [B, W-1, D], as the model stores it
    out = causal_conv1d_update_reference(x, storage.transpose(1, 2), weight, bias)
    assert torch.allclose(out, whole, atol=1e-6)
    assert torch.equal(storage.transpose(1, 2), final)


def test_bf16_input_keeps_its_dtype():
    x, weight, _, state = make_inputs()
    out, final = causal_conv1d_reference(x.bfloat16(), weight.bfloat16(), None, state.bfloat16(), "silu")
    assert out.dtype == final.dtype == torch.bfloat16
