"""A bounded fuzz of the API on a real server (hypothesis): every field of /v1/chat/completions and
/v1/completions, each either valid or wild (a wrong type, an extreme, a huge value, NaN or Infinity), with
content parts, tools, schemas and regexes among the valid ones. Every answer must come within a deadline
and be a success or an OpenAI-style 4xx (a stream must not end in an internal error); afterwards the
server's memory has not grown past a bound and a greedy canary answers exactly as before.

Each body is valid but for at most two fields set to wild values, so that most requests get past the
first check and reach templates, tokenizer, grammars and the engine. Generation stays short: a valid
max_tokens is at most 3 (chat always sends one: without it a chat request may fill the context).
"""

from __future__ import annotations

import contextlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

REQUEST_DEADLINE_S = 60  # a request slower than this is a hang
MEMORY_GROWTH_BOUND = 256 * 2**20  # the server's processes together, across the whole fuzz (5 MiB seen)
CANARY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 12,
    "temperature": 0,
}

_HUGE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63), -(2**64)])
_ODD_FLOATS = st.sampled_from([1e-300, 5e-324, -0.0, 1e300, 1e308, float("inf"), float("-inf"), float("nan")])
WILD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    _HUGE_INTS,
    st.floats(),  # NaN and Infinity too: json.dumps writes them as the non-standard tokens
    _ODD_FLOATS,
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_LONG_BUDGET = range(4, 2**40)  # valid max_tokens that would make a long generation: never sent

