"""The engine process's loop, on a stand-in engine: requests in, deltas out, and failures contained."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from morion.cache.tier_stats import CacheStats
from morion.engine.engine import Engine
from morion.engine.outputs import EngineLoad, RequestOutput, StepOutput, Usage
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
        self.aborted_after_failed_step: dict[str, bool] = {}
        self.abort_raises_for: str | None = None
        self.cache_stats = CacheStats()
        self.device = torch.device("cpu")
        self.speculative = None
        self.step_times = StepTimes()

    def add_request(self, prompt, params, request_id, images=()):
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if request_id == "explodes":
            raise RuntimeError("boom")
        self.requests[request_id] = (params, [])

    def abort(self, request_id, after_failed_step=False):
        self.aborted_after_failed_step[request_id] = after_failed_step
        if request_id == self.abort_raises_for:
            raise RuntimeError("the engine is in trouble")
        _, tokens = self.requests.pop(request_id)
        return self._final(request_id, tokens, "abort")

    def has_unfinished(self):
        return bool(self.requests)

    def load(self):
        return EngineLoad(running=0, waiting=0, pages_free=10, pages_cached=0, pages_held=0, retractions=0)

    def forward_counts(self):
        return {("decode", "eager"): 0}

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
    # ... and their working state, maybe half a forward ahead, not to the cache (engine/test_failed_step.py)
    assert loop.engine.aborted_after_failed_step == {"a": True, "b": True}
    loop.handle(AddRequest("c", [1], SamplingParams(max_tokens=1)))
    [done] = loop.step()
    assert done.request_id == "c" and done.finish_reason == "length"


def test_a_request_whose_abort_raised_after_a_failed_step_sends_nothing_more(loop):
    """The engine kept a request the loop already failed (its abort raised): its later outputs go nowhere,
    and the loop, which has sent its error, neither fails nor speaks for it again."""
    loop.handle(AddRequest("a", [1], SamplingParams(max_tokens=3)))
    loop.handle(AddRequest("b", [1], SamplingParams(max_tokens=3)))
    loop.engine.fail_next_step = True
    loop.engine.abort_raises_for = "a"
    failed = loop.step()
    assert sorted(d.request_id for d in failed) == ["a", "b"]
    assert loop.engine.has_unfinished()  # "a" is still in the engine
    loop.handle(AddRequest("c", [1], SamplingParams(max_tokens=1)))
    [done] = loop.step()  # the engine stepped "a" too
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


class ScriptedInbox:
    """An inbox whose next message arrives during a wait of the loop's (a poll with a timeout, None: until
    one comes) for which `comes(timeout)` is true; other waits time out."""

    def __init__(self, ready: list, arrivals: list, comes: Callable[[float | None], bool]) -> None:
        self.ready, self.arrivals, self.comes = ready, arrivals, comes

    def poll(self, timeout: float | None = 0.0) -> bool:
        if not self.ready and self.arrivals and timeout != 0.0 and self.comes(timeout):
            self.ready.append(self.arrivals.pop(0))
        return bool(self.ready)

    def recv(self) -> object:
        return self.ready.pop(0)


def _serve_recording_checks(monkeypatch, inbox: ScriptedInbox) -> list[tuple[str, object]]:
    """Runs `serve` on a stub engine; the outbox's messages and the integrity checks, in order."""
    from morion.server import engine_process as process

    monkeypatch.setattr(process, "release_free_heap", lambda: True)
    engine = StubEngine()
    events: list[tuple[str, object]] = []
    engine.check_integrity = lambda: events.append(("check", None))
    process.serve(
        EngineLoop(engine), inbox, SimpleNamespace(send=lambda message: events.append(("send", message)))
    )
    return events


def test_every_queued_request_is_added_before_the_next_step(monkeypatch):
    """Requests that came while the engine was idle or in a step all join the next step (and so its
    prefill forward), not one per step."""
    burst = [AddRequest(r, [1, 2], SamplingParams(max_tokens=2)) for r in "abc"]  # in the pipe together
    assert _steps_seeing(monkeypatch, burst, [Shutdown()], lambda timeout: timeout is None) == [3, 3]


