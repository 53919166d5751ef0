"""The configuration of Qwen3.8-Flash-Next's text model (`qwen4_exp` / `qwen4_exp_text`), parsed from a
Hugging Face config.json with transformers' defaults and checks: what cannot run is refused here with a
message naming the value (`ModelLoadError`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from morion.errors import ModelLoadError
from morion.layers.gated_delta_net import OUTPUT_GATES
from morion.models.hybrid_config import LINEAR_ATTENTION, HybridConfig, unsupported
from morion.models.qwen4_exp_vision import VisionConfig

SPARSE_ATTENTION = "sparse_attention"
# Names checkpoints use for QSA layers: the release's config says full_attention, transformers 5.16
# qwen_sparse_attention, later ones indexed_attention.
_SPARSE_ATTENTION_NAMES = ("full_attention", "indexed_attention", "qwen_sparse_attention")
_FP8_TABLE = "float8_e4m3fn"
_DEFAULT_MROPE_SECTIONS = (11, 11, 10)  # transformers' default for qwen4_exp


@dataclass(frozen=True)
class ImageTokens:
    """The special tokens of images in a multimodal config (transformers' `Qwen4ExpConfig` defaults)."""

    image: int
    vision_start: int
    vision_end: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ImageTokens:
        return cls(
            hf.get("image_token_id", 248056),
            hf.get("vision_start_token_id", 248053),
            hf.get("vision_end_token_id", 248054),
        )


@dataclass(frozen=True)
class Qwen4ExpConfig(HybridConfig):
    attention_type: ClassVar[str] = SPARSE_ATTENTION

    # attention (QSA)
    indexer_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    # Gated DeltaNet
    output_gate: str
    # hyper-connections
    hc_count: int
    hc_lowrank: int
    # PLE
    ple_layers: tuple[int, ...]  # zero-indexed
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ngram_vocab_divisor: int
    split_ngram_parts: int
    seed: int
    eos_token_id: int | None
    ple_table_dtype: torch.dtype | None  # what random tables are drawn in; None: the model dtype
    # images (a multimodal `qwen4_exp` config with a `vision_config`; None: text only)
    mrope_sections: tuple[int, int, int] = _DEFAULT_MROPE_SECTIONS
    vision: VisionConfig | None = None
    image_tokens: ImageTokens | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen4ExpConfig:
        model_type = hf.get("model_type", "qwen4_exp_text")
        text = hf
        if isinstance(hf.get("text_config"), dict):  # the multimodal config nests the text model's
            text = dict(hf["text_config"])
            for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):  # unset there: the outer one
                if text.get(key) is None and key in hf:
                    text[key] = hf[key]
        try:
            config = cls._from_text(model_type, text)
        except KeyError as error:
            raise ModelLoadError(f"{model_type} config lacks {error.args[0]!r}") from None
        if isinstance(hf.get("vision_config"), dict):
            if (text.get("rope_parameters") or {}).get("mrope_interleaved") is False:
                raise unsupported(model_type, "mrope_interleaved false (images need interleaved mRoPE)")
            sections, frequencies = config.mrope_sections, config.rotary_dim // 2
            if len(sections) != 3 or min(sections) < 0 or sum(sections) > frequencies:
                raise unsupported(model_type, f"mrope_section {list(sections)} for {frequencies} frequencies")
            vision = VisionConfig.from_hf(hf["vision_config"], config.hidden_size)
            config = dataclasses.replace(config, vision=vision, image_tokens=ImageTokens.from_hf(hf))
        return config

    @classmethod
    def _from_text(cls, model_type: str, hf: dict[str, Any]) -> Qwen4ExpConfig:
        def fail(reason: str) -> ModelLoadError:
            return unsupported(model_type, reason)

        common = cls.common_fields(
            model_type, hf, partial_rotary_factor=1.0, attention_names=_SPARSE_ATTENTION_NAMES
        )
        num_layers, layer_types, rotary_dim = (
            common["num_layers"],
            common["layer_types"],
            common["rotary_dim"],
        )
        if SPARSE_ATTENTION not in layer_types:
            raise fail("no attention layer (the K/V cache needs at least one)")
        # Interleaved mRoPE sections only matter when the three position axes differ (images).
        sections = tuple(common["rope"].pop("mrope_section", None) or _DEFAULT_MROPE_SECTIONS)
        common["rope"].pop("mrope_interleaved", None)  # both checked in from_hf where images are served

        qsa = {name: hf.get(f"indexer_{name}") for name in ("n_heads", "kv_heads", "head_dim", "budget")}
        qsa["compress_ratio"] = hf.get("indexer_compress_ratio")
        missing = sorted(f"indexer_{name}" for name, value in qsa.items() if value is None)
        if missing:
            raise fail(f"QSA layers need {', '.join(missing)}")
        if any(value <= 0 for value in qsa.values()):
            raise fail(f"QSA values must be positive: {qsa}")
        if qsa["kv_heads"] != 1:
            raise fail(f"indexer_kv_heads is {qsa['kv_heads']}; QSA's indexer has exactly one key head")
        if qsa["budget"] % qsa["compress_ratio"]:
            raise fail(f"indexer_budget {qsa['budget']} is not a multiple of {qsa['compress_ratio']}")
        if rotary_dim > qsa["head_dim"]:
            raise fail(f"rotary dim {rotary_dim} is larger than indexer_head_dim {qsa['head_dim']}")

        output_gate = hf.get("output_gate_type") or hf.get("hidden_act", "silu")
        if output_gate not in OUTPUT_GATES:
            raise fail(f"output_gate_type {output_gate!r} (need {' or '.join(OUTPUT_GATES)})")
        hc_count = hf.get("hc_count", 4)
        if hc_count <= 1:
            raise fail(f"hc_count {hc_count} (hyper-connections need at least 2 streams)")

        hidden = common["hidden_size"]
        ple_ids = sorted(set(hf.get("ple_layer_ids") or ()))
        ple_embed_dim = hf.get("ple_embed_dim") or hidden
        ngram_size = hf.get("ngram_size", 3)
        heads_per_ngram = hf.get("heads_per_ngram", 8)
        eos = hf.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if ple_ids:
            outside = [i for i in ple_ids if not 1 <= i <= num_layers]
            if outside:
                raise fail(f"ple_layer_ids {outside} are not one-indexed layers 1..{num_layers}")
            on_attention = [i for i in ple_ids if layer_types[i - 1] != LINEAR_ATTENTION]
            if on_attention:
                raise fail(f"ple_layer_ids {on_attention} are attention layers (PLE goes on linear ones)")
            heads = (ngram_size - 1) * heads_per_ngram
            if heads <= 0 or ple_embed_dim % heads:
                raise fail(f"ple_embed_dim {ple_embed_dim} does not split over {heads} n-gram heads")
            if not isinstance(eos, int):
                raise fail("PLE needs eos_token_id (its n-gram context stops at an EOS)")
        table_dtype = hf.get("ple_embedding_dtype")
        if table_dtype not in (None, _FP8_TABLE, "bfloat16", "float16", "float32"):
            raise fail(f"ple_embedding_dtype {table_dtype!r}")

        return cls(
            **common,
            indexer_heads=qsa["n_heads"],
            indexer_head_dim=qsa["head_dim"],
            indexer_budget=qsa["budget"],
            indexer_compress_ratio=qsa["compress_ratio"],
            linear_key_head_dim=hf.get("linear_key_head_dim", 128),
            linear_value_head_dim=hf.get("linear_value_head_dim", 128),
            output_gate=output_gate,
            num_experts=hf["num_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
            hc_count=hc_count,
            hc_lowrank=hf.get("hc_lowrank", 320),
            ple_layers=tuple(i - 1 for i in ple_ids),
            ple_embed_dim=ple_embed_dim,
            ple_conv_kernel_size=hf.get("ple_conv_kernel_size", 4),
            ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram,
            ngram_vocab_size_base=hf.get("ngram_vocab_size_base", 20_000_000),
            ngram_vocab_divisor=hf.get("make_ngram_vocab_size_divisible_by", 128),
            split_ngram_parts=hf.get("split_ngram_parts", 512),
            seed=hf.get("seed", 1234),
            eos_token_id=eos if isinstance(eos, int) else None,
            ple_table_dtype=None if table_dtype is None else getattr(torch, table_dtype),
            num_mtp_layers=hf.get("mtp_num_hidden_layers", 1),
            mrope_sections=sections,
        )

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram
