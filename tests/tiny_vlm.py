"""A tiny random Qwen3.8-Flash-Next with its vision tower (transformers' `Qwen4ExpForConditionalGeneration`
built from a config: the tiny text model of tests/models/conftest.py, a 2-block tower of width 32 with
4-pixel patches), saved as users get such a model: config.json, safetensors, preprocessor_config.json,
and a byte-level tokenizer with Qwen's chat and vision tokens and a chat template that shows images as
Qwen3-VL's does. Images are PNGs of seeded random pixels."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import numpy as np
import torch
import transformers

from tests.models.conftest import QWEN4_EXP_EOS, QWEN4_EXP_TINY
from tests.models.test_qwen4_exp_parity import TINY, _perturb

IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 4000, 4001, 4002, 4003
IM_START, IM_END = 1, 2
VISION = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=QWEN4_EXP_TINY["hidden_size"],
    num_position_embeddings=16,
)
TEXT = TINY  # the parity tests' text model: QSA budget below the prompts, PLE at layer 1, mRoPE [2, 3, 3]
# Sides become multiples of 8 pixels (patch 4 x merge 2), areas within [64, 4096] pixels.
PROCESSOR = dict(
    patch_size=4,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 64, "longest_edge": 4096},
    image_mean=[0.5, 0.4, 0.3],
    image_std=[0.2, 0.3, 0.25],
)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}"
    "{%- for part in message.content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
SPECIAL = {
    "<|im_start|>": IM_START,
    "<|im_end|>": IM_END,
    "<|endoftext|>": QWEN4_EXP_EOS,
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
    "<|image_pad|>": IMAGE_TOKEN,
    "<|video_pad|>": VIDEO_TOKEN,
}


def perturb(reference: torch.nn.Module) -> None:
    """The text model as the parity tests perturb it (norms, decays, convs, the head), and the tower's
    biases, which transformers initialises at zero, so that each term counts."""
    _perturb(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.startswith("model.visual.") and name.endswith("bias") and "norm" not in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)


def write_without_weights(directory: Path) -> transformers.Qwen4ExpConfig:
    """Saves the tiny model's config, processor and tokenizer in `directory`: all of it but the weights
    (which `morion serve --load-format dummy` draws; transformers' modeling code is never imported)."""
    config = transformers.Qwen4ExpConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    config.save_pretrained(directory)
    # As Qwen2VLImageProcessorPil.save_pretrained writes it (its other fields at their defaults), without
    # importing transformers' image processing (3-4 s); the model tests read it with AutoImageProcessor.
    processor = {"image_processor_type": "Qwen2VLImageProcessor", **PROCESSOR}
    (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    _write_tokenizer(directory)
    return config


def build(directory: Path) -> torch.nn.Module:
    """Saves the tiny model with its weights, processor and tokenizer in `directory`; returns
    transformers' model."""
    config = write_without_weights(directory)
    torch.manual_seed(0)
    reference = transformers.Qwen4ExpForConditionalGeneration(config).eval()
    reference.generation_config.eos_token_id = None  # random models: generate every token asked for
    perturb(reference)
    reference.save_pretrained(directory)
    return reference


def _write_tokenizer(directory: Path) -> None:
    """Byte-level BPE without merges: every byte a token (ids 6..261), every other id below the image
    tokens a three-letter word (so random output decodes to text), Qwen's special tokens at their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: 6 + index for index, char in enumerate(sorted(alphabet))}
    words = ("".join(letters) for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=3))
    for token_id, word in zip(range(6 + len(vocab), IMAGE_TOKEN), words, strict=False):
        vocab["Ġ" + word] = token_id
    vocab.update(SPECIAL)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in SPECIAL])
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def png(height: int, width: int, seed: int) -> bytes:
    """A PNG of seeded random RGB pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
