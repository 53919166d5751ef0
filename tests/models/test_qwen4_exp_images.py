"""Qwen3.8-Flash-Next with images against transformers' `Qwen4ExpForConditionalGeneration` on a tiny random
model (tests/tiny_vlm.py; fp32, CPU): the processor's patches, the vision tower, `get_rope_index`'s
positions, prefill logits with one or two images of different sizes (first and in the middle, chunked so
that a chunk boundary splits an image's tokens), and greedy continuations through `morion.LLM`, also with
a prefix-cache hit (same image), a miss (another image, same text), a host-tier restore and speculative
verify steps."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from morion import LLM, SamplingParams
from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.loader import load_model
from morion.multimodal.image_decode import PreparedImage, prepare_image
from morion.multimodal.patches import image_patches
from morion.multimodal.processing import ImageProcessing
from morion.multimodal.prompt_images import PromptImages
from morion.runner.backend import PagedAttentionBackend
from morion.runner.forward_batch import build_forward_batch
from morion.runner.image_batch import ImageChunk, ImageEncoder
from morion.spec.synthetic import SyntheticDrafter
from tests import tiny_vlm
from tests.models.conftest import PagedRunner
from tests.tiny_vlm import IMAGE_TOKEN, VISION_END, VISION_START

LOGIT_TOLERANCE = 1e-4  # measured ~2e-6 (summation order only)
# (height, width) of the test images: sizes that resize (37x53 -> 40x56) and that keep their size.
SIZES = ((37, 53), (24, 32), (24, 32))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vlm(tiny_vlm_checkpoint) -> SimpleNamespace:
    directory, reference = tiny_vlm_checkpoint
    processing = ImageProcessing.for_model(directory)
    files = [tiny_vlm.png(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    return SimpleNamespace(
        directory=directory,
        reference=reference,
        ours=load_model(str(directory), torch.float32, CPU).model,
        processing=processing,
        files=files,
        images=[prepare_image(data, processing) for data in files],
        hf_processor=transformers.AutoImageProcessor.from_pretrained(directory),
    )


def _text(length: int, seed: int) -> list[int]:
    return torch.randint(6, 3900, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _image_tokens(image: PreparedImage) -> list[int]:
    return [VISION_START, *[IMAGE_TOKEN] * image.num_tokens(2), VISION_END]


def _prompt(vlm, layout: str) -> tuple[list[int], list[PreparedImage]]:
    """'first': one image at the very start; 'middle': text, an image, text, another image, text."""
    first, second = vlm.images[0], vlm.images[1]
    if layout == "first":
        return [*_image_tokens(first), *_text(11, 1)], [first]
    return [*_text(5, 2), *_image_tokens(first), *_text(9, 3), *_image_tokens(second), *_text(4, 4)], [
        first,
        second,
    ]


def _pil(vlm, images: list[PreparedImage]) -> list[Image.Image]:
    from io import BytesIO

    index = {id(image): i for i, image in enumerate(vlm.images)}
    return [Image.open(BytesIO(vlm.files[index[id(image)]])) for image in images]


def _reference_inputs(vlm, prompt: list[int], images: list[PreparedImage]) -> dict:
    pixels = vlm.hf_processor(images=_pil(vlm, images), return_tensors="pt")
    ids = torch.tensor([prompt])
    return dict(
        input_ids=ids,
        pixel_values=pixels["pixel_values"],
        image_grid_thw=pixels["image_grid_thw"],
        mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
    )


class ImageRunner(PagedRunner):
    """One sequence through the engine's paged backend with its images' `ImageRows`."""

    def __init__(self, vlm, prompt: list[int], images: list[PreparedImage]) -> None:
        super().__init__(vlm.ours)
        layout = PromptImages(prompt, images, IMAGE_TOKEN, 2)
        self.request = SimpleNamespace(images=layout, image_embeds={})
        self.encoder = ImageEncoder(vlm.ours, vlm.processing, CPU)

    @torch.inference_mode()
    def run(self, new_tokens, verify=False):
        ((seq, tokens),) = new_tokens.items()
        start = len(self.tokens[seq])
        self.tokens[seq].extend(tokens)
        chunk = (self.tokens[seq], self.pages[seq], start, len(tokens))
        batch = build_forward_batch([chunk], [self.working[seq]], self.page_size, CPU)
        rows = self.encoder.rows([ImageChunk(self.request, start, len(tokens))])
        backend = PagedAttentionBackend(self.pool, batch, self.slots)
        hidden = self.model(batch.input_ids, batch.positions, backend, images=rows)
        return {seq: self.model.compute_logits(hidden)}


def test_patches_and_tower_match_transformers(vlm):
    images = vlm.images[:2]
    expected = vlm.hf_processor(images=_pil(vlm, images), return_tensors="pt")
    assert (
        [list(image.grid) for image in images]
        == expected["image_grid_thw"].tolist()
        == [[1, 10, 14], [1, 6, 8]]
    )
    patches = torch.cat([image_patches(image.pixels, vlm.processing, CPU) for image in images])
    assert (patches - expected["pixel_values"]).abs().max() < 1e-6
    with torch.no_grad():
        reference = vlm.reference.model.get_image_features(
            expected["pixel_values"], expected["image_grid_thw"]
        ).pooler_output
        ours = vlm.ours.encode_images(patches, [image.grid for image in images])
    assert (ours - torch.cat(reference)).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ("first", "middle"))
def test_positions_match_get_rope_index(vlm, layout):
    prompt, images = _prompt(vlm, layout)
    inputs = _reference_inputs(vlm, prompt, images)
    positions, delta = vlm.reference.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    ours = PromptImages(prompt, images, IMAGE_TOKEN, 2)
    assert np.array_equal(ours.rope, positions[:, 0].numpy()) and ours.delta == delta.item() != 0
    after = np.arange(len(prompt), len(prompt) + 3)
    assert np.array_equal(ours.positions(after), np.broadcast_to(after + ours.delta, (3, 3)))


@pytest.fixture(scope="module")
def reference_logits(vlm) -> dict[str, torch.Tensor]:
    logits = {}
    for layout in ("first", "middle"):
        with torch.no_grad():
            logits[layout] = vlm.reference(**_reference_inputs(vlm, *_prompt(vlm, layout))).logits[0]
    return logits


@pytest.mark.parametrize("layout", ("first", "middle"))
@pytest.mark.parametrize("chunk", (None, 20))
def test_prefill_logits_match_transformers(vlm, reference_logits, layout, chunk):
    """Chunks of 20 split every image's tokens over several forwards."""
    prompt, images = _prompt(vlm, layout)
    ours = ImageRunner(vlm, prompt, images).prefill(prompt, chunk)
    assert (ours - reference_logits[layout]).abs().max().item() < LOGIT_TOLERANCE


