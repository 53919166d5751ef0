"""Runs one completion request on the engine and answers it, streamed or whole.

Both paths consume the same `RequestStream` batches (one per engine step). A request that fails in the
engine ends a stream with an OpenAI-style error event, or answers non-streaming with 400 (the request was
invalid) or 500 (the engine failed); either way its other choices are aborted and the server keeps going.
A request the server aborts (the shutdown drain ran out of time) ends the same way, with a 503 error:
"abort" is no OpenAI finish_reason, and a cut answer must not look like a finished one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from morion.server.engine_client import EngineClient, RequestStream, delta_error
from morion.server.prepare import EngineJob
from morion.server.request_log import note_generation
from morion.server.responses import ResponseFormat, UsageTotals
from morion.server.sse import DONE, ClientGone, EventStreamResponse, sse_event, unless_client_leaves


async def run_job(
    request: Request,
    client: EngineClient,
    job: EngineJob,
    response_format: ResponseFormat,
    stream: bool,
    include_usage: bool,
    arrival: float,
) -> Response | EventStreamResponse:
    request_stream = client.submit(job.submissions(), arrival, request.scope)
    usage = UsageTotals(job.n)
    note_generation(request, lambda: request_stream.time_to_first_token, usage.body)
    if stream:
        events = _events(request_stream, response_format, usage, include_usage)
        return EventStreamResponse(events, request_stream.close)
    try:
        body = await unless_client_leaves(
            request, _collect(request_stream, response_format, usage), request_stream.close
        )
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the request log shows why it ended
    return JSONResponse(body)


async def _collect(
    stream: RequestStream, response_format: ResponseFormat, usage: UsageTotals
) -> dict[str, Any]:
    choices = [response_format.new_choice() for _ in stream.request_ids]
    async for batch in stream.batches():
        for index, delta in batch:
            error = delta_error(delta)
            if error is not None:
                raise error
            choice = choices[index]
            choice.record(delta)
            response_format.collect(index, delta, choice)
            if delta.finish_reason is not None:
                usage.add(index, delta.usage)
    return response_format.response(choices, usage)


async def _events(
    stream: RequestStream, response_format: ResponseFormat, usage: UsageTotals, include_usage: bool
) -> AsyncIterator[bytes]:
    # With include_usage, OpenAI puts "usage": null on every chunk and the totals on one last chunk.
    usage_field = {"usage": None} if include_usage else {}
    choices = [response_format.new_choice() for _ in stream.request_ids]
    opening = response_format.opening_chunks(len(choices))
    if opening:
        yield b"".join(sse_event(chunk | usage_field) for chunk in opening)
    async for batch in stream.batches():
        events = []
        for index, delta in batch:
            error = delta_error(delta)
            if error is not None:
                yield sse_event(error.body())
                return
            choice = choices[index]
            choice.record(delta)
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
