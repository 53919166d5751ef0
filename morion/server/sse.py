"""Server-sent events that stop as soon as the client goes away.

Starlette's StreamingResponse notices a disconnect only when a write fails, which for a request still
queued or in a long prefill can be much later; here a watcher on the ASGI receive channel cancels the
stream at once, and `on_close` (which aborts the engine requests and frees their pages) always runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("morion.server")

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (call only after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client of a whole (not streamed) response disconnected before it was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T], on_close: Callable[[], None]) -> T:
    """The result of `work`, unless the client goes away first (then `ClientGone`: nobody would read the
    answer); `on_close`, which aborts the engine requests, always runs. Raises what `work` raises."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
        on_close()
        # A cancelled task is done only once it has run again: settle both before reading either.
        await asyncio.gather(task, disconnect, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def respond(
    request: Request,
    events: AsyncIterator[bytes],
    on_close: Callable[[], None],
    stream: bool,
    whole: Callable[[], Any],
) -> Any:
    """The events as a stream, or (not `stream`) run to their end and answered by `whole()`."""
    if stream:
        return EventStreamResponse(events, on_close)

    async def drain() -> None:
        async for _ in events:
            pass

    try:
        await unless_client_leaves(request, drain(), on_close)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    return whole()


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
