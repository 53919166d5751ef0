"""The `--baseline hf` target: transformers' own model and `generate`, random weights, one request at a time.

The model is built with `AutoModelForCausalLM.from_config` from the same config morion builds from (a
preset or a model directory), initialised randomly on the target device in the same dtype. Token
arrival times come from a streamer, which `generate` calls once per new token; on CUDA it synchronises
first so that a time is taken when the token exists, not when its kernel was queued.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Sequence
from typing import Any

import torch

from morion.bench.roofline import read_hf_config
from morion.bench.timing import GroupResult, RequestTiming
from morion.errors import MorionError


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MorionError(
            "--baseline hf needs transformers (a dev dependency): pip install 'morion[dev]'"
        ) from None
    return transformers


class _Clock:
    """A `generate` streamer that records when each generated token arrives (the first `put` is the
    prompt)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFTarget:
    def __init__(self, model: str, dtype: torch.dtype, device: torch.device) -> None:
        transformers = _transformers()
        hf_config = dict(read_hf_config(model))
        model_type = hf_config.pop("model_type", None)
        try:
            config = transformers.AutoConfig.for_model(model_type, **hf_config)
        except (ValueError, KeyError) as error:
            raise MorionError(f"transformers cannot build {model} ({model_type!r}): {error}") from None
        started = time.perf_counter()
        # Random initialisation on the device itself: on the CPU it would take minutes at full size.
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        if next(model.parameters()).device != device:
            model = model.to(device)  # a transformers version that built it elsewhere
        self.model = model.eval()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.build_s = time.perf_counter() - started
        self.model_name = model
        self.device = device
        self.dtype = dtype
        self.name = "transformers"
        self.vocab_size: int | None = config.vocab_size

    def run_group(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> GroupResult:
        return GroupResult([self._one(prompt, max_tokens) for prompt in prompts])

    def _one(self, prompt: Sequence[int], max_tokens: int) -> RequestTiming:
        clock = _Clock(self.device)
        input_ids = torch.tensor([list(prompt)], device=self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # the EOS of a random model must not end it early
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
        generated = output.shape[1] - input_ids.shape[1]
        return RequestTiming(len(prompt), generated, 0, start, clock.times[0], clock.times[-1])

    def describe(self) -> dict[str, Any]:
        return {
            "target": self.name,
            "transformers": importlib.metadata.version("transformers"),
            "model": self.model_name,
            "model_class": type(self.model).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "build_s": self.build_s,
            "weights": "random (from_config)",
        }

    def step_times(self) -> None:
        return None  # transformers' generate has no engine steps to count

    def forward_counts(self) -> None:
        return None  # nor forwards of the engine's kinds

    def first_token_parts(self) -> None:
        return None  # nor parts of a time to first token

    def close(self) -> None:
        del self.model
