"""`cache_salt` (vLLM's extension) through a real `morion serve`, driven by the official `openai` client: a
salted request shares cached prefixes only with requests of the same salt, on every endpoint that takes
prompts; a bad salt is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import anthropic
import pytest

pytestmark = pytest.mark.slow

# Each test's own text (the shared server's prefix cache outlives a test): several pages of 16 tokens.
STORY = (
    "A lighthouse keeper counted the ships that passed his rock: a tanker at dawn, two trawlers before "
    "noon, a ferry in the afternoon and a yacht at dusk. He wrote each one in a blue notebook. "
)


def _complete(client, prompt: str, salt: str | None) -> tuple[str, int]:
    extra = {} if salt is None else {"cache_salt": salt}
    reply = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
    )
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].text, details.cached_tokens if details else 0


def test_a_salt_shares_cached_prefixes_only_with_its_own(server):
    prompt = STORY + "How many ships did he count?"
    with server.openai() as client:
        cold, _ = _complete(client, prompt, None)
        unsalted, unsalted_cached = _complete(client, prompt, None)
        salted, salted_cached = _complete(client, prompt, "tenant-a")
        again, again_cached = _complete(client, prompt, "tenant-a")
        other, other_cached = _complete(client, prompt, "tenant-b")
    assert unsalted_cached > 0  # the prompt is cached, for unsalted requests
    assert salted_cached == 0 and other_cached == 0
    assert again_cached == unsalted_cached
    assert cold == unsalted == salted == again == other  # greedy: the salt changes no answer


def test_chat_completions_take_a_salt(server):
    messages = [{"role": "user", "content": STORY + "What did he write them in?"}]

    def ask(salt: str) -> int:
        with server.openai() as client:
            reply = client.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=4,
                temperature=0,
                extra_body={"cache_salt": salt},
            )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert ask("chat-salt") == 0
    assert ask("chat-salt") > 0
    assert ask("another-chat-salt") == 0


def test_responses_and_messages_take_a_salt(server):
    with server.openai() as client:
        first, second = (
            client.responses.create(
                model="smollm2",
                input=STORY + "Which ship came last?",
                max_output_tokens=4,
                extra_body={"cache_salt": "responses-salt"},
            ).usage.input_tokens_details.cached_tokens
            for _ in range(2)
        )
    assert first == 0 and second > 0
    messages = anthropic.Anthropic(
        base_url=server.base_url,
        api_key=server.api_key,
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(timeout=60, trust_env=False),
    ).messages
    question = [{"role": "user", "content": STORY + "Which ship came first?"}]
    first, second = (
        messages.create(
            model="smollm2", max_tokens=4, messages=question, extra_body={"cache_salt": "messages-salt"}
        ).usage.cache_read_input_tokens
        for _ in range(2)
    )
    assert first == 0 and second > 0


BAD_SALTS = [("empty", ""), ("a number", 7), ("a list", ["a"]), ("257 characters", "s" * 257)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("salt", [salt for _, salt in BAD_SALTS], ids=[name for name, _ in BAD_SALTS])
def test_a_bad_salt_is_a_400_naming_the_field(server, path, salt):
    bodies = {
        "/v1/completions": {"prompt": "Hello"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}]},
        "/v1/responses": {"input": "Hello"},
        "/v1/messages": {"messages": [{"role": "user", "content": "Hello"}]},
    }
    body = {"model": "smollm2", "max_tokens": 1, **bodies[path], "cache_salt": salt}
    with server.http() as http:
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "cache_salt" in error["message"]
        if path != "/v1/messages":  # Anthropic's error shape has no param
            assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
        still = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "cache_salt": "ok"})
    assert still.status_code == 200, still.text
