"""Streaming `/v1/completions` with token-id prompts, as the suites send them to a server that may have no
tokenizer (a random-weight preset) or whose answers are compared token for token.

Greedy, `logprobs: 0` (each generated token's own log probability, the evidence a restored answer is
compared on: two answers with equal text can still differ in what produced it), `ignore_eos` (an
extension morion, vLLM and SGLang accept: every answer has its full length), usage in the last chunk;
a `cache_salt` where one is given (vLLM's and morion's: a prompt computed apart from every cached one).
Token ids come back where the server sends them (`token_ids` on a choice, as morion without a tokenizer
and vLLM's `return_token_ids` do). A rejection or an error event is a `RequestFailed`; nothing retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from morion.validate.streaming import StreamedReply, Timing, events


@dataclass(frozen=True)
class CompletionReply(StreamedReply):
    text: str
    token_logprobs: list[float | None]
    token_ids: list[int] | None  # None when the server sends none

    def answer(self) -> dict[str, Any]:
        """What two answers are compared on."""
        return {
            "text": self.text,
            "token_logprobs": self.token_logprobs,
            "token_ids": self.token_ids,
            "completion_tokens": self.completion_tokens,
        }


async def complete(
    client: httpx.AsyncClient,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    cache_salt: str | None = None,
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
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    text: list[str] = []
    logprobs: list[float | None] = []
    token_ids: list[int] | None = None
    finish = usage = None
    done = False
    timing = Timing()
    async for now, chunk in events(client, "/v1/completions", body):
        if chunk is None:
            done = True
            break
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            chunk_logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if choice.get("token_ids") is not None:
                token_ids = (token_ids or []) + choice["token_ids"]
            if chunk_logprobs or choice.get("text"):
                timing.output(now)
            text.append(choice.get("text") or "")
            logprobs += chunk_logprobs
            finish = choice.get("finish_reason") or finish
    return CompletionReply(
        **timing.reply_fields(finish, usage, done),
        text="".join(text),
        token_logprobs=logprobs,
        token_ids=token_ids,
    )
