"""The URL target: any OpenAI-compatible server, driven through streaming `/v1/completions`.

A group's requests start together (asyncio tasks on one client) and are timed from the arrival of their
stream chunks. Before the first group, one probe request settles two things, recorded in the results:

- prompt format: token ids (exact lengths, as morion, vLLM and SGLang accept) when the server takes them,
  else text (random words from a fixed list, one token each in most vocabularies; the lengths reported are
  the server's `usage.prompt_tokens`);
- token timing: one stream chunk per generated token with text. A server that sends no text (a model
  without a tokenizer) is timed through `logprobs: 0`, whose per-chunk token lists count every token.

Token counts come from the final `usage` chunk (`stream_options.include_usage`) when the server sends it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import httpx

from morion.bench.endpoint import Endpoint
from morion.bench.first_token_parts import LEGACY_PARTS, PARTS, THREAD_PARTS, PartTotals
from morion.bench.timing import GroupResult, RequestTiming
from morion.engine.step_timing import StepTimes
from morion.errors import MorionError

# A fixed vocabulary of common words for text prompts; id i becomes word i mod len (ids stay unique enough:
# the prompt factory's ids are random, so the word sequences are too).
_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by word but what "
    "some we can out other were all there when up use your how said an each she which do their time if "
    "will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may "
    "down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great "
    "think say help low line differ turn cause much mean before move right boy old too same tell does set "
    "three want air well also play small end put home read hand port large spell add even land here must "
    "big high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country found "
    "answer school grow study still learn plant cover food sun four between state keep eye never last let "
    "thought city tree cross farm hard start might story saw far sea draw left late run while press close"
)
_WORDS = tuple(_WORD_TEXT.split())
# A morion server's forward counts by kind and path (server/metrics.py), as /metrics names them.
_FORWARDS_SERIES = re.compile(r'morion_engine_forwards_total\{kind="(?P<kind>\w+)",path="(?P<path>\w+)"\}')


class RemoteTarget:
    def __init__(
        self,
        url: str,
        served_model: str | None,
        api_key: str | None,
        timeout_s: float,
        vocab_size: int | None,
        logprobs: int | None = None,
    ) -> None:
        self.url = url
        self.logprobs = logprobs  # every request's `logprobs` (bench --logprobs); timing may need 0 anyway
        self.name = f"server at {url}"
        self.vocab_size = vocab_size
        self.endpoint = Endpoint(url, api_key, timeout_s)
        self.models = self.endpoint.list_models()
        if served_model is None and not self.models:
            raise MorionError(f"{url}/v1/models lists no model: name one with --served-model")
        self.served_model = served_model or self.models[0]
        self.server_info = self.endpoint.server_info()
        if vocab_size is None and self.server_info is not None:
            self.vocab_size = (self.server_info.get("model") or {}).get("vocab_size")
        self.prompt_format = "token_ids"
        self.token_timing = "chunks"
        self._probe()

    # ----------------------------------------------------------------------------------- set-up
    def _client(self, **limits: int) -> httpx.AsyncClient:
        return self.endpoint.client(**limits)

    def _probe(self) -> None:
        prompt = [7, 11, 13, 17, 19, 23, 29, 31]
        try:
            stats = self._probe_once(prompt)
        except _RequestRejected as rejected:
            if rejected.status not in (400, 422):
                raise MorionError(f"{self.url} rejected a probe request: {rejected}") from None
            self.prompt_format = "text"  # the server wants text prompts
            try:
                stats = self._probe_once(prompt)
            except _RequestRejected as again:
                raise MorionError(f"{self.url} rejected a probe request: {again}") from None
        timed, completion = stats
        if completion >= 2 and timed < 2:
            self.token_timing = "logprobs"
            try:
                timed, completion = self._probe_once(prompt)
            except _RequestRejected as rejected:
                raise MorionError(f"{self.url} sends no text and no logprobs to time: {rejected}") from None
            if timed < completion:
                raise MorionError(f"{self.url} streams {timed} timed tokens for {completion}: cannot time")

    def _probe_once(self, prompt: list[int]) -> tuple[int, int]:
        """(tokens seen in chunks, completion tokens) of one short streamed request."""

        async def run() -> tuple[int, int]:
            async with self._client() as client:
                timing, timed = await self._stream(client, prompt, 4)
                return timed, timing.completion_tokens

        try:
            return asyncio.run(run())
        except httpx.HTTPError as error:
            raise MorionError(f"cannot reach {self.url}: {error or type(error).__name__}") from None

    # ----------------------------------------------------------------------------------- groups
    def run_group(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> GroupResult:
        async def run() -> list[RequestTiming]:
            async with self._client(max_connections=len(prompts) + 1) as client:
                tasks = [self._stream(client, prompt, max_tokens) for prompt in prompts]
                return [timing for timing, _ in await asyncio.gather(*tasks)]

        try:
            return GroupResult(asyncio.run(run()))
        except httpx.HTTPError as error:
            raise MorionError(f"request to {self.url} failed: {error or type(error).__name__}") from None
        except _RequestRejected as rejected:
            raise MorionError(f"{self.url} rejected a request: {rejected}") from None

    def _body(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": list(prompt) if self.prompt_format == "token_ids" else _as_text(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # an extension that morion, vLLM and SGLang accept
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        elif self.token_timing == "logprobs":
            body["logprobs"] = 0
        return body

    async def _stream(
        self, client: httpx.AsyncClient, prompt: Sequence[int], max_tokens: int
    ) -> tuple[RequestTiming, int]:
        body = self._body(prompt, max_tokens)
        first = last = finished = None
        timed = 0
        usage: dict[str, Any] | None = None
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise _RequestRejected(
                    response.status_code, (await response.aread()).decode(errors="replace")
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _RequestRejected(500, json.dumps(chunk["error"])[:300])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    tokens = self._tokens_in(choice)
                    if tokens:
                        timed += tokens
                        first = now if first is None else first
                        last = now
                    if choice.get("finish_reason") is not None:
                        finished = now
        end = time.perf_counter()
        first = first if first is not None else finished or end
        last = last if last is not None else first
        completion = usage.get("completion_tokens", timed) if usage else timed
        prompt_tokens = usage.get("prompt_tokens", len(prompt)) if usage else len(prompt)
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return RequestTiming(prompt_tokens, completion, cached, start, first, last), timed

    def _tokens_in(self, choice: dict[str, Any]) -> int:
        if self.token_timing == "logprobs":
            logprobs = choice.get("logprobs") or {}
            return len(logprobs.get("tokens") or ())
        return 1 if choice.get("text") else 0

    def describe(self) -> dict[str, Any]:
        return {
            "target": self.name,
            "url": self.url,
            "served_model": self.served_model,
            "models_listed": self.models,
            "prompt_format": self.prompt_format,
            "token_timing": self.token_timing,
            "server_info": self.server_info,
        }

    def step_times(self) -> StepTimes | None:
        """The server engine's step counters from its /metrics (a morion server; None for others)."""
        samples = self.endpoint.metrics() or {}
        names = {
            "decode_steps": 'morion_engine_steps_total{kind="decode"}',
            "other_steps": 'morion_engine_steps_total{kind="other"}',
            "decode_seconds": 'morion_engine_step_seconds_total{kind="decode"}',
            "other_seconds": 'morion_engine_step_seconds_total{kind="other"}',
            "busy_seconds": "morion_engine_busy_seconds_total",
        }
        if not all(series in samples for series in names.values()):
            return None
        return StepTimes(
            decode_steps=int(samples[names["decode_steps"]]),
            other_steps=int(samples[names["other_steps"]]),
            decode_seconds=samples[names["decode_seconds"]],
            other_seconds=samples[names["other_seconds"]],
            busy_seconds=samples[names["busy_seconds"]],
        )

    def first_token_parts(self) -> PartTotals | None:
        """The server's running sums and counts of each time-to-first-token part, from its /metrics
        histograms (a morion server; None for others)."""
        samples = self.endpoint.metrics() or {}
        seconds, counts = {}, {}
        legs = "morion_request_to_engine_seconds_count" in samples  # else an older server's handoff sum
        for part in (PARTS if legs else PARTS + LEGACY_PARTS) + THREAD_PARTS:
            name = f"morion_request_{part.removesuffix('_s')}_seconds"
            if f"{name}_sum" in samples and f"{name}_count" in samples:
                seconds[part], counts[part] = samples[f"{name}_sum"], int(samples[f"{name}_count"])
        return PartTotals(seconds, counts) if counts else None

    def forward_counts(self) -> dict[str, int] | None:
        """The server engine's forwards so far as "kind/path" -> count (runner/forward_counts.py), from its
        /metrics (a morion server; None for others)."""
        samples = self.endpoint.metrics() or {}
        counts = {}
        for name, value in samples.items():
            series = _FORWARDS_SERIES.fullmatch(name)
            if series:
                counts[f"{series['kind']}/{series['path']}"] = int(value)
        return counts or None

    def close(self) -> None:
        pass


class _RequestRejected(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


def _as_text(prompt: Sequence[int]) -> str:
    return " ".join(_WORDS[token % len(_WORDS)] for token in prompt)
