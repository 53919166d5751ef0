"""`morion.LLM`: the engine in-process, for offline use, tests and benchmarks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.outputs import RequestOutput, StepOutput, Usage
from morion.engine.sampling_params import SamplingParams
from morion.errors import InvalidRequestError, MorionError
from morion.multimodal.image_decode import PreparedImage

Prompt = str | Sequence[int]


class LLM:
    """`LLM(model=None, **EngineConfig fields)`; `model` is a path, a known name, or None (the default)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Finishes the cache tiers' disk writes and stops tensor-parallel follower ranks (`Engine.close`).
        Idempotent; also on leaving a `with LLM(...) as llm:` block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MorionError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise MorionError("this model has no chat template")
        return self.tokenizer.encode_chat(messages)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        images: Sequence[Sequence[PreparedImage]] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts as one continuous batch. A prompt that can never run (too long, bad ids) gets
        an output with finish_reason "error" and the reason; the others are unaffected. `images[i]`: the
        images of prompt i (`prepare_image`), whose tokens its token ids hold (models with a vision
        tower; `Engine.add_request`)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        images = images or [()] * len(prompts)
        if len(images) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but images for {len(images)}")
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            token_ids = self.encode(prompt)
            try:
                order.append(self.engine.add_request(token_ids, params, images=images[index]))
            except InvalidRequestError as error:
                request_id = f"rejected-{index}"
                order.append(request_id)
                outputs[request_id] = RequestOutput(
                    request_id, token_ids, [], "", "error", Usage(len(token_ids), 0, 0), error=str(error)
                )
        while self.engine.has_unfinished():
            for step in self.engine.step():
                if step.final is not None:
                    outputs[step.request_id] = step.final
        return [outputs[request_id] for request_id in order]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Yields one request's deltas as they are generated (other queued requests advance too)."""
        request_id = self.engine.add_request(self.encode(prompt), sampling_params or SamplingParams())
        try:
            while self.engine.has_unfinished():
                for step in self.engine.step():
                    if step.request_id == request_id:
                        yield step
                        if step.finished:
                            return
        finally:
            self.engine.abort(request_id)
