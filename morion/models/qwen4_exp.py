"""Qwen3.8-Flash-Next (`model_type` qwen4_exp / qwen4_exp_text), the text model.

Qwen3-Next's hybrid of Gated DeltaNet and gated attention layers with a sparse MoE in every layer, with
four changes (model-architecture.md §4): the residual is `hc_count` hyper-connection streams
(layers/hyper_connection.py; a final mixer instead of a final norm), Gated DeltaNet takes the Qwen3.5
head-first projections and a sigmoid output gate (layers/gated_delta_net_35.py), full attention is Qwen
Sparse Attention (layers/qsa_attention.py), and the layers in `ple_layer_ids` add a hashed n-gram
embedding whose table stays in host memory (layers/ple.py, layers/host_table.py). RoPE is interleaved
mRoPE; for text the three position axes are equal, which makes it ordinary partial RoPE.

Module names follow the Hugging Face checkpoints, so checkpoint names are parameter names, except: the
routed experts (per-expert names or transformers' stacked ones, models/moe_checkpoint.py), the PLE table
(`...ple.ple_embedding.ngram_embedding.shard_{i}.weight` [+ `weight_scale`]) and its hash constants,
which go to the host (`host_tables`), and the multimodal checkpoints' `model.language_model.` prefix.
`model.visual.*` (the vision tower) is skipped: only text is served.

`forward` returns the trunk's last streams before the final mixer ([T, n * H]): `compute_logits` applies
the mixer and the LM head (so only the rows that need logits are mixed), and the MTP head reads the
streams themselves.

The native MTP head (`mtp.*`, in `self.mtp`) runs in `mtp_forward`, for the speculative drafter
(spec/mtp.py; vLLM/sglang `qwen4_exp_mtp`). For draft position t, with R_t the target's pre-mixer streams
[n, H] after token t and e the embedding of token t+1:
`streams = fc_hidden(pre_fc_norm_hidden(R_t) per stream) + fc_embedding(pre_fc_norm_embedding(e))`
(`pre_fc_norm_hidden` is one norm over all n*H values; `fc_hidden` maps each stream, `fc_embedding`'s
output is added to every stream), then `mtp.layers` (QSA decoder layers with their own hyper-connections,
no PLE; their K/V and QSA side caches are further layers of the trunk's token components), which return
streams [n, H] again. Draft logits: `mtp.hyper_connection_mixer` (the target has no final norm after its
mixer, so neither has the head) and the shared LM head. A chained draft step feeds the head's own streams
(before its mixer) as R, as Qwen3-Next's head feeds its own output hidden state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from morion.cache.spec import CacheSpec, StateComponent, TokenComponent
from morion.errors import ModelLoadError, MorionError
from morion.layers.gated_delta_net_35 import GatedDeltaNet35
from morion.layers.host_table import HostRowTable
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.layers.hyper_connection import HyperConnection, inject
from morion.layers.ngram_hash import CONSTANTS, NGramHash
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.ple import NGRAM_HISTORY, PLE_CONV, TABLE, NGramEmbedding, PLELayer
from morion.layers.ple_static import fetch_prefill, fetch_static, forward_verify
from morion.layers.qsa_attention import BLOCK_KEYS, INDEX_KEYS, QSAAttention, Rotation, block_key_slice
from morion.layers.rotary import RotaryEmbedding
from morion.layers.token_cache_backend import TokenCacheBackend
from morion.models.checkpoint import carries_nothing, require_complete
from morion.models.hybrid_model import (
    HybridForCausalLM,
    attention,
    gated_delta_net,
    gated_delta_net_states,
    sparse_moe,
)
from morion.models.image_rows import ImageRows
from morion.models.moe_checkpoint import MoECheckpointLoader
from morion.models.qwen4_exp_config import LINEAR_ATTENTION, SPARSE_ATTENTION, Qwen4ExpConfig
from morion.models.qwen4_exp_vision import VisionTower

logger = logging.getLogger(__name__)

_TEXT_PREFIX = "model.language_model."  # multimodal (qwen4_exp) checkpoints
_VISION_PREFIX = "model.visual."  # the vision tower's tensors, `visual.*` here


def _ple_module(config: Qwen4ExpConfig, ple_ordinal: int) -> PLELayer:
    ngram_hash = NGramHash(
        config.vocab_size,
        config.ngram_size,
        config.heads_per_ngram,
        config.ngram_vocab_size_base,
        ple_ordinal,
        config.seed,
        config.eos_token_id,
    )
    divisor = config.ngram_vocab_divisor
    table_rows = -(-ngram_hash.num_rows // divisor) * divisor
    head_dim = config.ple_embed_dim // config.ngram_heads
    table = HostRowTable(table_rows, head_dim, config.split_ngram_parts, config.ple_table_dtype)
    return PLELayer(
        ple_ordinal,
        config.hidden_size,
        config.hc_count,
        config.ple_embed_dim,
        config.ple_conv_kernel_size,
        ngram_hash,
        table,
        config.rms_norm_eps,
    )


def _fetch_ple_rows(
    ple: PLELayer, dtype: torch.dtype, backend: TokenCacheBackend, input_ids: torch.Tensor
) -> torch.Tensor:
    """The table rows of this step's tokens [T, E] in `dtype`, advancing the n-gram history state, hashed
    and gathered on the device with no host sync (layers/ple_static.py): with static shapes (capturable)
    where every sequence has the same number of new tokens, at most SHORT_CHUNK_TOKENS (decode and verify
    steps, and short forwards of prompt tails of one length), from positions the host builds from the
    layout otherwise (`fetch_prefill`). Both give the same rows and state (integer hashing of the same
    tokens, the same table bytes), so a tail answers alike either way. It reads the batch's layout and the
    state: a piecewise prefill graph runs it eagerly (`HybridBackend.outside_graph`)."""
    lengths = {length for _, length in backend.query_ranges}
    uniform_short = len(lengths) == 1 and max(lengths) <= SHORT_CHUNK_TOKENS
    static = uniform_short or backend.verify_slots is not None
    rows = fetch_static(ple, input_ids, backend) if static else fetch_prefill(ple, input_ids, backend)
    return rows.wait(dtype).view(input_ids.shape[0], -1)


class Qwen4ExpDecoderLayer(nn.Module):
    """[streams += PLE(streams)] -> attention HC: mixer (Gated DeltaNet or QSA) -> MoE HC: sparse MoE.
    `ordinal` counts layers of the same kind; `ple_ordinal` is None for layers without PLE."""

    def __init__(
        self, config: Qwen4ExpConfig, layer_type: str, ordinal: int, ple_ordinal: int | None
    ) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == SPARSE_ATTENTION:
            self.self_attn = attention(
                config,
                ordinal,
                QSAAttention,
                index_heads=config.indexer_heads,
                index_head_dim=config.indexer_head_dim,
                budget=config.indexer_budget,
                compress_ratio=config.indexer_compress_ratio,
            )
        else:
            self.linear_attn = gated_delta_net(
                config, ordinal, GatedDeltaNet35, output_gate=config.output_gate
            )
        self.mlp = sparse_moe(config)
        self.ple = None if ple_ordinal is None else _ple_module(config, ple_ordinal)
        hc = (config.hidden_size, config.hc_count, config.hc_lowrank, config.rms_norm_eps)
        self.attn_hyper_connection = HyperConnection(*hc, inject=True)
        self.mlp_hyper_connection = HyperConnection(*hc, inject=True)

    def forward(
        self,
        streams: torch.Tensor,
        positions: torch.Tensor,
        rotation: Rotation,
        backend: TokenCacheBackend,
        ple_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`ple_rows`: this step's tokens' n-gram table rows [T, E] (`_fetch_ple_rows`) in a PLE layer."""
        if self.ple is not None:
            if backend.verify_slots is not None:  # the state after every token, in its verify slot
                streams = streams + forward_verify(self.ple, streams, ple_rows, backend)
            else:
                streams = streams + self.ple(streams, ple_rows, backend)
        mixed, weights = self.attn_hyper_connection.mix(streams)
        if self.layer_type == SPARSE_ATTENTION:
            out = self.self_attn(mixed, positions, rotation, backend)
        else:
            out = self.linear_attn(mixed, backend)
        streams = inject(streams, out, weights)
        mixed, weights = self.mlp_hyper_connection.mix(streams)
        # The experts' slots go unsummed to the inject kernel, which adds them itself (fused decode path).
        return inject(streams, self.mlp(mixed, unsummed=True), weights)


