"""Images on a model with a vision tower (issue #26): what one image of --image-size x --image-size pixels
costs, in its parts.

- preprocessing (the server's front end): `prepare_image` on a photo-like JPEG: decode, RGB, resize to
  the processor's grid, content hash;
- patches (the engine): normalise and lay out the patches on the device;
- encoder: the vision tower over them (CUDA-synchronised);
- TTFT in-process (`Engine`, one output token): a chat-shaped prompt (text, the image, text) with a new
  image each repeat (cold), the same prompt and image again (a prefix-cache hit: no encode), and a
  text-only prompt of the same length (what the image adds).

Each figure is the median of --repeats after one warm-up (which compiles the kernels). Writes
`<out>/<date>-vision-<model>.json` and `.md` with provenance. Presets have no tokenizer: prompts are
token ids ([vision_start] [image] x tokens [vision_end] around random text ids).

    python scripts/bench_vision.py --model preset:qwen3.8-flash-next-12l --device cuda \
        --weight-dtype fp8 --kv-cache-dtype fp8 --kv-cache-tokens 65536 --image-size 1024 --out results
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from morion.bench import provenance
from morion.bench.report import output_paths, slug, write_json
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.engine_flags import add_engine_flags, engine_config
from morion.multimodal.image_decode import PreparedImage, prepare_image
from morion.multimodal.patches import image_patches

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def photo_like_jpeg(size: int, seed: int) -> bytes:
    """A JPEG (quality 90) of smooth colour fields with fine noise: compresses like a photograph."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (9, 9, 3)).astype(np.float32)
    smooth = np.asarray(
        Image.fromarray(coarse.astype(np.uint8)).resize((size, size), Image.Resampling.BICUBIC)
    )
    noisy = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def _prompt(
    engine: Engine, image: PreparedImage | None, image_tokens: int, text: int, seed: int
) -> list[int]:
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    ids = (vocab // 16, vocab // 2)  # ordinary tokens: special ones sit at the top of Qwen's vocabularies
    words = rng.integers(*ids, size=text).tolist()
    if image is None:  # as long, all text
        return words[: text // 2] + rng.integers(*ids, size=image_tokens + 2).tolist() + words[text // 2 :]
    tokens = engine.model.config.image_tokens
    middle = [tokens.vision_start, *[tokens.image] * image_tokens, tokens.vision_end]
    return words[: text // 2] + middle + words[text // 2 :]


def _ttft(engine: Engine, prompt: list[int], images: list[PreparedImage]) -> tuple[float, int]:
    """Seconds to the first (only) token, and the prompt tokens the prefix cache served."""
    _sync(engine.device)
    started = time.perf_counter()
    engine.add_request(prompt, ONE_TOKEN, images=images)
    final = None
    while engine.has_unfinished():
        for step in engine.step():
            final = step.final or final
    _sync(engine.device)
    return time.perf_counter() - started, final.usage.cached_tokens


def measure(engine: Engine, size: int, repeats: int, text: int) -> dict[str, Any]:
    encoder = engine.image_encoder
    if encoder is None:
        raise SystemExit(f"bench_vision: {engine.config.model} has no vision tower")
    device, merge = engine.device, encoder.processing.merge_size
    files = [photo_like_jpeg(size, seed) for seed in range(repeats + 1)]
    prepare, images = [], []
    for data in files:
        started = time.perf_counter()
        images.append(prepare_image(data, encoder.processing))
        prepare.append(time.perf_counter() - started)
    tokens = images[0].num_tokens(merge)
    dtype = engine.model.visual.patch_embed.proj.weight.dtype
    patching, encoding = [], []
    with torch.inference_mode():
        for image in images:
            _sync(device)
            started = time.perf_counter()
            patches = image_patches(image.pixels, encoder.processing, device).to(dtype)
            _sync(device)
            patched = time.perf_counter()
            engine.model.encode_images(patches, [image.grid])
            _sync(device)
            patching.append(patched - started)
            encoding.append(time.perf_counter() - patched)
    cold, hit, text_only = [], [], []
    for index, image in enumerate(images):  # the first of each is the warm-up
        prompt = _prompt(engine, image, tokens, text, seed=index)
        cold.append(_ttft(engine, prompt, [image]))
        hit.append(_ttft(engine, prompt, [image]))
        text_only.append(_ttft(engine, _prompt(engine, None, tokens, text, seed=1000 + index), []))
    pixels = images[0].pixels.shape
    return {
        "image": {
            "size": [size, size],
            "jpeg_bytes": len(files[0]),
            "resized": [pixels[0], pixels[1]],
            "grid_thw": list(images[0].grid),
            "tokens": tokens,
        },
        "prompt_tokens": tokens + 2 + text,
        "preprocess_ms": _median_ms(prepare[1:]),
        "patches_ms": _median_ms(patching[1:]),
        "encoder_ms": _median_ms(encoding[1:]),
        "ttft_cold_ms": _median_ms([seconds for seconds, _ in cold[1:]]),
        "ttft_hit_ms": _median_ms([seconds for seconds, _ in hit[1:]]),
        "hit_cached_tokens": hit[-1][1],
        "ttft_text_only_ms": _median_ms([seconds for seconds, _ in text_only[1:]]),
        "repeats": repeats,
    }


def markdown(result: dict[str, Any]) -> str:
    m, image = result["measured"], result["measured"]["image"]
    prov = result["provenance"]
    return "\n".join(
        [
            f"# Images on {result['model']} ({prov['date']})",
            "",
            f"`{prov['command']}`",
            "",
            f"Device {prov.get('device_name', result['device'])}, morion {prov['morion_version']} at "
            f"`{(prov.get('git_commit') or 'unknown')[:12]}`, torch {prov['torch']}. One "
            f"{image['size'][0]}x{image['size'][1]} JPEG ({image['jpeg_bytes']:,} bytes) resized to "
            f"{image['resized'][1]}x{image['resized'][0]}: grid {image['grid_thw']}, "
            f"{image['tokens']} tokens; prompts of {m['prompt_tokens']} tokens. Medians of {m['repeats']} "
            "after a warm-up.",
            "",
            "| part | ms |",
            "|---|---|",
            f"| preprocessing (decode, resize, hash; front end) | {m['preprocess_ms']} |",
            f"| patches on the device | {m['patches_ms']} |",
            f"| vision tower | {m['encoder_ms']} |",
            f"| TTFT, new image (cold) | {m['ttft_cold_ms']} |",
            f"| TTFT, same image again ({m['hit_cached_tokens']} tokens cached) | {m['ttft_hit_ms']} |",
            f"| TTFT, text only, same length | {m['ttft_text_only_ms']} |",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--image-size", type=int, default=1024, help="pixels per side (1024)")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs after the warm-up (3)")
    parser.add_argument("--text-tokens", type=int, default=64, help="text tokens around the image (64)")
    parser.add_argument("--out", default="results", help="directory for the JSON and Markdown (results)")
    args = parser.parse_args()
    if args.model is None:
        args.model = "preset:qwen3.8-flash-next-12l"
    engine = Engine(engine_config(args))
    measured = measure(engine, args.image_size, args.repeats, args.text_tokens)
    device = str(engine.device)
    prov = provenance.collect(" ".join(["python", *sys.argv]), device)
    result = {
        "schema": "morion-bench-vision/1",
        "model": args.model,
        "device": device,
        "config": dataclasses.asdict(engine.config),
        "provenance": prov,
        "measured": measured,
    }
    path = output_paths(Path(args.out), prov["date"], slug(f"vision-{Path(args.model).name}"))
    write_json(path, result)
    path.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(path)


if __name__ == "__main__":
    main()
