"""How a request the server aborts ends for its client (issue 21, item 10): "abort" is no OpenAI
finish_reason, and a cut answer must not look finished, so a stream ends with a 503 error event and a whole
response is a 503, on the completion routes and on the Responses and Messages APIs' block streams alike.
The server aborts requests only when its shutdown drain runs out of time."""

from __future__ import annotations

import asyncio
import json

import pytest

from morion.engine.outputs import Usage
from morion.server.chat_stream import answer_blocks
from morion.server.completion_format import CompletionFormat
from morion.server.engine_messages import RequestDelta
from morion.server.errors import APIError
from morion.server.prepare import EngineJob
from morion.server.protocol import CompletionRequest, parse_body
from morion.server.responses import TokenTexts, UsageTotals
from morion.server.serving import _collect, _events


class _Stream:
    """A RequestStream's consumer side, replaying engine batches."""

    def __init__(self, batches: list) -> None:
        self.request_ids = ["a"]
        self._batches = batches

    async def batches(self):
        for batch in self._batches:
            yield batch


ABORTED = [
    [(0, RequestDelta("a", [5], "Once", None, None))],
    [(0, RequestDelta("a", [], "", None, None, "abort", Usage(3, 1, 0)))],
]


def _format() -> CompletionFormat:
    request = parse_body(b'{"prompt": [1, 2, 3], "max_tokens": 4}', CompletionRequest)
    job = EngineJob([[1, 2, 3]], [], 1)
    return CompletionFormat("cmpl-1", "model", TokenTexts(None), request, job, None)


def test_an_aborted_stream_ends_with_an_error_event():
    async def events() -> list[bytes]:
        return [
            event async for event in _events(_Stream(ABORTED), _format(), UsageTotals(1), include_usage=False)
        ]

    payloads = [json.loads(event[6:]) for event in asyncio.run(events())]
    assert not any(c.get("finish_reason") == "abort" for p in payloads for c in p.get("choices", []))
    error = payloads[-1]["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "aborted"
    assert "shutting down" in error["message"]


def test_an_aborted_whole_response_is_a_503():
    with pytest.raises(APIError) as raised:
        asyncio.run(_collect(_Stream(ABORTED), _format(), UsageTotals(1)))
    assert raised.value.status == 503 and raised.value.code == "aborted"


def test_an_aborted_answer_of_the_responses_and_messages_apis_is_a_503():
    async def blocks() -> list:
        return [block async for block in answer_blocks(_Stream(ABORTED), lambda: None)]

    with pytest.raises(APIError) as raised:
        asyncio.run(blocks())
    assert raised.value.status == 503 and raised.value.code == "aborted"
