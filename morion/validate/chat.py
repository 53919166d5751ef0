"""Streaming `/v1/chat/completions` as the suites send it: one request, one `ChatReply` with its evidence.

The stream, the server's counts and the client's timing are `streaming.py`'s; here, the content and the
tool calls (their deltas assembled into whole calls).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from morion.bench.endpoint import Endpoint
from morion.validate.streaming import StreamedReply, Timing, events


@dataclass(frozen=True)
class ChatReply(StreamedReply):
    content: str
    tool_calls: list[dict[str, Any]]  # [{"id", "name", "arguments": raw JSON text}], in index order

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
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish = usage = None
        done = False
        timing = Timing()
        async for now, chunk in events(
            client, "/v1/chat/completions", self.body(messages, max_tokens, **extra)
        ):
            if chunk is None:
                done = True
                break
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    timing.output(now)
                    content.append(delta["content"])
                if delta.get("tool_calls"):
                    timing.first_output(now)  # a call counts for TTFT, not for the gaps between tokens
                    for call in delta["tool_calls"]:
                        _merge_call(calls, call)
                finish = choice.get("finish_reason") or finish
        return ChatReply(
            **timing.reply_fields(finish, usage, done),
            content="".join(content),
            tool_calls=[calls[i] for i in sorted(calls)],
        )


def _merge_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """OpenAI streams a call as deltas: id and name first, then argument text in pieces."""
    call = calls.setdefault(delta.get("index", len(calls)), {"id": None, "name": "", "arguments": ""})
    call["id"] = delta.get("id") or call["id"]
    function = delta.get("function") or {}
    call["name"] += function.get("name") or ""
    call["arguments"] += function.get("arguments") or ""
