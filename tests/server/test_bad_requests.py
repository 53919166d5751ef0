"""Bad input: each case is a 4xx with an OpenAI-style error naming the problem, and the server then still
answers a normal request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import MAX_REQUEST_BYTES

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]
TOO_LONG = "word " * 2100  # the shared server's context is 2048 tokens


def _chat(**fields) -> dict:
    return {"model": "smollm2", "messages": HELLO, "max_tokens": 2} | fields


# (case, path, body: a dict sent as JSON or raw bytes, status, param, code, words the message must hold)
CASES = [
    ("invalid JSON", CHAT, b'{"messages": [', 400, None, "invalid_json", "not valid JSON"),
    ("not an object", CHAT, b"[1, 2]", 400, None, "invalid_json", "JSON object"),
    ("unknown model", CHAT, _chat(model="gpt-17"), 404, "model", "model_not_found", "gpt-17"),
    ("max_tokens 0", CHAT, _chat(max_tokens=0), 400, "max_tokens", None, "greater than or equal to 1"),
    ("max_tokens negative", COMPLETIONS, {"prompt": "Hi", "max_tokens": -3}, 400, "max_tokens", None, "-3"),
    (
        "max_tokens above context",
        CHAT,
        _chat(max_tokens=100000),
        400,
        "max_tokens",
        "context_length_exceeded",
        "2048",
    ),
    (
        "max_completion_tokens above context",
        CHAT,
        _chat(max_completion_tokens=5000),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
        "at most",
    ),
    (
        "prompt longer than context",
        COMPLETIONS,
        {"prompt": TOO_LONG},
        400,
        "prompt",
        "context_length_exceeded",
        "tokens",
    ),
    (
        "messages longer than context",
        CHAT,
        _chat(messages=[{"role": "user", "content": TOO_LONG}]),
        400,
        "messages",
        "context_length_exceeded",
        "2048",
    ),
    ("temperature a string", CHAT, _chat(temperature="hot"), 400, "temperature", None, "valid number"),
    ("max_tokens a string", CHAT, _chat(max_tokens="10"), 400, "max_tokens", None, "valid integer"),
    ("messages a string", CHAT, _chat(messages="Hello"), 400, "messages", None, "valid array"),
    ("stream a number", CHAT, _chat(stream=1), 400, "stream", None, "boolean"),
    ("stream_options a number", CHAT, _chat(stream_options=5), 400, "stream_options", None, "object"),
    ("prompt a number", COMPLETIONS, {"prompt": 42}, 400, "prompt", None, "list of token ids"),
    ("n too large", CHAT, _chat(n=17), 400, "n", None, "16"),
    ("n zero", COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n", None, "greater than or equal to 1"),
    (
        "unknown role",
        CHAT,
        _chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages[0].role",
        None,
        "wizard",
    ),
    ("missing messages", CHAT, {"model": "smollm2"}, 400, "messages", None, "required"),
    ("empty messages", CHAT, _chat(messages=[]), 400, "messages", None, "at least 1"),
    (
        "image part without its image_url",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        400,
        "messages[0].content",
        None,
        "[0].image_url",
    ),
    (
        "unsupported content part",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
        400,
        "messages[0].content",
        None,
        "image_url",
    ),
    (
        "image for a model without a vision tower",
        CHAT,
        _chat(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        ),
        400,
        "messages[0].content[0].image_url",
        None,
        "takes no images",
    ),
    ("token id outside vocab", COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400, "prompt", None, "vocabulary"),
    ("top_p zero", CHAT, _chat(top_p=0), 400, "top_p", None, "greater than 0"),
    # top_k >= 2**63 used to overflow inside the engine and fail every request in flight.
    ("top_k past int32", CHAT, _chat(top_k=2**63), 400, "top_k", None, "less than or equal to 2147483647"),
    (
        "Infinity",
        CHAT,
        json.dumps(_chat(repetition_penalty=float("inf"))).encode(),  # json writes the token Infinity
        400,
        "repetition_penalty",
        None,
        "finite number",
    ),
    (
        "stop token outside vocab",
        COMPLETIONS,
        {"prompt": "Hi", "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
        None,
        "vocabulary",
    ),
    ("n x prompts", COMPLETIONS, {"prompt": ["a"] * 5, "n": 16}, 400, "prompt", None, "n x prompts"),
    ("negative seed", CHAT, _chat(seed=-1), 400, "seed", None, "greater than or equal to 0"),
    ("empty stop string", CHAT, _chat(stop=[""]), 400, "stop", None, "non-empty"),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", None, "logprobs"),
    (
        "legacy functions",
        CHAT,
        _chat(functions=[{"name": "f"}]),
        400,
        "functions",
        None,
        "not supported",
    ),
    (
        "reserved template kwarg",
        CHAT,
        _chat(chat_template_kwargs={"messages": []}),
        400,
        "chat_template_kwargs",
        None,
        "messages",
    ),
    ("detokenize outside vocab", "/detokenize", {"tokens": [10**7]}, 400, "tokens", None, "vocabulary"),
    (
        "tokenize both forms",
        "/tokenize",
        {"prompt": "a", "messages": HELLO},
        400,
        "prompt",
        None,
        "exactly one",
    ),
    (
        "oversized body",
        COMPLETIONS,
        {"prompt": "x" * (MAX_REQUEST_BYTES + 1000)},
        413,
        None,
        "request_too_large",
        "--max-request-bytes",
    ),
]


def _assert_error(response, status: int, param: str | None, code: str | None, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["code"] == code
    assert words in error["message"], error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def _still_serves(server) -> None:
    with server.http() as http:
        response = http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "param", "code", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_is_an_openai_error(server, case, path, body, status, param, code, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.http() as http:
        response = http.post(path, content=content, headers={"content-type": "application/json"})
    _assert_error(response, status, param, code, words)
    _still_serves(server)


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic test-key", "Bearer"])
def test_missing_or_incorrect_api_key(server, header):
    headers = {} if header is None else {"authorization": header}
    with server.http(authenticated=False) as http:
        for method, path in (
            ("POST", CHAT),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("GET", "/v1/server_info"),
        ):
            response = http.request(method, path, headers=headers, json=_chat())
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200  # the one open endpoint
    _still_serves(server)


def test_unknown_path_is_an_openai_404(server):
    with server.http() as http:
        response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_the_openai_client_sees_the_error(server):
    with pytest.raises(openai.BadRequestError) as raised:
        server.openai().chat.completions.create(model="smollm2", messages=HELLO, n=17)
    assert raised.value.body["param"] == "n"
    wrong_key = openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="wrong",
        max_retries=0,
        http_client=httpx.Client(trust_env=False),
    )
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    _still_serves(server)
