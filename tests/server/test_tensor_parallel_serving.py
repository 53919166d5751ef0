"""`morion serve --tp 2` (issue #28): the engine process is rank 0 and starts rank 1; driven by the official
`openai` client, it answers as one rank does, and a SIGTERM leaves no rank process behind."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from morion.engine.sampling_params import SamplingParams
from morion.llm import LLM
from tests.server.conftest import RunningServer, start_server, stop

MAX_TOKENS = 10
TOKEN_PROMPT = [5, 17, 42, 9, 100, 77, 1, 2, 64, 65, 66]
MESSAGES = [{"role": "user", "content": "Two ranks, one answer?"}]
POOL = ["--kv-cache-tokens", "1024", "--load-format", "dummy", "--device", "cpu"]
IGNORE_EOS = {"ignore_eos": True}
TAG = "MORION_TP_SERVING_TEST"
EXIT_S = 15.0


@pytest.fixture(scope="module")
def tag() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, tiny_qwen3_next_chat_dir, tag) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("tp_server") / "serve.log"
    args = ["--model", str(tiny_qwen3_next_chat_dir), *POOL, "--tp", "2"]
    running = start_server(args, log_path, env={TAG: tag})
    yield running
    stop(running)


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3_next_chat_dir) -> LLM:
    return LLM(str(tiny_qwen3_next_chat_dir), load_format="dummy", device="cpu", kv_cache_tokens=1024)


def test_two_ranks_answer_the_openai_client_as_one_rank(tp_server, one_rank, tiny_qwen3_next_chat_dir):
    client, model = tp_server.openai(), str(tiny_qwen3_next_chat_dir)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [expected] = one_rank.generate(TOKEN_PROMPT, greedy)
    completion = client.completions.create(
        model=model, prompt=TOKEN_PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=IGNORE_EOS
    )
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids) == MAX_TOKENS
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    [expected_chat] = one_rank.generate(
        one_rank.encode_chat(MESSAGES), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    assert chat.choices[0].message.content == expected_chat.text
    assert chat.usage.completion_tokens == len(expected_chat.token_ids)


def test_a_sigterm_stops_every_rank(tp_server, tag):
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _tagged_processes(tag)]
    assert sum(b"morion.engine.rank_follower" in command for command in commands) == 1  # rank 1
    assert stop(tp_server) == 0, tp_server.log()
    # The front end has exited; what it started ends with it (multiprocessing's resource tracker, and a
    # rank that sees its engine process gone, a moment after).
    deadline = time.monotonic() + EXIT_S
    while (left := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]


def _tagged_processes(tag: str) -> list[int]:
    """The live processes whose environment carries this module's tag (every process the server started)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{TAG}={tag}".encode() in environ.read_bytes().split(b"\0"):
                state = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                found += [int(environ.parent.name)] if state != "Z" else []
        except OSError:
            continue
    return found
