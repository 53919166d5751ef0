"""Runs one completion request on the engine and answers it, streamed or whole.

Both paths consume the same `RequestStream` batches (one per engine step). A request that fails in the
engine ends a stream with an OpenAI-style error event, or answers non-streaming with 400 (the request was
invalid) or 500 (the engine failed); either way its other choices are aborted and the server keeps going.
A request the server aborts (the shutdown drain ran out of time) ends the same way, with a 503 error:
"abort" is no OpenAI finish_reason, and a cut answer must not look like a finished one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from morion.engine.messages import RequestDelta
from morion.server.engine_client import EngineClient, RequestStream
from morion.server.errors import APIError
from morion.server.prepare import EngineJob
from morion.server.responses import ResponseFormat, UsageTotals
from morion.server.sse import DONE, EventStreamResponse, sse_event, wait_for_disconnect


async def run_job(
    request: Request,
    client: EngineClient,
    job: EngineJob,
    response_format: ResponseFormat,
    stream: bool,
    include_usage: bool,
    arrival: float,
) -> Response | EventStreamResponse:
    request_stream = client.submit(job.submissions(), arrival)
    if stream:
        events = _events(request_stream, response_format, job.n, include_usage)
        return EventStreamResponse(events, request_stream.close)
    collect = asyncio.create_task(_collect(request_stream, response_format, job.n))
    disconnect = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():
            collect.cancel()  # the client is gone; closing the stream aborts its engine requests
        # A cancelled task is done only once it has run again: settle both before reading either.
        await asyncio.gather(collect, disconnect, return_exceptions=True)
        request_stream.close()
    if collect.cancelled():
        return Response(status_code=499)  # nobody reads it; the access log shows why it ended
    return JSONResponse(collect.result())


def _error(delta: RequestDelta) -> APIError:
    if delta.finish_reason == "abort":
        return APIError(
            503, "the server is shutting down and stopped this request before it finished", code="aborted"
        )
    if delta.internal:
        return APIError(500, f"the engine failed on this request: {delta.error}", code="engine_error")
    return APIError(400, delta.error or "the engine rejected the request")


def _ended_early(delta: RequestDelta) -> bool:
    return delta.finish_reason in ("error", "abort")


async def _collect(stream: RequestStream, response_format: ResponseFormat, n: int) -> dict[str, Any]:
    choices = [response_format.new_choice() for _ in stream.request_ids]
    usage = UsageTotals(n)
    async for batch in stream.batches():
        for index, delta in batch:
            if _ended_early(delta):
                raise _error(delta)
            choice = choices[index]
            if response_format.wants_logprobs and delta.token_ids:
                response_format.delta_logprobs(delta, choice)
            choice.add(delta.text)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                usage.add(index, delta.usage)
    return response_format.response(choices, usage)


async def _events(
    stream: RequestStream, response_format: ResponseFormat, n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    # With include_usage, OpenAI puts "usage": null on every chunk and the totals on one last chunk.
    usage_field = {"usage": None} if include_usage else {}
    choices = [response_format.new_choice() for _ in stream.request_ids]
    usage = UsageTotals(n)
    opening = response_format.opening_chunks(len(choices))
    if opening:
        yield b"".join(sse_event(chunk | usage_field) for chunk in opening)
    async for batch in stream.batches():
        events = []
        for index, delta in batch:
            if _ended_early(delta):
                yield sse_event(_error(delta).body())
                return
            choice = choices[index]
            delta_choice = response_format.delta_choice(index, delta, choice)
            choice.add(delta.text)
            if delta_choice is not None:
                events.append(sse_event(response_format.chunk([delta_choice]) | usage_field))
            if delta.finish_reason is not None:
                usage.add(index, delta.usage)
                for entry in response_format.finish_choices(index, delta.finish_reason, choice):
                    events.append(sse_event(response_format.chunk([entry]) | usage_field))
        if events:
            yield b"".join(events)  # one write per engine step
    if include_usage:
        yield sse_event(response_format.chunk([], usage.body()))
    yield DONE
