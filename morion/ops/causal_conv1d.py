"""Causal depthwise 1-D convolution with a carried window: pure-torch references.

Channel c of output token t is  sum_{i < W} weight[c, i] * x[c, t - W + 1 + i]  (+ bias, then the
activation), where tokens before the start of this call come from the conv state: the last W - 1 input
tokens that the previous call saw (zeros for a new sequence).

The signatures mirror Tri Dao's causal-conv1d (`causal_conv1d_fn` / `causal_conv1d_update`):

- x: [B, D, T] (channels before time); weight: [D, W]; bias: [D] or None;
- states: [B, D, S] with S >= W - 1; the oldest token first, the newest last.

The state tensor may be a transposed view of token-major storage ([B, S, D]), as the model keeps it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class GroupedChannels(NamedTuple):
    """A conv input as a group-first projection lays it out, to be read in place rather than copied.

    `x` [T, G, X] (unit stride on X) holds, for each group g, its q channels (`key_width` columns), its k
    channels (`key_width`) and its v channels (`value_width`), then columns the conv does not read (such
    as Qwen3-Next's z). The conv's channel order is q of every group, then k of every group, then v of
    every group: C = G * (2 * key_width + value_width) channels. A plain [T, C] input is the case G = 1,
    key_width 0, value_width C (`of`).
    """

    x: torch.Tensor
    key_width: int
    value_width: int

    @classmethod
    def of(cls, x: torch.Tensor | GroupedChannels) -> GroupedChannels:
        """x as is if grouped; a plain [T, C] tensor as one group of C v-like channels."""
        return x if isinstance(x, GroupedChannels) else cls(x[:, None, :], 0, x.shape[-1])

    @property
    def channels(self) -> int:
        return self.x.shape[1] * (2 * self.key_width + self.value_width)

    def flat(self) -> torch.Tensor:
        """[T, C] in the conv's channel order (a copy unless already so laid out)."""
        x, key, value = self.x, self.key_width, self.value_width
        if x.shape[1] == 1 and key == 0:
            return x[:, 0, :value]
        parts = (x[..., :key], x[..., key : 2 * key], x[..., 2 * key : 2 * key + value])
        return torch.cat([part.reshape(x.shape[0], -1) for part in parts], dim=-1)


class CausalConv1dOutput(NamedTuple):
    out: torch.Tensor  # [B, D, T], x's dtype
    final_states: torch.Tensor  # [B, D, W - 1], x's dtype: the window to carry into the next call


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported activation {activation!r} (supported: None, silu, swish)")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    activation: str | None = None,
) -> CausalConv1dOutput:
    """Convolves T tokens that continue `initial_states` ([B, D, W-1]; None means zeros).

    Computes in the weight's dtype and returns the output and the new window in x's dtype.
    """
    batch, channels, tokens = x.shape
    width = weight.shape[-1]
    if initial_states is None:
        initial_states = x.new_zeros(batch, channels, width - 1)
    elif tuple(initial_states.shape) != (batch, channels, width - 1):
        raise ValueError(
            f"initial_states {tuple(initial_states.shape)}, expected {(batch, channels, width - 1)}"
        )
    window = torch.cat((initial_states.to(x.dtype), x), dim=-1)
    out = F.conv1d(window.to(weight.dtype), weight[:, None, :], bias, groups=channels)
    out = _activate(out, activation)
    return CausalConv1dOutput(out.to(x.dtype), window[..., tokens:].clone())


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """The decode step: x [B, D] (one token) or [B, D, T]; updates `conv_state` [B, D, S] in place.

    Returns the output in x's shape and dtype. Like the CUDA kernel, the state is rolled in place: after
    the call it holds the last S tokens of (old state, x).
    """
    single_token = x.dim() == 2
    if single_token:
        x = x[..., None]
    channels, tokens = x.shape[1], x.shape[2]
    width = weight.shape[-1]
    state_len = conv_state.shape[-1]
    if state_len < width - 1:
        raise ValueError(f"conv_state holds {state_len} tokens, the kernel needs {width - 1}")
    window = torch.cat((conv_state.to(x.dtype), x), dim=-1)
    conv_state.copy_(window[..., -state_len:])
    out = F.conv1d(
        window[..., -(width - 1 + tokens) :].to(weight.dtype), weight[:, None, :], bias, groups=channels
    )
    out = _activate(out, activation).to(x.dtype)
    return out[..., 0] if single_token else out
