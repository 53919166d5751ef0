"""The engine process's loop, on a stand-in engine: requests in, deltas out, and failures contained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from morion.cache.tier_stats import CacheStats
from morion.engine.engine import Engine
from morion.engine.outputs import RequestOutput, StepOutput, Usage
from morion.engine.sampling_params import SamplingParams
from morion.engine.step_timing import StepTimes
from morion.errors import InvalidRequestError
from morion.server.engine_messages import AbortRequest, AddRequest, Shutdown
from morion.server.engine_process import EngineLoop


class StubEngine:
    """Each step gives every request one token; a request finishes after `max_tokens`."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[SamplingParams, list[int]]] = {}
        self.fail_next_step = False
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_retractions=0)
        self.pool = SimpleNamespace(num_free=10)
        self.prefix_cache = SimpleNamespace(cached_pages=0)
        self.cache_stats = CacheStats()
        self.device = torch.device("cpu")
        self.speculative = None
        self.step_times = StepTimes()

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if request_id == "explodes":
            raise RuntimeError("boom")
        self.requests[request_id] = (params, [])

    def abort(self, request_id):
        _, tokens = self.requests.pop(request_id)
        return self._final(request_id, tokens, "abort")

    def has_unfinished(self):
        return bool(self.requests)

    def check_integrity(self):
        pass

    def cache_memory_bytes(self):
        return 0

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("a kernel fell over")
        outputs = []
        for request_id, (params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens) + 7)
            final = None
            if len(tokens) == params.max_tokens:
                del self.requests[request_id]
                final = self._final(request_id, tokens, "length")
            outputs.append(StepOutput(request_id, [tokens[-1]], f"t{tokens[-1]}", final is not None, final))
        return outputs

    @staticmethod
    def _final(request_id, tokens, reason):
        return RequestOutput(request_id, [1], list(tokens), "", reason, Usage(1, len(tokens), 0))


@pytest.fixture
def loop() -> EngineLoop:
    return EngineLoop(StubEngine())  # type: ignore[arg-type]


def test_requests_stream_deltas_until_finished(loop):
    assert loop.handle(AddRequest("a", [1], SamplingParams(max_tokens=2))) == []
    first, second = loop.step(), loop.step()
    assert [(d.request_id, d.token_ids, d.text, d.finish_reason) for d in first] == [("a", [7], "t7", None)]
    [last] = second
    assert last.finish_reason == "length" and last.usage == Usage(1, 2, 0)
    assert not loop.engine.has_unfinished()


def test_an_invalid_request_is_a_client_error_and_an_engine_bug_an_internal_one(loop):
    [invalid] = loop.handle(AddRequest("x", [], SamplingParams()))
    assert (invalid.finish_reason, invalid.internal) == ("error", False)
    assert "empty" in invalid.error
    [broken] = loop.handle(AddRequest("explodes", [1], SamplingParams()))
    assert (broken.finish_reason, broken.internal) == ("error", True)
    # The exception's text stays in the log: the client is told where to look, not what broke.
    assert "boom" not in broken.error and "server log" in broken.error and "explodes" in broken.error


def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_keeps_serving(loop):
    loop.handle(AddRequest("a", [1], SamplingParams(max_tokens=5)))
    loop.handle(AddRequest("b", [1], SamplingParams(max_tokens=5)))
    loop.engine.fail_next_step = True
    failed = loop.step()
    assert sorted(d.request_id for d in failed) == ["a", "b"]
    assert all(d.finish_reason == "error" and d.internal and "server log" in d.error for d in failed)
    assert not any("kernel" in d.error for d in failed)
    assert not loop.engine.has_unfinished()  # aborted, so their pages went back
    loop.handle(AddRequest("c", [1], SamplingParams(max_tokens=1)))
    [done] = loop.step()
    assert done.request_id == "c" and done.finish_reason == "length"


def test_abort_and_shutdown(loop):
    loop.handle(AddRequest("a", [1], SamplingParams(max_tokens=5)))
    loop.step()
    [aborted] = loop.handle(AbortRequest("a"))
    assert aborted.finish_reason == "abort" and aborted.usage.completion_tokens == 1
    assert loop.handle(AbortRequest("a")) == []  # already gone: nothing to say
    loop.handle(AddRequest("b", [1], SamplingParams(max_tokens=5)))
    [stopped] = loop.handle(Shutdown())
    assert stopped.request_id == "b" and stopped.finish_reason == "abort"
    assert loop.stopped


def test_stats_after_idle_integrity_check(loop):
    loop.check_integrity()
    stats = loop.stats()
    assert (stats.running, stats.waiting, stats.pages_free, stats.pages_held, stats.integrity) == (
        0,
        0,
        10,
        0,
        "ok",
    )


