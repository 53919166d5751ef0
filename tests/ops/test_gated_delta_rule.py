"""The chunked and recurrent gated delta rule references against a naive per-token loop (fp32)."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from morion.ops.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    l2_normalize,
    recurrent_gated_delta_rule_reference,
)

TOLERANCE = 2e-5


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def make_inputs(batch, tokens, heads, v_heads, key_dim, value_dim, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, key_dim, generator=gen)
    k = torch.randn(batch, tokens, heads, key_dim, generator=gen)
    v = torch.randn(batch, tokens, v_heads, value_dim, generator=gen)
    # Log-decays from ~0 (keep everything) to -3 (forget fast); beta over (0, 1).
    g = -3 * torch.rand(batch, tokens, v_heads, generator=gen)
    beta = torch.rand(batch, tokens, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, key_dim, value_dim, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [state]


def naive(q, k, v, g, beta, initial_state, use_l2norm=True):
    """The recurrence as written in the paper, one (sequence, head, token) at a time."""
    batch, tokens, heads, key_dim = q.shape
    v_heads = v.shape[2]
    out = torch.zeros(batch, tokens, v_heads, v.shape[-1])
    final = torch.zeros_like(initial_state)
    for b in range(batch):
        for h in range(v_heads):
            qk_head = h // (v_heads // heads)
            state = initial_state[b, h].clone()
            for t in range(tokens):
                q_t, k_t = q[b, t, qk_head].float(), k[b, t, qk_head].float()
                if use_l2norm:
                    q_t, k_t = l2_normalize(q_t), l2_normalize(k_t)
                state = state * torch.exp(g[b, t, h].float())
                delta = beta[b, t, h].float() * (v[b, t, h].float() - state.T @ k_t)
                state = state + torch.outer(k_t, delta)
                out[b, t, h] = state.T @ (q_t * key_dim**-0.5)
            final[b, h] = state
    return out, final


@pytest.mark.parametrize("tokens", (1, 5, 64, 150))
@pytest.mark.parametrize("heads,v_heads", ((2, 2), (2, 4), (1, 3)))
def test_chunk_and_recurrent_equal_naive(tokens, heads, v_heads):
    q, k, v, g, beta, state = make_inputs(2, tokens, heads, v_heads, 16, 8, seed=tokens)
    expected_out, expected_state = naive(q, k, v, g, beta, state)
    for rule in (chunk_gated_delta_rule_reference, recurrent_gated_delta_rule_reference):
        out, final = rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert diff(out, expected_out) < TOLERANCE, rule.__name__
        assert diff(final, expected_state) < TOLERANCE, rule.__name__


def test_recurrent_token_by_token_equals_chunked_whole():
    q, k, v, g, beta, state = make_inputs(1, 100, 2, 4, 16, 16, seed=1)
    whole, whole_state = chunk_gated_delta_rule_reference(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    outs = []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        out, state = recurrent_gated_delta_rule_reference(
            q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step],
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(out)
    assert diff(torch.cat(outs, dim=1), whole) < TOLERANCE
    assert diff(state, whole_state) < TOLERANCE


@pytest.mark.parametrize("split", (1, 30, 64, 99))
def test_chunked_prefill_continues_from_the_final_state(split):
    q, k, v, g, beta, _ = make_inputs(1, 150, 2, 4, 16, 8, seed=2)
    whole, whole_state = chunk_gated_delta_rule_reference(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    first, state = chunk_gated_delta_rule_reference(
        *(x[:, :split] for x in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    second, state = chunk_gated_delta_rule_reference(
        *(x[:, split:] for x in (q, k, v, g, beta)),
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert diff(torch.cat((first, second), dim=1), whole) < TOLERANCE
    assert diff(state, whole_state) < TOLERANCE


@pytest.mark.parametrize("rule", (chunk_gated_delta_rule_reference, recurrent_gated_delta_rule_reference))
def test_packed_sequences_equal_separate_calls(rule):
    lengths = (7, 0, 70, 1)
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), 2, 4, 16, 8, seed=3)
    states = torch.randn(len(lengths), 4, 16, 8)
    cu_seqlens = torch.tensor([0, 7, 7, 77, 78])
    packed, packed_states = rule(q, k, v, g, beta, initial_state=states, output_final_state=True,
                                 cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)  # fmt: skip
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
        out, state = rule(*(x[:, start:end] for x in (q, k, v, g, beta)), initial_state=states[n : n + 1],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert diff(packed[:, start:end], out) < TOLERANCE
        assert diff(packed_states[n], state[0]) < TOLERANCE


def test_matches_transformers_torch_fallbacks():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = make_inputs(2, 90, 2, 4, 16, 8, seed=4)
    for ours, theirs in (
        # unwrapped: where fla is installed transformers wraps its fallbacks to call fla's GPU kernels
        (chunk_gated_delta_rule_reference, inspect.unwrap(hf.torch_chunk_gated_delta_rule)),
        (recurrent_gated_delta_rule_reference, inspect.unwrap(hf.torch_recurrent_gated_delta_rule)),
    ):
        kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        out, final = ours(q, k, v, g, beta, **kwargs)
        expected_out, expected_final = theirs(q, k, v, g=g, beta=beta, **kwargs)
        assert diff(out, expected_out) < TOLERANCE
        assert diff(final, expected_final) < TOLERANCE


def test_scale_and_no_l2norm_and_zero_initial_state():
    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 1, 8, 8, seed=5)
    k = l2_normalize(k)  # the delta rule is only stable for unit keys
    zeros = torch.zeros(1, 1, 8, 8)
    expected, _ = naive(q * 0.5 / 8**-0.5, k, v, g, beta, zeros, use_l2norm=False)
    for rule in (chunk_gated_delta_rule_reference, recurrent_gated_delta_rule_reference):
        out, final = rule(q, k, v, g, beta, scale=0.5)
        assert final is None
        assert diff(out, expected) < TOLERANCE


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    q, k, v, g, beta, state = make_inputs(1, 70, 2, 4, 16, 8, seed=6, dtype=torch.bfloat16)
    out, final = chunk_gated_delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        initial_state=state.bfloat16(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    expected, expected_state = naive(q, k, v, g, beta, state.bfloat16().float())
    assert diff(out, expected) < 0.05
    assert diff(final, expected_state) < 1e-4


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 80),
    chunk_size=st.sampled_from((1, 8, 16, 64)),
    ratio=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_chunk_size_does_not_change_the_result(tokens, chunk_size, ratio, seed):
    q, k, v, g, beta, state = make_inputs(1, tokens, 1, ratio, 8, 4, seed=seed)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    expected, expected_final = recurrent_gated_delta_rule_reference(q, k, v, g, beta, **kwargs)
    assert out.shape == expected.shape
    assert diff(out, expected) < TOLERANCE
    assert diff(final, expected_final) < TOLERANCE
