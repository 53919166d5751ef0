"""The offline target: an `Engine` built in-process from the engine flags, stepped by the bench itself.

Token arrival times are taken when `Engine.step()` returns the token to Python, the same point at which
`morion.LLM` would hand it to a caller (a step ends in a device-to-host copy of the sampled ids, so the
clock never runs ahead of the GPU).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from morion.bench.first_token_parts import EngineFirstTokens, PartTotals
from morion.bench.timing import GroupResult, RequestTiming
from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.outputs import StepOutput
from morion.engine.sampling_params import SamplingParams
from morion.engine.step_timing import StepTimes


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    logprobs: int | None = None,
    step: Callable[[], list[StepOutput]] | None = None,
    first_tokens: EngineFirstTokens | None = None,
) -> tuple[list[RequestTiming], list[list[int]]]:
    """Submits every prompt at once (greedy, EOS ignored, exactly `max_tokens` each, with `logprobs` as
    given) to an idle `engine` and steps it until all have finished: each request's timing and generated
    ids, in prompt order. `step` steps the engine instead of `engine.step` (a profiled run marks each
    step: bench/profile.py); where each request's time to its first token went in the engine is added to
    `first_tokens`."""
    step = step or engine.step
    if engine.has_unfinished():
        raise RuntimeError("the engine has unfinished requests from before this group")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    starts: dict[str, float] = {}
    firsts: dict[str, float] = {}
    lasts: dict[str, float] = {}
    finals = {}
    order = []
    for prompt in prompts:
        start = time.perf_counter()
        request_id = engine.add_request(prompt, params)
        starts[request_id] = start
        order.append(request_id)
    while engine.has_unfinished():
        outputs = step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                firsts.setdefault(out.request_id, now)
                lasts[out.request_id] = now
            if out.first_token_times is not None and first_tokens is not None:
                first_tokens.add(out.first_token_times)
            if out.final is not None:
                finals[out.request_id] = out.final
    timings, token_ids = [], []
    for request_id in order:
        final = finals[request_id]
        if final.finish_reason == "error":
            raise RuntimeError(f"request {request_id} failed in the engine: {final.error}")
        usage = final.usage
        timings.append(
            RequestTiming(
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.cached_tokens,
                starts[request_id],
                firsts[request_id],
                lasts[request_id],
            )
        )
        token_ids.append(list(final.token_ids))
    return timings, token_ids


class EngineTarget:
    def __init__(self, config: EngineConfig, logprobs: int | None = None) -> None:
        started = time.perf_counter()
        self.engine: Engine = Engine(config)
        self.build_s = time.perf_counter() - started
        self.config = config
        self.logprobs = logprobs  # every request's `logprobs` (bench --logprobs)
        self.name = "morion (offline)"
        self.vocab_size: int | None = self.engine.model.config.vocab_size
        self._first_tokens = EngineFirstTokens()

    def run_group(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> GroupResult:
        timings, _ = generate(
            self.engine, prompts, max_tokens, self.logprobs, first_tokens=self._first_tokens
        )
        return GroupResult(timings)

    def run_request(self, prompt: Sequence[int], max_tokens: int) -> tuple[RequestTiming, list[int]]:
        """One request alone (greedy, EOS ignored): its timing and the token ids it generated."""
        [timing], [token_ids] = generate(self.engine, [prompt], max_tokens, first_tokens=self._first_tokens)
        return timing, token_ids

    def restart(self) -> tuple[float, float]:
        """A restart in-process: the engine is closed (its disk writes finish) and freed, and a new one is
        built from the same config, with an empty device cache and host tier but the same disk directory.
        Returns (close seconds, build seconds)."""
        started = time.perf_counter()
        self.engine.close()
        closed = time.perf_counter()
        # The old engine's KV pool, state slots and graphs must be gone before the new one sizes its pool
        # from the free device memory (two 80B engines do not fit one GPU either).
        self.engine = None  # type: ignore[assignment]  (a failed rebuild leaves none to close)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        built = time.perf_counter()
        self.engine = Engine(self.config)
        return closed - started, time.perf_counter() - built

    def step_times(self) -> StepTimes:
        return self.engine.step_times.snapshot()

    def forward_counts(self) -> dict[str, int]:
        return {f"{kind}/{path}": count for (kind, path), count in self.engine.forward_counts().items()}

    def first_token_parts(self) -> PartTotals:
        return self._first_tokens.totals()

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        model = engine.model
        by_dtype: dict[str, int] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            name = str(tensor.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + tensor.numel() * tensor.element_size()
        return {
            "target": self.name,
            "model_path": str(engine.model_path),
            "model_type": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tensor_bytes_by_dtype": by_dtype,
            "dtype": str(self.config.torch_dtype).removeprefix("torch."),
            "device": str(engine.device),
            "max_model_len": engine.max_model_len,
            "kv_pool_tokens": engine.pool.num_pages * self.config.page_size,
            "cache_spec": engine.pool.spec.describe(),
            "build_s": self.build_s,
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
