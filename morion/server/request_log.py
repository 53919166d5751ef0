"""`--log-requests`: one line per HTTP request, written when its response has been sent.

    morion: POST /v1/chat/completions 200 prompt=37 cached=32 completion=8 ttft=0.121s duration=0.456s

Token counts and TTFT (from the request's arrival to its first generated token) are those of a
generation request, as its `usage` reported them; other requests show the method, path, status and
duration. Off by default: on a small CPU a log line per request costs about as much as a token.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("morion.requests")

_GENERATION = "morion_generation"  # key in the ASGI scope's state: what `note_generation` recorded


def note_generation(request: Request, time_to_first_token: Any, usage: Any) -> None:
    """Called by a generation handler: `time_to_first_token()` and `usage()` are read when the response
    has been sent (a stream's totals are known only then)."""
    request.state.morion_generation = (time_to_first_token, usage)


class RequestLogger:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            logger.info(_line(scope, status, time.perf_counter() - started))


def _line(scope: Scope, status: int, duration: float) -> str:
    words = [scope["method"], scope["path"], str(status or "-")]
    generation = (scope.get("state") or {}).get(_GENERATION)
    if generation is not None:
        ttft, usage = generation[0](), generation[1]()
        words += [
            f"prompt={usage['prompt_tokens']}",
            f"cached={usage['prompt_tokens_details']['cached_tokens']}",
            f"completion={usage['completion_tokens']}",
            f"ttft={ttft:.3f}s" if ttft is not None else "ttft=-",
        ]
    words.append(f"duration={duration:.3f}s")
    return " ".join(words)
