"""The Anthropic Messages API of a real `morion serve`, driven by the `anthropic` client: text, a stream
that adds up to the whole message, tool use with its input streamed, tool results, stop sequences, token
counting, the key as x-api-key, and Anthropic-shaped errors."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _client(server, api_key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.base_url,
        api_key=api_key or server.api_key,
        max_retries=0,
        # trust_env=False: never route loopback traffic through a proxy from the environment.
        http_client=anthropic.DefaultHttpxClient(timeout=60, trust_env=False),
    )


def test_message_and_its_stream_agree(server):
    client = _client(server)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.messages.create(
        model="smollm2", max_tokens=12, messages=question, extra_body={"temperature": 0}
    )
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and 0 < whole.usage.output_tokens <= 12
    with client.messages.stream(
        model="smollm2", max_tokens=12, messages=question, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_then_tool_result(server):
    client = _client(server)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    with client.messages.stream(
        model="smollm2",
        max_tokens=60,
        messages=[question],
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    ) as stream:
        pieces = [event.partial_json for event in stream if event.type == "input_json"]
        message = stream.get_final_message()
    assert len(pieces) > 1  # the input arrives piece by piece
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = client.messages.create(
        model="smollm2",
        max_tokens=8,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            question,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
            },
        ],
    )
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequence_system_prompt_and_token_count(server):
    client = _client(server)
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = client.messages.create(
        model="smollm2", max_tokens=30, messages=messages, extra_body={"temperature": 0}
    )
    stop = free.content[0].text.split(",")[1] + ","
    stopped = client.messages.create(
        model="smollm2",
        max_tokens=30,
        messages=messages,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    counted = client.messages.count_tokens(model="smollm2", messages=messages, system="Be brief.")
    with server.http() as http:
        chat = [{"role": "system", "content": "Be brief."}, *messages]
        expected = http.post("/tokenize", json={"messages": chat}).json()["count"]
    assert counted.input_tokens == expected


def test_errors_have_anthropics_shape(server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        _client(server).messages.create(
            model="smollm2",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, api_key="wrong").messages.create(
            model="smollm2", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.NotFoundError):
        _client(server).messages.create(
            model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
