"""Streaming `/v1/chat/completions` as the suites send it: one request, one `ChatReply` with its evidence.

Every request streams with `stream_options.include_usage`, so the reply carries the server's own token
counts (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`) beside the client's
timing of each content chunk. Tool-call deltas are assembled into whole calls. A rejection (non-200) or
an error event in the stream is a `RequestFailed`; nothing here retries (a first attempt is the result).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, NamedTuple

import httpx

from morion.bench.endpoint import Endpoint


class RequestFailed(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status
        self.text = text


class ChatReply(NamedTuple):
    content: str
    tool_calls: list[dict[str, Any]]  # [{"id", "name", "arguments": raw JSON text}], in index order
    finish_reason: str | None
    usage: dict[str, Any] | None  # the final usage chunk; None when the server sent none
    done: bool  # the stream ended with `data: [DONE]`
    ttft_s: float | None  # submission to the first content (or tool-call) chunk
    chunk_gaps_s: list[float]  # between consecutive content chunks: inter-token latency at the client
    latency_s: float

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")

    @property
    def cached_tokens(self) -> int | None:
        """None when the server does not report prompt_tokens_details (cache hits cannot be checked)."""
        details = (self.usage or {}).get("prompt_tokens_details")
        if not isinstance(details, dict) or details.get("cached_tokens") is None:
            return None
        return int(details["cached_tokens"])

    def evidence(self) -> dict[str, Any]:
        """What a case keeps of its reply: the text, calls, finish, server counts and timing."""
        return {
            "content": self.content,
            "tool_calls": self.tool_calls,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "done": self.done,
            "ttft_s": self.ttft_s,
            "latency_s": self.latency_s,
        }


class ChatClient:
    """Sends chat requests for one served model (greedy unless `extra` says otherwise)."""

    def __init__(self, endpoint: Endpoint, model: str) -> None:
        self.endpoint = endpoint
        self.model = model

    def body(self, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }

    def ask(self, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> ChatReply:
        """One request from synchronous code, on a client of its own."""

        async def run() -> ChatReply:
            async with self.endpoint.client() as client:
                return await self.send(client, messages, max_tokens, **extra)

        return asyncio.run(run())

    async def send(
        self, client: httpx.AsyncClient, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
    ) -> ChatReply:
        body = self.body(messages, max_tokens, **extra)
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        gaps: list[float] = []
        finish = usage = first = last = None
        done = False
        start = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
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
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        first = now if first is None else first
                        if delta.get("content"):
                            if last is not None:
                                gaps.append(now - last)
                            last = now
                            content.append(delta["content"])
                        for call in delta.get("tool_calls") or ():
                            _merge_call(calls, call)
                    finish = choice.get("finish_reason") or finish
        return ChatReply(
            "".join(content),
            [calls[i] for i in sorted(calls)],
            finish,
            usage,
            done,
            None if first is None else first - start,
            gaps,
            time.perf_counter() - start,
        )


def _merge_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """OpenAI streams a call as deltas: id and name first, then argument text in pieces."""
    call = calls.setdefault(delta.get("index", len(calls)), {"id": None, "name": "", "arguments": ""})
    call["id"] = delta.get("id") or call["id"]
    function = delta.get("function") or {}
    call["name"] += function.get("name") or ""
    call["arguments"] += function.get("arguments") or ""