def test_the_last_answer_goes_out_before_the_idle_integrity_check():
    """The check walks the whole pool (264K pages on the 80B preset): a request that ends the engine's work
    must not wait for it, and the check's result follows in a message of its own."""
    from morion.server.engine_process import serve

    engine = StubEngine()
    sent: list[tuple[str, object]] = []

    def check() -> None:
        sent.append(("check", None))

    engine.check_integrity = check
    loop = EngineLoop(engine)
    inbox = SimpleNamespace(
        messages=[AddRequest("r", [1, 2], SamplingParams(max_tokens=1)), Shutdown()],
    )
    inbox.poll = lambda timeout=0: bool(inbox.messages) and (len(inbox.messages) > 1 or not engine.requests)
    inbox.recv = lambda: inbox.messages.pop(0)
    outbox = SimpleNamespace(send=lambda message: sent.append(("send", message)))
    serve(loop, inbox, outbox)
    kinds = [kind for kind, _ in sent]
    assert kinds == ["send", "check", "send"]
    assert [d.finish_reason for d in sent[0][1].deltas] == ["length"] and sent[2][1].deltas == []
    # The loop's busy time, counted once the answer went out, reaches the front end with the idle stats.
    assert sent[0][1].stats.step_times.busy_seconds == 0 < sent[2][1].stats.step_times.busy_seconds


def test_busy_outputs_carry_stats_at_most_every_period_and_always_when_idle(monkeypatch):
    """Stats cost time on every step's way out; the front end's gauges need them a few times a second."""
    from morion.server import engine_process as process

    clock = iter(range(1000))  # each reading 10 ms later than the last: a period is every 5th step
    monkeypatch.setattr(process.time, "monotonic", lambda: next(clock) / 100)
    loop = EngineLoop(StubEngine())
    inbox = SimpleNamespace(messages=[AddRequest("r", [1], SamplingParams(max_tokens=12)), Shutdown()])
    inbox.poll = lambda timeout=0: (
        bool(inbox.messages) and (len(inbox.messages) > 1 or not loop.engine.requests)
    )
    inbox.recv = lambda: inbox.messages.pop(0)
    sent = []
    process.serve(loop, inbox, SimpleNamespace(send=sent.append))
    carrying = [message.stats is not None for message in sent]
    with_deltas = [has for has, message in zip(carrying, sent, strict=True) if message.deltas]
    assert len(with_deltas) == 12 and with_deltas[0] and with_deltas[-1]  # the first, and the one going idle
    assert 2 <= sum(with_deltas[1:-1]) <= 3 and carrying[-1]  # every 5th in between; the idle message


@pytest.mark.parametrize("quiet", [True, False], ids=["idle-a-second", "next-request-sooner"])
def test_the_heap_is_trimmed_after_a_second_of_idleness_only(monkeypatch, quiet):
    """Back-to-back requests never pay the trim (nor fault its pages in again); an engine left idle for
    HEAP_TRIM_IDLE_S gives the memory its work freed back, once."""
    from morion.server import engine_process as process

    trims = []
    monkeypatch.setattr(process, "release_free_heap", lambda: trims.append("trim"))
    engine = StubEngine()
    ready = [AddRequest("r", [1, 2], SamplingParams(max_tokens=1))]  # in the pipe now
    later = [AddRequest("s", [1], SamplingParams(max_tokens=1)), Shutdown()]  # arriving one by one
    asked = []

    def poll(timeout=0.0):
        asked.append(timeout)
        arrives = timeout is None or (timeout == process.HEAP_TRIM_IDLE_S and not quiet)
        if arrives and not ready:
            ready.append(later.pop(0))
        return bool(ready)

    inbox = SimpleNamespace(poll=poll, recv=lambda: ready.pop(0))
    process.serve(EngineLoop(engine), inbox, SimpleNamespace(send=lambda message: None))
    assert process.HEAP_TRIM_IDLE_S in asked
    assert trims == (["trim", "trim"] if quiet else [])


def test_a_step_without_new_tokens_carries_no_logprobs():
    """A request that ends (an error, an abort) in a step that added no token sends no logprobs, not the
    whole answer's again. The engine's step outputs carry them (the loop forwards them as they are)."""
    request = SimpleNamespace(
        request_id="r",
        params=SimpleNamespace(logprobs=1),
        prompt_logprobs=None,
        output_logprobs=[-0.1, -0.2],
        output_top_logprobs=[[(1, -0.1)], [(2, -0.2)]],
    )
    none, last = Engine._output(request, [], ""), Engine._output(request, [2], "")
    assert (none.logprobs, none.top_logprobs) == ([], [])
    assert (last.logprobs, last.top_logprobs) == ([-0.2], [[(2, -0.2)]])