class Qwen4ExpModel(nn.Module):
    def __init__(self, config: Qwen4ExpConfig) -> None:
        super().__init__()
        self.hc_count = config.hc_count
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        ordinals = {SPARSE_ATTENTION: 0, LINEAR_ATTENTION: 0}
        layers = []
        for index, layer_type in enumerate(config.layer_types):
            ple = config.ple_layers.index(index) if index in config.ple_layers else None
            layers.append(Qwen4ExpDecoderLayer(config, layer_type, ordinals[layer_type], ple))
            ordinals[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.hyper_connection_mixer = HyperConnection(
            config.hidden_size, config.hc_count, config.hc_lowrank, config.rms_norm_eps, inject=False
        )
        sections = config.mrope_sections if config.vision is not None else None
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope, sections)
        self.block_size = config.indexer_compress_ratio

    def rotation(self, positions: torch.Tensor, images: ImageRows | None = None) -> Rotation:
        """The rotary angles of tokens at sequence indices `positions` [T]: text positions are the indices
        (a block starts at index - index % block size); with `images`, the positions per axis it carries."""
        if images is None:
            cos, sin = self.rotary(positions)
            block_cos, block_sin = self.rotary(positions - positions % self.block_size)
        else:
            cos, sin = self.rotary(images.rope_positions)
            block_cos, block_sin = self.rotary(images.block_rope_positions)
        return Rotation(cos, sin, block_cos, block_sin)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: TokenCacheBackend,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        # The PLE rows first: prefill hashes them on the host, a sync with the device best made before any
        # layer is queued. The forward waits for their copy here, not at the PLE layer (no overlap with
        # the layers before it): an eager call of a piecewise prefill graph returns its result ready.
        dtype = self.embed_tokens.weight.dtype  # the streams'
        ple_rows = {
            i: backend.outside_graph(functools.partial(_fetch_ple_rows, layer.ple, dtype), input_ids)
            for i, layer in enumerate(self.layers)
            if layer.ple is not None
        }
        rotation = self.rotation(positions, images)
        embedded = self.embed_tokens(input_ids)
        if images is not None and images.embed_rows.numel():
            # Image tokens take the tower's output; PLE still hashes their token ids (as transformers).
            embedded = embedded.index_put((images.embed_rows,), images.embeds.to(embedded.dtype))
        streams = embedded.repeat(1, self.hc_count)
        for index, layer in enumerate(self.layers):
            streams = layer(streams, positions, rotation, backend, ple_rows.get(index))
        return streams  # before the final mixer (Qwen4ExpForCausalLM.compute_logits applies it)


