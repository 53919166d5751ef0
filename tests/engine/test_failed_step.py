"""A step that raises halfway through its forward (on the H200, a burst of prompts ran out of device memory
in a prefill): the engine process fails the requests it held and keeps serving, and nothing the failed
forward may have written reaches the prefix cache. The hybrid model's recurrent state is updated in place
layer by layer, so after a failure some layers' state is a token ahead of the request's tokens; cached, it
would make every later hit on that prefix a wrong answer."""

from __future__ import annotations

import random

import pytest

from morion.engine.sampling_params import SamplingParams
from morion.server.engine_messages import AddRequest
from morion.server.engine_process import EngineLoop

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 8


class _Fault(RuntimeError):
    pass


def _fail_once_in(module):
    """The module's next call raises (after the layers before it ran); later calls run as usual."""

    def hook(module, args):
        handle.remove()
        raise _Fault("out of memory, as it were")

    handle = module.register_forward_pre_hook(hook)


def _next_deltas(loop: EngineLoop) -> list:
    for _ in range(10):
        deltas = loop.step()
        if deltas:
            return deltas
    raise AssertionError("ten steps without a token")


def _serve(loop: EngineLoop, request_id: str, prompt: list[int]) -> tuple[list[int], object]:
    loop.handle(AddRequest(request_id, prompt, GREEDY))
    tokens = []
    while True:
        for delta in loop.step():
            assert delta.request_id == request_id and delta.error is None
            tokens += delta.token_ids
            if delta.finish_reason is not None:
                return tokens, delta.usage


@pytest.mark.parametrize("failing_step", ["prefill", "decode"])
def test_a_failed_step_fails_its_requests_and_caches_none_of_its_state(
    tiny_qwen3_next, engine_factory, engine_runner, failing_step
):
    rng = random.Random(5)
    prompt = [rng.randrange(128) for _ in range(2 * PAGE - 1)]  # its first decode ends a page
    engine = engine_factory(tiny_qwen3_next, page_size=PAGE)
    loop = EngineLoop(engine)
    last_layer = engine.model.model.layers[-1]  # the Gated DeltaNet layers before it have run
    loop.handle(AddRequest("a", prompt, GREEDY))
    if failing_step == "decode":
        [first] = _next_deltas(loop)  # the prefill
        [second] = _next_deltas(loop)  # a decode: 16 tokens computed, a full page
        generated = first.token_ids + second.token_ids
    _fail_once_in(last_layer)
    [failed] = _next_deltas(loop)
    assert (failed.request_id, failed.finish_reason, failed.internal) == ("a", "error", True)
    assert not engine.has_unfinished()
    engine.check_integrity()

    # The conversation comes back: its prefix (the prompt and, after a decode, the tokens generated
    # before the failure) plus new tokens, served as a cold engine serves it.
    before = generated if failing_step == "decode" else [7]
    returning = prompt + before + [rng.randrange(128) for _ in range(9)]
    tokens, usage = _serve(loop, "b", returning)
    cold = engine_factory(tiny_qwen3_next, page_size=PAGE, enable_prefix_cache=False)
    assert tokens == engine_runner(cold, [returning], GREEDY)[0].token_ids
    if failing_step == "decode":
        assert usage.cached_tokens == 2 * PAGE, "no hit on the page before the failure: nothing was checked"
