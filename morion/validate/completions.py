"""Streaming `/v1/completions` with token-id prompts, as the suites send them to a server that may have no
tokenizer (a random-weight preset) or whose answers are compared token for token.

Greedy, `logprobs: 0` (each generated token's own log probability, the evidence a restored answer is
compared on: two answers with equal text can still differ in what produced it), `ignore_eos` (an
extension morion, vLLM and SGLang accept: every answer has its full length), usage in the last chunk.
Token ids come back where the server sends them (`token_ids` on a choice, as morion without a tokenizer
and vLLM's `return_token_ids` do). A rejection or an error event is a `RequestFailed`; nothing retries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx

from morion.validate.chat import RequestFailed


class CompletionReply(NamedTuple):
    text: str
    token_logprobs: list[float | None]
    token_ids: list[int] | None  # None when the server sends none
    finish_reason: str | None
    usage: dict[str, Any] | None
    done: bool  # the stream ended with `data: [DONE]`
    ttft_s: float | None
    chunk_gaps_s: list[float]
    latency_s: float

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details")
        if not isinstance(details, dict) or details.get("cached_tokens") is None:
            return None
        return int(details["cached_tokens"])

    def answer(self) -> dict[str, Any]:
        """What two answers are compared on."""
        return {
            "text": self.text,
            "token_logprobs": self.token_logprobs,
            "token_ids": self.token_ids,
            "completion_tokens": self.completion_tokens,
        }


async def complete(
    client: httpx.AsyncClient, model: str, prompt: Sequence[int], max_tokens: int
) -> CompletionReply:
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    logprobs: list[float | None] = []
    token_ids: list[int] = []
    saw_ids = False
    gaps: list[float] = []
    finish = usage = first = last = None
    done = False
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(response.status_code, (await response.aread()).decode(errors="replace"))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(500, json.dumps(chunk["error"])[:300])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                chunk_logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
                if choice.get("token_ids") is not None:
                    saw_ids = True
                    token_ids += choice["token_ids"]
                if chunk_logprobs or choice.get("text"):
                    first = now if first is None else first
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                text.append(choice.get("text") or "")
                logprobs += chunk_logprobs
                finish = choice.get("finish_reason") or finish
    return CompletionReply(
        "".join(text),
        logprobs,
        token_ids if saw_ids else None,
        finish,
        usage,
        done,
        None if first is None else first - start,
        gaps,
        time.perf_counter() - start,
    )
