"""What every streamed request of the suites shares: the server-sent events of one POST, and a reply's
server counts and client timing. `chat.py` and `completions.py` add what their endpoint answers with.

Every request streams with `stream_options.include_usage`, so a reply carries the server's own token
counts (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`) beside the client's
timing of each chunk. A rejection (non-200) or an error event in the stream is a `RequestFailed`; nothing
here retries (a first attempt is the result).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


class RequestFailed(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status
        self.text = text


async def events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[tuple[float, dict[str, Any] | None]]:
    """(arrival time, parsed chunk) for each event of the stream, then (arrival time, None) for its
    `data: [DONE]` (a stream cut short ends without it)."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(response.status_code, (await response.aread()).decode(errors="replace"))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            if data == "[DONE]":
                yield now, None
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(500, json.dumps(chunk["error"])[:300])
            yield now, chunk


@dataclass(frozen=True)
class StreamedReply:
    finish_reason: str | None
    usage: dict[str, Any] | None  # the final usage chunk; None when the server sent none
    done: bool  # the stream ended with `data: [DONE]`
    ttft_s: float | None  # submission to the first chunk with output
    chunk_gaps_s: list[float]  # between consecutive chunks with output: inter-token latency at the client
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


class Timing:
    """The client's clock over one request: when output arrived, and the gaps between arrivals."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []

    def first_output(self, now: float) -> None:
        self.first = now if self.first is None else self.first

    def output(self, now: float) -> None:
        """A chunk of tokens: counts for TTFT and for the gaps."""
        self.first_output(now)
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now

    def reply_fields(self, finish: str | None, usage: dict[str, Any] | None, done: bool) -> dict[str, Any]:
        ttft = None if self.first is None else self.first - self.start
        return {
            "finish_reason": finish,
            "usage": usage,
            "done": done,
            "ttft_s": ttft,
            "chunk_gaps_s": self.gaps,
            "latency_s": time.perf_counter() - self.start,
        }
