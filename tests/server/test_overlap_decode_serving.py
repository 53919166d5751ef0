"""`morion serve --overlap-decode` (engine/overlap.py) driven by the official `openai` client: streamed and
whole answers are the synchronous engine's, token for token, for concurrent requests of several lengths."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from morion.engine.sampling_params import SamplingParams
from morion.llm import LLM
from tests.server.conftest import RunningServer, start_server, stop

PROMPTS = [[5, 17, 42, 9, 100, 77, 1, 2, 64, 65, 66], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201, 7] * 5]
LENGTHS = [12, 5, 9]
POOL = ["--kv-cache-tokens", "1024", "--load-format", "dummy", "--device", "cpu"]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def overlap_server(tmp_path_factory, tiny_qwen3_next_chat_dir) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("overlap_server") / "serve.log"
    running = start_server(["--model", str(tiny_qwen3_next_chat_dir), *POOL, "--overlap-decode"], log_path)
    yield running
    stop(running)


def test_overlapped_serving_answers_as_the_synchronous_engine(overlap_server, tiny_qwen3_next_chat_dir):
    llm = LLM(str(tiny_qwen3_next_chat_dir), load_format="dummy", device="cpu", kv_cache_tokens=1024)
    expected = [
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].text
        for prompt, n in zip(PROMPTS, LENGTHS, strict=True)
    ]
    client, model = overlap_server.openai(), str(tiny_qwen3_next_chat_dir)

    def complete(index: int, stream: bool):
        return client.completions.create(
            model=model,
            prompt=PROMPTS[index],
            max_tokens=LENGTHS[index],
            temperature=0,
            extra_body=IGNORE_EOS,
            stream=stream,
        )

    def whole(index: int) -> str:
        completion = complete(index, stream=False)
        assert completion.usage.completion_tokens == LENGTHS[index]
        return completion.choices[0].text

    def streamed(index: int) -> str:
        return "".join(chunk.choices[0].text for chunk in complete(index, stream=True) if chunk.choices)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: their decode steps batch together
        assert list(pool.map(whole, range(len(PROMPTS)))) == expected
        assert list(pool.map(streamed, range(len(PROMPTS)))) == expected
    assert "decode: overlapped steps" in overlap_server.log_once_it_has("decode: overlapped steps")
