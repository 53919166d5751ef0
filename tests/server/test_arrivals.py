"""server/arrivals.py: which generation requests are read and not yet handed over, and what each hand-over
tells the engine (`AddRequest.more_coming`)."""

from __future__ import annotations

import asyncio

import pytest

from morion.config import EngineConfig
from morion.engine.sampling_params import SamplingParams
from morion.server.arrivals import Arrivals, ArrivalsMiddleware
from morion.server.engine_client import EngineClient
from morion.server.engine_messages import AddRequest


def test_a_generation_request_counts_from_its_body_to_its_hand_over_once():
    arrivals = Arrivals()
    chat, other = {"path": "/v1/chat/completions"}, {"path": "/tokenize"}
    arrivals.body_read(chat)
    arrivals.body_read(chat)  # read twice (it is not): counted once
    arrivals.body_read(other)  # not a generation
    assert arrivals.waiting == 1
    arrivals.handed_over(chat)
    arrivals.handed_over(chat)  # and the end of its HTTP request after its hand-over: nothing more
    arrivals.handed_over(other)
    assert arrivals.waiting == 0


def test_the_middleware_ends_the_count_of_a_request_that_failed_before_its_hand_over():
    arrivals = Arrivals()

    async def refusing_app(scope, receive, send):
        arrivals.body_read(scope)
        raise ValueError("a 400, say")

    scope = {"type": "http", "path": "/v1/completions"}
    with pytest.raises(ValueError):
        asyncio.run(ArrivalsMiddleware(refusing_app, arrivals)(scope, None, None))
    assert arrivals.waiting == 0


def test_each_hand_over_tells_whether_more_are_on_their_way():
    client = EngineClient(EngineConfig(model="unused"))
    sent: list[AddRequest] = []
    client._send = sent.append  # no engine process: record what would go through the pipe
    params = SamplingParams(max_tokens=1)
    first, second = ({"path": "/v1/completions"} for _ in range(2))
    client.arrivals.body_read(first)
    client.arrivals.body_read(second)
    client.submit([([1, 2], params, ())], 0.0, first)  # the second one is still being prepared
    client.submit([([1, 2], params, ()), ([1, 2], params, ())], 0.0, second)  # its n = 2 choices
    assert [message.more_coming for message in sent] == [True, True, False]
    assert client.arrivals.waiting == 0
