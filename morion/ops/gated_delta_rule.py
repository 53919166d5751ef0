"""The gated delta rule (Gated DeltaNet's token mixer): pure-torch references.

For every value head, with a state S of shape [K, V], token t does (Yang et al., "Gated Delta Networks"):

    S   <- exp(g_t) * S                       g_t <= 0 is a log-decay
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T   the delta rule: write only what S does not yet predict
    o_t  = S^T (scale * q_t)

`recurrent_gated_delta_rule_reference` runs that loop as written (the decode path);
`chunk_gated_delta_rule_reference` computes the same result a chunk at a time in the WY form (the
prefill path). Both mirror the argument lists of fla's `fused_recurrent_gated_delta_rule` and
`chunk_gated_delta_rule`, so the CUDA kernels can be checked against them call for call:

- q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head h reads q/k head h // (HV/H));
- g, beta: [B, T, HV];
- initial_state: [N, HV, K, V], N = B, or N = number of sequences when `cu_seqlens` packs several
  variable-length sequences into B = 1 (`cu_seqlens` = [0, end_0, end_1, ..., T]);
- results: output [B, T, HV, V] in q's dtype and, when asked, the final state [N, HV, K, V] in fp32.

All arithmetic is fp32, whatever the input dtypes (a bf16 initial state is upcast, never rounded twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F


class GatedDeltaRuleOutput(NamedTuple):
    output: torch.Tensor  # [B, T, HV, V], q's dtype
    final_state: torch.Tensor | None  # [N, HV, K, V], fp32; None unless output_final_state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: the normalisation of `use_qk_l2norm_in_kernel`."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> GatedDeltaRuleOutput:
    """The gated delta rule over whole chunks of `chunk_size` tokens (shapes: see the module docstring)."""
    return _run(
        _chunk_one_sequence,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        chunk_size,
    )


def recurrent_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> GatedDeltaRuleOutput:
    """The gated delta rule one token at a time (shapes: see the module docstring)."""
    return _run(
        _recurrent_one_sequence,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        None,
    )


def _run(
    one_sequence,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm: bool,
    chunk_size: int | None,
) -> GatedDeltaRuleOutput:
    batch, tokens, num_qk_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[-2:]
    if k.shape != q.shape or v.shape[:2] != (batch, tokens) or num_v_heads % num_qk_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if g.shape != (batch, tokens, num_v_heads) or beta.shape != g.shape:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [B, T, HV]")
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens packs sequences into batch 1, got batch {batch}")
    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    state_shape = (num_states, num_v_heads, key_dim, value_dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)}, expected {state_shape}")

    # Grouped value heads: q/k head h serves value heads h*r .. h*r + r-1.
    repeats = num_v_heads // num_qk_heads
    q32, k32 = (x.float().repeat_interleave(repeats, dim=2) for x in (q, k))
    if use_qk_l2norm:
        q32, k32 = l2_normalize(q32), l2_normalize(k32)
    q32 = q32 * (key_dim**-0.5 if scale is None else scale)
    # Head-major [B, HV, T, *] so each sequence is a contiguous slice of the time axis.
    q32, k32, v32 = (x.transpose(1, 2) for x in (q32, k32, v.float()))
    g32, beta32 = (x.float().transpose(1, 2) for x in (g, beta))

    output = torch.empty(batch, num_v_heads, tokens, value_dim, dtype=torch.float32, device=q.device)
    final_state = torch.empty(state_shape, dtype=torch.float32, device=q.device)
    for state_index, batch_index, start, end in _sequences(batch, tokens, cu_seqlens):
        if initial_state is None:
            state = torch.zeros(state_shape[1:], dtype=torch.float32, device=q.device)
        else:
            state = initial_state[state_index].float()
        span = slice(start, end)
        out, state = one_sequence(
            q32[batch_index, :, span],
            k32[batch_index, :, span],
            v32[batch_index, :, span],
            g32[batch_index, :, span],
            beta32[batch_index, :, span],
            state,
            chunk_size,
        )
        output[batch_index, :, span] = out
        final_state[state_index] = state
    return GatedDeltaRuleOutput(
        output.transpose(1, 2).to(q.dtype).contiguous(), final_state if output_final_state else None
    )


def _sequences(
    batch: int, tokens: int, cu_seqlens: torch.Tensor | None
) -> Iterator[tuple[int, int, int, int]]:
    """(state index, batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        for b in range(batch):
            yield b, b, 0, tokens
        return
    bounds = [int(x) for x in cu_seqlens]
    if bounds[0] != 0 or bounds[-1] != tokens or any(a > b for a, b in pairwise(bounds)):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the {tokens} packed tokens")
    for n, (start, end) in enumerate(pairwise(bounds)):
        yield n, 0, start, end


def _recurrent_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [HV, T, K]; v: [HV, T, V]; g, beta: [HV, T]; state: [HV, K, V] (all fp32)."""
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", state, q[:, t])
    return out, state


def _chunk_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `_recurrent_one_sequence`, a chunk of C tokens per step.

    Inside a chunk, with G_i = g_1 + ... + g_i (cumulative log-decay from the chunk start) and S0 the
    state entering the chunk, unrolling the recurrence gives for the per-token updates u_i = delta_i:

        (I + A) U = beta*V - beta*exp(G)*K S0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j  for j < i
        o_i  = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j
        S_C  = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T

    The unit lower-triangular system is solved once per chunk for both right-hand sides.
    """
    assert chunk_size is not None
    num_heads, tokens, _ = k.shape
    if tokens == 0:
        return torch.empty_like(v), state
    pad = (-tokens) % chunk_size
    # Padding tokens have k = v = 0, beta = 0 and g = 0 (no decay): they leave the state untouched.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (tokens + pad) // chunk_size
    q, k, v = (x.reshape(num_heads, num_chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(num_heads, num_chunks, chunk_size) for x in (g, beta))

    cum_g = g.cumsum(dim=-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i; the masked (j > i) entries would overflow, so mask before exp.
    pair_decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2)) * pair_decay
    system = lower.tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    keys_for_state = torch.linalg.solve_triangular(
        system, k_beta * cum_g.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * pair_decay

    out = torch.empty_like(v)
    for c in range(num_chunks):
        updates = values[:, c] - keys_for_state[:, c] @ state
        out[:, c] = (q[:, c] * cum_g[:, c, :, None].exp()) @ state + scores[:, c] @ updates
        decay_to_end = (cum_g[:, c, -1:] - cum_g[:, c]).exp()
        state = (
            state * cum_g[:, c, -1].exp()[:, None, None]
            + (k[:, c] * decay_to_end[..., None]).transpose(-1, -2) @ updates
        )
    return out.reshape(num_heads, num_chunks * chunk_size, -1)[:, :tokens], state
