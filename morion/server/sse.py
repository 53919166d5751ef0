"""Server-sent events that stop as soon as the client goes away.

Starlette's StreamingResponse notices a disconnect only when a write fails, which for a request still
queued or in a long prefill can be much later; here a watcher on the ASGI receive channel cancels the
stream at once, and `on_close` (which aborts the engine requests and frees their pages) always runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("morion.server")

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (call only after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_to_end(request: Request, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
    """Consumes `events` for a whole (not streamed) response; a client that goes away cancels it, and
    `on_close` (which aborts the engine requests) always runs. Raises what the events raise, and
    `asyncio.CancelledError` when the client went away."""

    async def drain() -> None:
        async for _ in events:
            pass

    work = asyncio.create_task(drain())
    disconnect = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not work.done():
            work.cancel()
        on_close()
    work.result()


class EventStreamResponse(Response):
    # Response.__init__ is not called: it would send a Content-Length for an empty body.
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        disconnect = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, disconnect):
                task.cancel()
            for result in await asyncio.gather(pump, disconnect, return_exceptions=True):
                if isinstance(result, Exception) and not isinstance(result, OSError):
                    logger.error("stream failed", exc_info=result)
            await self._events.aclose()  # type: ignore[attr-defined]
            self._on_close()

    async def _pump(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
