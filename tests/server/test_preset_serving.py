"""`morion serve --model preset:NAME`: random weights with no tokenizer, served by a real `morion serve` and
driven by the official `openai` client. The pool (1024 tokens) is smaller than the preset's context (4096),
so max model len is limited by the pool, the case whose start-up summary once failed the ready path.
Also: an error on the way to ready ends the server with one line and exit status 1."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from morion.bench.endpoint import parse_prometheus
from morion.models.presets import preset_config
from tests.server.conftest import RunningServer, free_port, start_server, stop

MODEL = "preset:qwen3-next-tiny"
POOL_TOKENS = 1024
PROMPT = [5, 17, 42, 9, 300, 77, 1, 2]


@pytest.fixture(scope="module")
def preset_server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("preset_server") / "serve.log"
    args = ["--model", MODEL, "--device", "cpu", "--kv-cache-tokens", str(POOL_TOKENS), "--chunk-size", "256"]
    running = start_server(args, log_path)
    yield running
    assert stop(running) == 0, running.log()


def test_load_and_cache_memory_are_reported_from_the_start(preset_server):
    """Before any request (a soak's starting point), and growing as a prompt is cached: its packed token
    ids in the radix tree, the pool pages written (a CPU pool is mapped in as it fills)."""
    load = preset_server.server_info()["load"]
    assert load is not None and (load["running"], load["pages_held"], load["integrity"]) == (0, 0, "ok")
    start = load["cache_memory_bytes"]
    assert start > 0
    with preset_server.http() as http:
        assert parse_prometheus(http.get("/metrics").text)["morion_engine_cache_memory_bytes"] == start
    prompt = [(7 * i) % 500 + 3 for i in range(600)]
    preset_server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    deadline = time.monotonic() + 30
    while (load := preset_server.server_info()["load"])["cache_memory_bytes"] == start:
        assert time.monotonic() < deadline, "the cache memory figure did not change after a cached prompt"
        time.sleep(0.1)
    # 37 pages of K/V (512 bytes a token here) and their ids: at least the ids' 8 bytes a token.
    assert load["cache_memory_bytes"] - start >= 8 * 592


def test_the_pool_limits_max_model_len_and_every_description_says_so(preset_server):
    assert preset_config(MODEL)["max_position_embeddings"] > POOL_TOKENS
    log = preset_server.log()
    assert "max model len: 1024 (auto: limited by the KV pool)" in log
    assert "tokenizer      none" in log
    info = preset_server.server_info()
    assert info["state"] == "ready"
    assert info["capacity"]["max_model_len"] == POOL_TOKENS
    assert info["capacity"]["kv_cache_tokens"] == POOL_TOKENS
    assert "max model len: 1024 (auto: limited by the KV pool)" in info["decisions"]
    assert info["model"]["context_length"] == 4096 and info["features"]["tokenizer"] is False
    [model] = preset_server.openai().models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == POOL_TOKENS
    with preset_server.http() as http:
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "morion_" in metrics.text


def test_token_id_prompts_return_token_ids(preset_server):
    client = preset_server.openai()
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    [choice] = response.choices
    token_ids = choice.model_extra["token_ids"]
    assert choice.text == "" and len(token_ids) == 6 and choice.finish_reason == "length"
    assert all(0 <= t < 512 for t in token_ids)
    assert response.usage.prompt_tokens == len(PROMPT) and response.usage.completion_tokens == 6

    # A list of token-id lists: a choice per prompt; the first one greedy again, so the same ids.
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, [3, 4, 5]], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].model_extra["token_ids"] == token_ids
    assert len(batch.choices[1].model_extra["token_ids"]) == 6

    # Streamed: every chunk carries its tokens, together the same ids.
    streamed = []
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
    ):
        for streamed_choice in chunk.choices:
            streamed += streamed_choice.model_extra["token_ids"]
    assert streamed == token_ids


def test_logprobs_name_tokens_by_id(preset_server):
    response = preset_server.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    [choice] = response.choices
    token_ids = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in token_ids]
    assert len(choice.logprobs.token_logprobs) == 4 and choice.logprobs.text_offset == [0, 0, 0, 0]
    for top in choice.logprobs.top_logprobs:
        assert len(top) == 3 and all(name.startswith("token_id:") for name in top)


def test_text_and_chat_are_refused_with_the_reason(preset_server):
    client = preset_server.openai()
    with pytest.raises(openai.BadRequestError, match="no tokenizer") as text:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert text.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="no tokenizer") as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
    assert chat.value.body["param"] == "messages"
    # The server goes on serving.
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(again.choices[0].model_extra["token_ids"]) == 2


# The summary made to fail in the front end, which reads the ready message (a test can reach only that
# process: the engine is spawned). Any error on the way to ready must end the server.
_BROKEN_READY = """
import sys
import morion.server.describe as describe

def broken_summary(*args, **kwargs):
    raise StopIteration

describe.startup_summary = broken_summary  # serve() imports it from there once the engine is spawned
from morion.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_error_on_the_way_to_ready_ends_the_server_with_one_line():
    command = [sys.executable, "-c", _BROKEN_READY, "serve", "--model", MODEL, "--device", "cpu"]
    command += ["--kv-cache-tokens", "256", "--host", "127.0.0.1", "--port", str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["morion: error: start-up failed after the engine loaded: StopIteration"], result.stderr