def test_the_image_changes_the_answer(vlm):
    """The parity tests would pass if images were ignored: another image of the same size changes the
    logits after it."""
    prompt = [*_image_tokens(vlm.images[1]), *_text(11, 1)]
    one = ImageRunner(vlm, prompt, [vlm.images[1]]).prefill(prompt)
    other = ImageRunner(vlm, prompt, [vlm.images[2]]).prefill(prompt)
    assert (one[-1] - other[-1]).abs().max().item() > 100 * LOGIT_TOLERANCE


def _greedy_reference(vlm, prompt: list[int], images: list[PreparedImage], tokens: int) -> list[int]:
    inputs = _reference_inputs(vlm, prompt, images)
    with torch.no_grad():
        out = vlm.reference.generate(
            **inputs,
            attention_mask=torch.ones_like(inputs["input_ids"]),
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)  # each at positions past images


@pytest.fixture(scope="module")
def expected(vlm) -> dict[str, list[int]]:
    """transformers' greedy continuations of both layouts."""
    return {
        layout: _greedy_reference(vlm, *_prompt(vlm, layout), GREEDY.max_tokens)
        for layout in ("first", "middle")
    }


def _options(vlm, **options) -> dict:
    return {"model": str(vlm.directory), "device": "cpu", "kv_cache_tokens": 2048, "page_size": 8,
            "chunk_size": 24, **options}  # fmt: skip


def test_greedy_through_llm_matches_transformers(vlm, expected):
    """Both layouts in one continuous batch, chunks of 24 (images split over chunks)."""
    llm = LLM(**_options(vlm))
    prompts, images = zip(*(_prompt(vlm, layout) for layout in ("first", "middle")), strict=True)
    outputs = llm.generate(list(prompts), GREEDY, images=list(images))
    assert [o.token_ids for o in outputs] == [expected["first"], expected["middle"]]
    assert outputs[1].usage.image_tokens == sum(image.num_tokens(2) for image in images[1]) == 47


def test_prefix_cache_with_images(vlm, expected):
    """A device hit (same images) and a host-tier restore equal the cold answer; the same text with
    another image of the same size is a miss from that image on, and answers as transformers does."""
    llm = LLM(**_options(vlm, host_cache_gb=0.05))
    prompt, images = _prompt(vlm, "middle")
    cold = llm.generate(prompt, GREEDY, images=[images])[0]
    hit = llm.generate(prompt, GREEDY, images=[images])[0]
    assert cold.usage.cached_tokens == 0 and hit.usage.cached_tokens >= len(prompt) - 8
    assert hit.token_ids == cold.token_ids == expected["middle"]

    other = [images[0], vlm.images[2]]
    missed = llm.generate(prompt, GREEDY, images=[other])[0]
    second_image = prompt.index(IMAGE_TOKEN, prompt.index(VISION_END))
    assert missed.usage.cached_tokens == second_image // 8 * 8
    assert missed.token_ids == _greedy_reference(vlm, prompt, other, GREEDY.max_tokens)

    assert llm.engine.evict_device_cache() > 0
    restored = llm.generate(prompt, GREEDY, images=[images])[0]
    stats = llm.engine.cache_stats
    assert stats.host_hits == 1 and stats.host_hit_tokens == restored.usage.cached_tokens > 0
    assert restored.token_ids == cold.token_ids


def test_speculative_verify_with_images_equals_plain(vlm, expected):
    """Drafts half right (a synthetic drafter over the known answer), verified at the positions after the
    images (index + the prompt's delta): the greedy answer is unchanged."""
    prompt, images = _prompt(vlm, "middle")
    oracle = [prompt + expected["middle"]]
    drafter = SyntheticDrafter(0.5, oracle, vlm.ours.config.vocab_size, seed=0)
    engine = Engine(EngineConfig(**_options(vlm, spec_width=2)), drafter=drafter)
    engine.add_request(prompt, GREEDY, images=images)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for step in engine.step() for t in step.new_token_ids]
    assert tokens == expected["middle"]
    stats = engine.speculative.stats
    assert stats.verify_steps > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens


def test_image_tokens_must_match_the_images(vlm):
    llm = LLM(**_options(vlm))
    prompt, images = _prompt(vlm, "middle")
    (rejected,) = llm.generate(prompt[:-20], GREEDY, images=[images])
    assert rejected.finish_reason == "error" and "runs of image tokens" in rejected.error
    (rejected,) = llm.generate(prompt, GREEDY)
    assert rejected.finish_reason == "error" and "no images" in rejected.error