def test_the_idle_integrity_check_waits_for_quiet_after_the_last_answer(monkeypatch):
    """The check walks the whole pool and host tier (30 ms on the CPU at the 80B preset's sizes): the
    request that ends the engine's work must not wait for it, and its result follows in a message of its
    own once nothing has come for IDLE_CHECK_DELAY_S."""
    request = AddRequest("r", [1, 2], SamplingParams(max_tokens=1))
    inbox = ScriptedInbox([request], [Shutdown()], comes=lambda timeout: timeout is None)
    events = _serve_recording_checks(monkeypatch, inbox)
    assert [kind for kind, _ in events] == ["send", "send", "check", "send"]
    answer, idle, _, checked = (message for _, message in events)
    assert [d.finish_reason for d in answer.deltas] == ["length"] and idle.deltas == checked.deltas == []
    # The loop's busy time, counted once the answer went out, reaches the front end at once.
    assert answer.stats.step_times.busy_seconds == 0 < idle.stats.step_times.busy_seconds


def test_a_request_that_comes_right_after_the_last_answer_does_not_wait_for_the_idle_check(monkeypatch):
    """A closed-loop client sends its next request a few ms after its last answer (here: during whatever the
    idle loop waits for first): it runs before any integrity check."""
    first, second = (AddRequest(r, [1, 2], SamplingParams(max_tokens=1)) for r in ("r", "s"))
    inbox = ScriptedInbox([first], [second, Shutdown()], comes=lambda timeout: True)
    events = _serve_recording_checks(monkeypatch, inbox)
    answers = [m.deltas[0].request_id if kind == "send" and m.deltas else kind for kind, m in events]
    assert [a for a in answers if a != "send"][:2] == ["r", "s"]


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
        first_token_reported=True,  # its first token's output came in an earlier step
    )
    none, last = Engine._output(request, [], ""), Engine._output(request, [2], "")
    assert (none.logprobs, none.top_logprobs) == ([], [])
    assert (last.logprobs, last.top_logprobs) == ([-0.2], [[(2, -0.2)]])


def _steps_seeing(monkeypatch, burst: list, later: list, comes: Callable[[float | None], bool]) -> list[int]:
    """How many requests the stub engine held at each of its steps, for messages `burst` in the pipe at
    once and `later` ones arriving during the waits for which `comes(timeout)` holds."""
    from morion.server import engine_process as process

    monkeypatch.setattr(process, "release_free_heap", lambda: True)
    engine = StubEngine()
    seen_by_steps: list[int] = []
    step = engine.step
    engine.step = lambda: seen_by_steps.append(len(engine.requests)) or step()
    inbox = ScriptedInbox(burst, later, comes)
    process.serve(EngineLoop(engine), inbox, SimpleNamespace(send=lambda message: None))
    return seen_by_steps


def _add(request_id: str, more_coming: bool) -> AddRequest:
    return AddRequest(request_id, [1, 2], SamplingParams(max_tokens=2), more_coming=more_coming)


def test_an_idle_engine_told_more_are_coming_waits_for_them_before_its_first_step(monkeypatch):
    """A burst's requests are handed over one by one (server/arrivals.py): an idle engine that is told more
    are on their way waits up to BURST_WAIT_S for them, so that they share its first step's prefill."""
    from morion.server.engine_process import BURST_WAIT_S

    waits: list[float | None] = []

    def comes(timeout: float | None) -> bool:
        waits.append(timeout)
        return timeout is None or 0 < timeout <= BURST_WAIT_S

    later = [_add("b", more_coming=True), _add("c", more_coming=False), Shutdown()]
    assert _steps_seeing(monkeypatch, [_add("a", more_coming=True)], later, comes) == [3, 3]
    assert all(0 < wait <= BURST_WAIT_S for wait in waits[:2])  # the gathering's waits, bounded


def test_a_request_alone_or_a_busy_engine_does_not_wait(monkeypatch):
    # Alone (nothing else on its way): its first step runs at once, and the next request joins later.
    later = [_add("b", more_coming=False), Shutdown()]
    alone = _steps_seeing(monkeypatch, [_add("a", more_coming=False)], later, lambda timeout: timeout != 0.0)
    assert alone[0] == 1
    # Told more are coming, but none comes within BURST_WAIT_S: the step runs after that bound.
    none_came = _steps_seeing(
        monkeypatch, [_add("a", more_coming=True)], [Shutdown()], lambda timeout: timeout is None
    )
    assert none_came == [1, 1]
