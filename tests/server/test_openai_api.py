"""The OpenAI API of a real `morion serve`, driven by the official `openai` client."""

from __future__ import annotations

import asyncio

import pytest

from morion.bench.endpoint import parse_prometheus
from tests.server.conftest import ALLOWED_ORIGIN, MAX_REQUEST_BYTES, READ_TIMEOUT_S

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Give me a synonym for happy.",
    "Which planet is known as the red planet?",
    "Translate 'good morning' into Spanish.",
    "Name three fruits.",
]
# fp32 on CPU: a batch and a single request differ only in summation order, so greedy choices may differ
# only where the top two logprobs are this close.
TIE_GAP = 1e-3


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _usage_is_complete(usage) -> None:
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_models_lists_the_served_name(server):
    models = server.openai().models.list()
    assert models.data[0].id == "smollm2"  # served-model-name from the profile


def test_chat_completion(server):
    response = server.openai().chat.completions.create(
        model="smollm2", messages=_messages(QUESTIONS[0]), max_tokens=16, temperature=0
    )
    [choice] = response.choices
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    _usage_is_complete(response.usage)
    assert response.usage.completion_tokens <= 16


def test_chat_streaming_equals_non_streaming_and_reports_usage(server):
    client = server.openai()
    whole = client.chat.completions.create(
        model="smollm2", messages=_messages(QUESTIONS[2]), max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=_messages(QUESTIONS[2]),
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == []
    _usage_is_complete(chunks[-1].usage)
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_prompt_forms(server):
    client = server.openai()
    with server.http() as http:
        token_ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    by_text = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    by_ids = client.completions.create(model="smollm2", prompt=token_ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.choices[0].finish_reason == "length"
    assert by_text.usage.prompt_tokens == len(token_ids)
    batch = client.completions.create(
        model="smollm2", prompt=["The capital of France is", "One, two,"], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text  # greedy: n equal
    assert batch.usage.completion_tokens == 20
    id_lists = client.completions.create(model="smollm2", prompt=[token_ids, token_ids[:3]], max_tokens=2)
    assert len(id_lists.choices) == 2


def test_completions_streaming_with_usage(server):
    chunks = list(
        server.openai().completions.create(
            model="smollm2",
            prompt="Once upon a time",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_repeated_prompt_reuses_cached_tokens(server):
    client = server.openai()
    messages = _messages("Summarise in one sentence why the sky looks blue during the day. " * 4)
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_seed_n_and_sampling_extensions(server):
    client = server.openai()
    messages = _messages("Count from 1 to 10, separated by commas.")
    free = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
    assert "5" in free.choices[0].message.content
    stopped = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=30, temperature=0, stop=["5"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == free.choices[0].message.content.split("5")[0]

    def sampled():
        return client.chat.completions.create(
            model="smollm2",
            messages=_messages("Tell me a word."),
            max_completion_tokens=8,
            temperature=1.0,
            top_p=0.95,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            seed=1234,
            n=3,
            extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1},
        )

    one, two = sampled(), sampled()
    assert len(one.choices) == 3
    assert [c.message.content for c in one.choices] == [c.message.content for c in two.choices]
    assert len({c.message.content for c in one.choices}) > 1  # seed + i per choice
    ignored = client.completions.create(
        model="smollm2", prompt="Hi", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ignored.usage.completion_tokens == 4


def test_logprobs(server):
    client = server.openai()
    chat = client.chat.completions.create(
        model="smollm2",
        messages=_messages(QUESTIONS[3]),
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token
        assert entry.bytes == list(entry.token.encode())
    completion = client.completions.create(
        model="smollm2", prompt="One, two,", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text


def _greedy_run(client, question: str):
    return client.chat.completions.create(
        model="smollm2",
        messages=_messages(question),
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )


async def _entries(stream) -> list:
    entries = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                entries += choice.logprobs.content
    return entries


def test_eight_concurrent_streams_equal_their_sequential_runs(server):
    client = server.async_openai()

    async def run(question: str) -> list:
        return await _entries(await _greedy_run(client, question))

    async def together_then_alone() -> tuple[list, list]:
        together = await asyncio.gather(*(run(q) for q in QUESTIONS))
        alone = [await run(q) for q in QUESTIONS]
        return together, alone

    together, alone = asyncio.run(together_then_alone())
    for question, concurrent, sequential in zip(QUESTIONS, together, alone, strict=True):
        assert concurrent, question
        for step, (mine, theirs) in enumerate(zip(concurrent, sequential, strict=False)):
            if mine.token == theirs.token:
                continue
            top = theirs.top_logprobs
            gap = top[0].logprob - top[1].logprob
            assert gap < TIE_GAP, (
                f"{question!r}: step {step} differs ({mine.token!r} vs {theirs.token!r}), gap {gap}"
            )
            break
        else:
            assert len(concurrent) == len(sequential), question


def test_tokenize_detokenize_and_render(server):
    messages = _messages("How many legs does a spider have?")
    with server.http() as http:
        rendered = http.post("/v1/chat/completions/render", json={"messages": messages}).json()
        assert rendered["count"] == len(rendered["token_ids"])
        assert "spider" in rendered["prompt"]
        tokenized = http.post("/tokenize", json={"messages": messages}).json()
        assert tokenized["tokens"] == rendered["token_ids"]
        assert tokenized["max_model_len"] == 2048
        text = http.post("/detokenize", json={"tokens": rendered["token_ids"]}).json()["prompt"]
        assert "spider" in text
    chat = server.openai().chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == rendered["count"]


def test_server_info_shows_profile_flags_and_their_precedence(server):
    info = server.server_info()
    assert info["state"] == "ready"
    assert info["capacity"]["max_model_len"] == 2048  # the command line beats the profile's 1024
    assert info["config"]["kv_cache_tokens"] == 8192  # from the profile
    assert info["config"]["chunk_size"] == 512
    assert info["server"]["max_request_bytes"] == MAX_REQUEST_BYTES
    assert info["server"]["read_timeout"] == READ_TIMEOUT_S  # the profile sets the new flags too
    assert info["server"]["allowed_origins"] == [ALLOWED_ORIGIN]
    assert info["config"]["device"] == "cpu" and info["config"]["dtype"] == "float32"
    assert info["server"]["profile"].endswith("serve.toml")
    assert any(d.startswith("dtype: float32") for d in info["decisions"])
    # SmolLM2's template writes no <function=...> calls: hermes by default; no reasoning split unless asked.
    assert info["features"]["tool_call_parser"] == "hermes"
    assert info["features"]["reasoning_parser"] is None
    assert "morion serve: ready on" in server.log() and "auto           dtype" in server.log()


def test_metrics(server):
    server.openai().completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    with server.http() as http:
        text = http.get("/metrics").text
    for name in (
        "morion_http_requests_total",
        "morion_prompt_tokens_total",
        "morion_generation_tokens_total",
        "morion_cached_prompt_tokens_total",
        "morion_time_to_first_token_seconds_bucket",
        "morion_inter_token_latency_seconds_bucket",
        "morion_requests_running",
        "morion_requests_waiting",
        "morion_kv_pages_free",
        "morion_kv_cache_usage_ratio",
    ):
        assert name in text, name
    assert 'morion_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    # The engine's steps: a prefill, then a decode step for the second token; their time, and the loop's.
    samples = parse_prometheus(text)
    assert samples['morion_engine_steps_total{kind="decode"}'] >= 1
    assert samples['morion_engine_steps_total{kind="other"}'] >= 1
    assert samples['morion_engine_step_seconds_total{kind="decode"}'] > 0
    assert samples["morion_engine_busy_seconds_total"] > 0
    # How the forwards ran, every kind and path a series: on a CPU all eagerly (no CUDA graphs).
    forwards = {name: value for name, value in samples.items() if name.startswith("morion_engine_forwards")}
    assert len(forwards) == 8
    assert sum(v for name, v in forwards.items() if 'path="eager"' in name) >= 2
    assert sum(v for name, v in forwards.items() if 'path="graph"' in name) == 0
    # The time to first token by part: the front end's once per HTTP request, the engine's queue and
    # prefill and the hand-over (its two legs and their sum) once per engine request that produced a token.
    parts = ("prepare", "to_engine", "queue", "prefill", "from_engine", "handoff")
    assert all(samples[f"morion_request_{part}_seconds_count"] >= 1 for part in parts)
    assert samples["morion_request_prefill_seconds_sum"] > 0
    legs = samples["morion_request_to_engine_seconds_sum"] + samples["morion_request_from_engine_seconds_sum"]
    assert legs == pytest.approx(samples["morion_request_handoff_seconds_sum"])