class Qwen4ExpMTP(nn.Module):
    """The multi-token-prediction head's weights (see the module docstring for its math; it runs in
    `Qwen4ExpForCausalLM.mtp_forward`). Its decoder layers are QSA layers without PLE; their attention
    ordinals continue after the trunk's."""

    def __init__(self, config: Qwen4ExpConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(config.hc_count * hidden, eps)
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)
        first = len(config.attention_layers)
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(config, SPARSE_ATTENTION, first + i, None)
            for i in range(config.num_mtp_layers)
        )
        self.hyper_connection_mixer = HyperConnection(
            hidden, config.hc_count, config.hc_lowrank, eps, inject=False
        )


class Qwen4ExpForCausalLM(HybridForCausalLM):
    """Token-flat interface: input_ids and positions are [T]; the backend knows which sequence each is.

    Decode and speculative verify forwards (every sequence with the same number of new tokens) make no
    host syncs and have static shapes: QSA's static path, PLE hashed and gathered on the device, Gated
    DeltaNet's in-place kernels; a CUDA graph captures them. A short forward of one sequence (a prompt's
    tail: PLE hashed on the device, QSA's static path over its one sequence's rows) is captured too
    (`short_chunk_graphs`), and answers as its eager run does: QSA's selection has one width on every
    path (ops/qsa_triton.select_token_slots). Except with the PLE table in memory-mapped files
    (`--ple-placement mmap`): the GPU cannot read those, its rows are gathered on the host, and a capture
    attempt raises (the engine then decodes eagerly).
    Prefill syncs with the host (PLE's hashing, QSA's per-sequence reference on the CPU), only in the parts
    that read the batch's layout or the cache (`HybridBackend.outside_graph`): a piecewise prefill graph
    (runner/prefill_graph.py) replays the rest.
    """

    # Kept in the model dtype under --weight-dtype fp8 (layers/fp8_convert.py): the router, the shared-
    # expert gate and the indexer decide what runs or is read (a flipped choice costs more than their
    # bytes are worth); in_proj_b/a feed Gated DeltaNet's write and decay gates, whose errors compound;
    # the hyper-connections scale the whole residual (the released quantized checkpoints keep all of
    # these in BF16 too, as they keep the PLE projections).
    fp8_keep: ClassVar[tuple[str, ...]] = (
        "mlp.gate",
        "mlp.shared_expert_gate",
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
        "indexer.index_qk_proj",
        "input_mix_weight_down",
        "input_mix_weight_up",
        "block_inject_weight",
        "ple.key_proj",
        "ple.value_proj",
        # The vision tower stays in the model dtype (BF16 on the GPU): it runs once per image, and the
        # released FP8 checkpoints keep it in BF16.
        "visual",
    )

    config: Qwen4ExpConfig
    mtp: Qwen4ExpMTP | None
    visual: VisionTower | None

    def __init__(self, config: Qwen4ExpConfig) -> None:
        super().__init__(config, Qwen4ExpModel(config), Qwen4ExpMTP)
        self.visual = None if config.vision is None else VisionTower(config.vision)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: TokenCacheBackend,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        """Returns the trunk's pre-mixer streams [T, hc_count * hidden] (`hidden_width`); `compute_logits`
        turns the ones needed into logits (final mixer, LM head), the MTP head reads them as they are.
        `images`: where images are among the tokens, their embeddings and the positions per axis."""
        return self.model(input_ids, positions, backend, images)

    @property
    def rope_block_size(self) -> int:
        """Tokens per QSA block: the engine gives each token the position of its block's first token too
        (`ImageRows.block_rope_positions`)."""
        return self.config.indexer_compress_ratio

    def encode_images(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The vision tower over the patches [N, patch_dim] of images with these grids (t, h, w):
        their tokens' embeddings [N / merge², hidden], image after image."""
        if self.visual is None:
            raise RuntimeError(f"this {self.config.model_type} model has no vision tower (no vision_config)")
        return self.visual(patches, grids)

    @property
    def hidden_width(self) -> int:
        """Width of what `forward` and `mtp_forward` return: the n hyper-connection streams."""
        return self.config.hc_count * self.config.hidden_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of pre-mixer streams [T, n * H]: the final mixer, then the LM head (the
        mixer is the trunk's last norm: there is no `model.norm`)."""
        return self.lm_logits(self.model.hyper_connection_mixer.mix(hidden)[0])

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        target_hidden: torch.Tensor,
        backend: TokenCacheBackend,
    ) -> torch.Tensor:
        """The MTP head at flat positions [T]: row t fuses the embedding of `input_ids[t]` (the token after
        position t) with `target_hidden[t]` [n * H] (the streams at position t that predicted it: the
        trunk's pre-mixer streams as `forward` returns them, or this head's own output for a chained draft
        step), then runs the head's QSA decoder layers (K/V and side caches at the attention ordinals after
        the trunk's). Returns its streams [T, n * H] before its mixer; `lm_logits(mtp_head_input(.))`
        gives the draft distribution for the token after input_ids[t]."""
        mtp = self.mtp
        if mtp is None:
            raise RuntimeError("this model has no MTP head (its checkpoint carries no mtp.* weights)")
        hidden = self.config.hidden_size
        embedded = mtp.fc_embedding(mtp.pre_fc_norm_embedding(self.model.embed_tokens(input_ids)))
        per_stream = mtp.fc_hidden(mtp.pre_fc_norm_hidden(target_hidden).reshape(-1, hidden))
        streams = (per_stream.view(input_ids.shape[0], -1, hidden) + embedded.unsqueeze(-2)).flatten(-2)
        rotation = self.model.rotation(positions)
        for layer in mtp.layers:
            streams = layer(streams, positions, rotation, backend)
        return streams

    def mtp_head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from `mtp_forward`'s streams [T, n * H]: the head's own mixer [T, H]."""
        return self.mtp.hyper_connection_mixer.mix(hidden)[0]

    def host_tables(self) -> list[HostRowTable]:
        """The loader's hook: tables kept in host memory, never on the device (the PLE n-gram tables).
        The loader places them (RAM or memory-mapped files) before loading and fills them with dummy
        weights; nothing here is a parameter or buffer, so building on the meta device and `to_empty`
        never touch them."""
        return [layer.ple.ple_embedding.table for layer in self.model.layers if layer.ple is not None]

    def cache_spec(
        self,
        page_size: int,
        kv_dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32,
        draft_layers: bool = False,
    ) -> CacheSpec:
        """Per token, for each QSA layer: K/V, the raw index key [Di] and a 1/ratio share of its block's key
        ([ceil(Di / ratio)]; layers/qsa_attention.py), both in the model dtype; with `draft_layers`, the
        MTP head's QSA layers after the trunk's in each of the three (paged, prefix-cached and tiered with
        them, as Qwen3-Next's MTP K/V). Per sequence:
        for each Gated DeltaNet layer the conv window and the recurrent state [HV, Dk, Dv] in
        `state_dtype` (as qwen3_next.py); for each PLE layer its conv window [(K-1)*ngram_size, n*H] in
        the model dtype and the last ngram_size - 1 token ids (int64, stored + 1: see layers/ple.py)."""
        config = self.config
        model_dtype = self.model.embed_tokens.weight.dtype
        num_attention, num_ple = len(config.attention_layers), len(config.ple_layers)
        if draft_layers and self.mtp is not None:
            num_attention += len(self.mtp.layers)
        ratio = config.indexer_compress_ratio
        if page_size % ratio:
            raise MorionError(
                f"{config.model_type} needs a page size that is a multiple of its QSA compress ratio {ratio} "
                f"(pages hold whole blocks of keys); got page size {page_size}"
            )
        tokens = (
            TokenComponent("kv", num_attention, (2, config.num_kv_heads, config.head_dim), kv_dtype),
            TokenComponent(INDEX_KEYS, num_attention, (config.indexer_head_dim,), model_dtype),
            TokenComponent(
                BLOCK_KEYS, num_attention, (block_key_slice(config.indexer_head_dim, ratio),), model_dtype
            ),
        )
        states = [*gated_delta_net_states(config, model_dtype, state_dtype)]
        if num_ple:
            window = (config.ple_conv_kernel_size - 1) * config.ngram_size
            states += [
                StateComponent(
                    PLE_CONV, num_ple, (window, config.hc_count * config.hidden_size), model_dtype
                ),
                StateComponent(NGRAM_HISTORY, num_ple, (config.ngram_size - 1,), torch.int64),
            ]
        return CacheSpec(page_size, tokens, tuple(states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the parameters and the host tables; every parameter
        and table shard must be covered (the hash constants may be absent: they derive from the config).

        MTP weights are all or nothing: a checkpoint without any `mtp.*` tensor (transformers'
        `save_pretrained` writes none) leaves the model without its MTP head (`self.mtp = None`).
        """
        loader = MoECheckpointLoader(self, self.config.model_type)
        host = {
            f"model.layers.{i}.ple.ple_embedding.": layer.ple.ple_embedding
            for i, layer in enumerate(self.model.layers)
            if layer.ple is not None
        }
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIX):
                if self.visual is None:
                    logger.info("skipping %s...: the config has no vision_config (text only)", _VISION_PREFIX)
                    continue
                name = "visual." + name.removeprefix(_VISION_PREFIX)
            if name.startswith(_TEXT_PREFIX):
                name = "model." + name.removeprefix(_TEXT_PREFIX)
            if carries_nothing(name, self.config.tie_word_embeddings):
                continue
            owner = next((prefix for prefix in host if name.startswith(prefix)), None)
            if owner is not None:
                _load_host_tensor(host[owner], name, name.removeprefix(owner), tensor)
                continue
            loader.copy(name, tensor)
        missing = loader.finish()
        for prefix, embedding in host.items():
            missing.update(f"{prefix}{TABLE}.{name}" for name in embedding.table.missing())
            table_rows = embedding.table.num_rows
            if embedding.hash.num_rows > table_rows:
                raise ModelLoadError(
                    f"{prefix}: the hash constants address {embedding.hash.num_rows} rows, the table has "
                    f"{table_rows}"
                )
        require_complete(missing)


def _load_host_tensor(embedding: NGramEmbedding, name: str, relative: str, tensor: torch.Tensor) -> None:
    """A PLE embedding's checkpoint tensor: a hash constant, or a piece of its table."""
    try:
        if relative in CONSTANTS:
            embedding.hash.load_constant(relative, tensor)
        elif relative.startswith(TABLE + "."):
            embedding.table.load(relative.removeprefix(TABLE + "."), tensor)
        else:
            raise ValueError("is not part of the n-gram embedding")
    except ValueError as error:
        raise ModelLoadError(f"checkpoint tensor {name!r} {error}") from None