_TEXT = st.text(max_size=40)
_HUGE_TEXT = st.just("word " * 3000)  # past the shared server's 2048-token context
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "http://x/y.png"})}),
    st.dictionaries(st.sampled_from(["type", "text", "x"]), WILD, max_size=3),
)
_CONTENT = st.one_of(_TEXT, _TEXT, _HUGE_TEXT, st.lists(_PART, max_size=3), st.none())
_TOOL_CALL = st.fixed_dictionaries(
    {
        "id": st.text(max_size=8),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": _TEXT, "arguments": st.one_of(_TEXT, st.just('{"a": 1}'))}
        ),
    }
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={
        "content": _CONTENT,
        "name": _TEXT,
        "tool_calls": st.lists(_TOOL_CALL, max_size=2),
        "tool_call_id": _TEXT,
    },
)
_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5))
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_NAME = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
_SCHEMA_TYPE = st.sampled_from(["string", "integer", "number", "boolean", "null", "objectx"])
_SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": _SCHEMA_TYPE}, optional={"maxLength": st.integers(-1, 5)}),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(_NAME, inner, max_size=3)},
            optional={"required": st.lists(st.text(max_size=4), max_size=2)},
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner}, optional={"maxItems": st.integers(-1, 4)}
        ),
        st.fixed_dictionaries({"enum": st.lists(_JSON_LEAF, min_size=1, max_size=4)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)}),
    ),
    max_leaves=6,
)
_RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": st.text(max_size=6), "schema": st.one_of(_SCHEMA, _SCHEMA, _JSON)},
                optional={"strict": st.booleans()},
            ),
        }
    ),
)
_REGEX = st.one_of(
    st.text(alphabet="ab09()[]{}|*+?.^$\\-,", min_size=0, max_size=12),
    st.sampled_from([r"[0-9]{1,3}", r"(yes|no)", r"a{2,}", r"\d+\.\d", r"[", r"(?P<x>a)"]),
)
_EBNF = st.one_of(
    st.sampled_from(['root ::= "yes" | "no"', "root ::= [0-9]+", "root ::=", 'root ::= "a" root', "x"]),
    st.text(alphabet='root:=|"ab[]09+*() ', max_size=16),
)
_STRUCTURED_OUTPUTS = st.fixed_dictionaries(
    {},
    optional={
        "json": st.one_of(_SCHEMA, _JSON),
        "regex": _REGEX,
        "choice": st.lists(_TEXT, max_size=3),
        "grammar": _EBNF,
        "json_object": st.booleans(),
    },
)
_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": _NAME},
            optional={"description": _TEXT, "parameters": st.one_of(_SCHEMA, _JSON), "strict": st.booleans()},
        ),
    }
)
_TOOL_CHOICE = st.one_of(
    st.sampled_from(["auto", "none", "required", "any"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})}
    ),
)
_TOKEN_ID = st.one_of(st.integers(0, 49151), st.integers(0, 49151), st.integers(0, 49151), _HUGE_INTS)
_TOKEN_IDS = st.lists(_TOKEN_ID, min_size=1, max_size=6)
SAMPLING = {
    "model": st.sampled_from(["smollm2", "smollm2", "gpt-4o"]),
    "n": st.integers(1, 4),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-300, 2])),
    "top_p": st.floats(0, 1),
    "top_k": st.one_of(st.integers(-1, 100), st.just(2**31 - 1)),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.one_of(st.floats(0, 3), st.just(1e300)),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=17)),
    "stop_token_ids": st.lists(st.integers(0, 50000), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(
        st.one_of(st.text(max_size=3), st.integers(0, 60000).map(str), st.just("²")),
        st.one_of(st.integers(-100, 100), st.floats(-100, 100)),
        max_size=2,
    ),
    "echo": st.booleans(),
    "return_token_ids": st.booleans(),
    "prompt_logprobs": st.integers(0, 25),
    "regex": _REGEX,
    "ebnf": _EBNF,
    "structured_outputs": _STRUCTURED_OUTPUTS,
    "guided_json": st.one_of(_SCHEMA, _JSON, _TEXT),
    "guided_regex": _REGEX,
    "guided_choice": st.lists(_TEXT, max_size=3),
    "guided_grammar": _EBNF,
    "user": _TEXT,
}
CHAT_REQUIRED = {"messages": st.lists(_MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)}
CHAT_OPTIONAL = {
    **SAMPLING,
    "max_completion_tokens": st.integers(1, 3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 25),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=6), _JSON, max_size=2),
    "add_generation_prompt": st.booleans(),
    "tools": st.lists(_TOOL, max_size=3),
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": st.booleans(),
    "response_format": _RESPONSE_FORMAT,
    "continue_final_message": st.booleans(),
    "functions": st.lists(_JSON, max_size=1),
}
COMPLETION_REQUIRED = {
    "max_tokens": st.integers(1, 3),  # without it, 16 tokens per choice
    "prompt": st.one_of(
        _TEXT.filter(bool),
        _HUGE_TEXT,
        st.lists(_TEXT.filter(bool), min_size=1, max_size=5),
        _TOKEN_IDS,
        st.lists(_TOKEN_IDS, min_size=1, max_size=3),
    ),
}
COMPLETION_OPTIONAL = {
    **SAMPLING,
    "logprobs": st.integers(0, 25),
    "suffix": _TEXT,
    "best_of": st.integers(0, 4),
}


@st.composite
def bodies(draw, required: dict, optional: dict) -> dict:
    """A body of valid fields (the required ones and a few optional ones), then up to two fields, of
    all, set to wild values: most bodies have one thing wrong, or none."""
    body = {name: draw(strategy) for name, strategy in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=8)):
        body[name] = draw(optional[name])
    for name in draw(st.lists(st.sampled_from(sorted({*required, *optional})), unique=True, max_size=2)):
        value = draw(WILD)
        if name in ("max_tokens", "max_completion_tokens") and type(value) is int and value in _LONG_BUDGET:
            value = 3  # valid but long: the fuzz must stay short
        body[name] = value
    return body


