"""PLE: Qwen3.8-Flash-Next's per-layer n-gram ("Engram") embedding, added to the hyper-connection streams
before the attention block of the layers in `ple_layer_ids` (layer index 1 in the released model).

Per token (n streams of width H, E = ple_embed_dim):

    e       = the token's rows of the n-gram table, one per hash head, side by side    [E]  (ngram_hash.py)
    key     = grouped_rmsnorm(key_proj(e)) per stream                                   [n, H]
    value   = value_proj(e)                                                             [H]
    query   = grouped_rmsnorm(streams) per stream                                       [n, H]
    g       = sum(key * query) / sqrt(H) per stream; g = sign(g) * sqrt(max(|g|, 1e-6))
    gated   = sigmoid(g) * value                                                        [n, H]
    out     = gated + silu(conv(grouped_rmsnorm(gated)))     depthwise over n*H channels, kernel K,
                                                              dilation ngram_size, causal
    streams = streams + out

State per sequence (design.md §3), next to the Gated DeltaNet state so prefix hits, snapshots and the
host/disk tiers carry it: `PLE_CONV`, the conv's last (K - 1) * dilation inputs [(K-1)*d, n*H] in the model
dtype; `NGRAM_HISTORY`, the last ngram_size - 1 token ids, stored as id + 1 so that a fresh (zeroed)
slot reads as "EOS before the sequence start", which is how transformers pads.

The table rows are fetched at the start of the forward (layers/ple_static.py: hashed and gathered on the
device, no host sync; models/qwen4_exp.py, in the step's eager part: `HybridBackend.outside_graph`) and
consumed here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from morion.layers.grouped_norm import GroupedRMSNorm
from morion.layers.host_table import HostRowTable, shard_name
from morion.layers.hybrid_backend import HybridBackend
from morion.layers.ngram_hash import NGramHash
from morion.ops.skinny_tiles import linear_forward

PLE_CONV = "ple_conv"
NGRAM_HISTORY = "ple_ngram"
TABLE = "ngram_embedding"  # the table's checkpoint name inside `ple_embedding`


class NGramEmbedding(nn.Module):
    """The hashing constants and the host-resident table: no parameters, nothing on the device."""

    def __init__(self, ngram_hash: NGramHash, table: HostRowTable) -> None:
        super().__init__()
        self.hash = ngram_hash
        self.table = table

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The constants and the table's shards appear under their checkpoint names (host tensors), so
        what hashes a model's state dict (the disk cache's weights digest) covers them too."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.update({prefix + name: value for name, value in self.hash.constants.items()})
        for index, shard in enumerate(self.table.shards):
            if shard is not None:
                destination[f"{prefix}{TABLE}.{shard_name(index)}"] = shard
        if self.table.scale is not None:
            destination[f"{prefix}{TABLE}.weight_scale"] = torch.tensor([self.table.scale])


class PLELayer(nn.Module):
    def __init__(
        self,
        ple_ordinal: int,
        hidden_size: int,
        hc_count: int,
        embed_dim: int,
        conv_kernel_size: int,
        ngram_hash: NGramHash,
        table: HostRowTable,
        rms_norm_eps: float,
    ) -> None:
        super().__init__()
        self.ple_ordinal = ple_ordinal
        self.hidden_size = hidden_size
        self.hc_count = hc_count
        width = hc_count * hidden_size
        self.dilation = ngram_hash.ngram_size
        self.window = (conv_kernel_size - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(ngram_hash, table)
        self.key_proj = nn.Linear(embed_dim, width, bias=False)
        self.value_proj = nn.Linear(embed_dim, hidden_size, bias=False)
        self.norm_key = GroupedRMSNorm(width, hidden_size, rms_norm_eps)
        self.norm_query = GroupedRMSNorm(width, hidden_size, rms_norm_eps)
        self.norm_conv = GroupedRMSNorm(width, hidden_size, rms_norm_eps)
        # Only its weight [n*H, 1, K] is used (the checkpoint's layout).
        self.conv1d = nn.Conv1d(
            width, width, conv_kernel_size, groups=width, dilation=self.dilation, bias=False
        )

    def forward(self, streams: torch.Tensor, embedded: torch.Tensor, backend: HybridBackend) -> torch.Tensor:
        """streams [T, n*H] and this step's tokens' table rows side by side [T, E] (`FetchedRows.wait`, in
        the streams' dtype) -> what to add to the streams [T, n*H]."""
        per_stream = (streams.shape[0], self.hc_count, self.hidden_size)
        # Through `linear_forward`: a decode step's rows the same bits in every batch (ops/skinny_tiles.py).
        key = self.norm_key(linear_forward(self.key_proj, embedded)).view(per_stream)
        value = linear_forward(self.value_proj, embedded)
        query = self.norm_query(streams).view(per_stream)
        gate = stream_dots(key, query) / math.sqrt(self.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value[:, None, :]).flatten(1)
        return gated + F.silu(backend.outside_graph(self._conv, self.norm_conv(gated)))

    def _conv(self, backend: HybridBackend, x: torch.Tensor) -> torch.Tensor:
        """The causal dilated depthwise conv of each sequence's rows of x [T, n*H], continuing from and
        advancing its window state (the part that reads the batch's layout and the state slots: a
        piecewise prefill graph runs it eagerly between its pieces, `HybridBackend.outside_graph`)."""
        state = backend.read_state(PLE_CONV, self.ple_ordinal)  # [N, window, n*H]
        out = torch.empty_like(x)
        for n, (start, length) in enumerate(backend.query_ranges):
            if length == 0:
                continue  # no new tokens: the window stays as it is
            window = torch.cat((state[n], x[start : start + length]))
            out[start : start + length] = F.conv1d(
                window.T[None], self.conv1d.weight, groups=x.shape[1], dilation=self.dilation
            )[0].T
            state[n] = window[-self.window :]
        backend.write_state(PLE_CONV, self.ple_ordinal, state)
        return out


def stream_dots(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(key * query).sum(-1, keepdim=True) of [T, n, H] streams: on CUDA one Triton program per stream row
    (ops/row_kernels_triton.dot_rows, this torch code its reference), whose bits never depend on T."""
    if key.is_cuda:
        from morion.ops import row_kernels_triton as rows

        pairs = key.reshape(-1, key.shape[-1]), query.reshape(-1, query.shape[-1])
        if all(rows.supports(part) for part in pairs):
            return rows.dot_rows(*pairs).view(*key.shape[:-1], 1)
    return (key * query).sum(dim=-1, keepdim=True)