CHAT_BODIES = bodies(CHAT_REQUIRED, CHAT_OPTIONAL)
COMPLETION_BODIES = bodies(COMPLETION_REQUIRED, COMPLETION_OPTIONAL)
FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _send(http: httpx.Client, path: str, body: Any) -> None:
    """Sends one body and checks the answer: a success, or an OpenAI-style 4xx; a stream must not end
    in an error of the server's own."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with http.stream("POST", path, content=content, headers=headers) as response:
        text = response.read().decode(errors="replace")
    status = response.status_code
    assert status < 500, f"{status} for {content[:300]!r}: {text[:500]}"
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, text
        assert error["type"] != "internal_server_error", text
        return
    assert status == 200, text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events, text
        for event in events:
            if event != "[DONE]":
                assert "internal_server_error" not in event, f"{content[:300]!r}: {event}"
    else:
        assert "choices" in json.loads(text), text


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):  # a child that ended (a grammar compiler replaced)
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096
    return total


def _canary(http: httpx.Client) -> str:
    response = http.post("/v1/chat/completions", json=CANARY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def fuzz_http(server):
    """A client of the server once it is warm (its grammar compiler started), with the canary's answer
    and the memory of the server's processes then."""
    with server.http(timeout=REQUEST_DEADLINE_S) as http:
        _send(http, "/v1/chat/completions", CANARY | {"response_format": {"type": "json_object"}})
        yield http, _canary(http), _rss_bytes([server.process.pid, *server.child_pids()])


# Every field at every one of these, on an otherwise valid sampled request: the sweep that random
# combinations may miss (top_k = 2**63 with a temperature used to fail every request in the engine).
EXTREMES = [None, True, -1, 2**63, 2**64, 1e-300, math.nan, "x", [1]]
SWEEP_CLIENTS = 4
SWEPT = {
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 1.0, "seed": 1},
        sorted({*CHAT_REQUIRED, *CHAT_OPTIONAL} - {"user"}),  # user: any JSON, never read
    ),
    "/v1/completions": (
        {"prompt": "Hi", "max_tokens": 1, "temperature": 1.0, "seed": 1},
        sorted({*COMPLETION_REQUIRED, *COMPLETION_OPTIONAL} - set(SAMPLING)),  # sampling: swept above
    ),
}


@pytest.mark.parametrize("path", sorted(SWEPT))
def test_every_field_at_every_extreme(fuzz_http, path):
    base, fields = SWEPT[path]
    bodies = [base | {name: value} for name in fields for value in EXTREMES]
    # A few at a time, as clients send them: the engine batches them, and errors under load show too.
    with ThreadPoolExecutor(SWEEP_CLIENTS) as pool:
        list(pool.map(lambda body: _send(fuzz_http[0], path, body), bodies))


@given(body=CHAT_BODIES)
@settings(FUZZ_SETTINGS, max_examples=30)
def test_chat_completions_fuzz(fuzz_http, body):
    _send(fuzz_http[0], "/v1/chat/completions", body)


@given(body=COMPLETION_BODIES)
@settings(FUZZ_SETTINGS, max_examples=25)
def test_completions_fuzz(fuzz_http, body):
    _send(fuzz_http[0], "/v1/completions", body)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100000 + b"]" * 100000,  # nesting past any parser's depth
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": NaN}',
        b'{"prompt": "hi", "max_tokens": 2, "presence_penalty": -Infinity}',
        b'{"prompt": "\\ud800", "max_tokens": 2}',  # a lone surrogate
        b"\xff\xfe{}",
        b"",
    ],
)
def test_raw_bodies(fuzz_http, raw):
    path = "/v1/completions" if b"prompt" in raw else "/v1/chat/completions"
    _send(fuzz_http[0], path, raw)


def test_after_the_fuzz_memory_is_bounded_and_the_canary_unchanged(fuzz_http, server):
    http, canary, memory_before = fuzz_http
    assert _canary(http) == canary, "the canary's greedy answer changed"
    # Every process of the server now (a grammar compiler replaced during the fuzz counts in full).
    growth = _rss_bytes([server.process.pid, *server.child_pids()]) - memory_before
    assert growth <= MEMORY_GROWTH_BOUND, f"the server grew by {growth / 2**20:.0f} MiB"
