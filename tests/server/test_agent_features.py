"""Tool calls, structured output and their bad inputs, end to end with the official openai client
against the shared `morion serve` (default flags: the Hermes tool parser, chosen from the template)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 30},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["answer", "confidence", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "What is the capital of France?",
    "Name a fruit.",
    "How many legs does a spider have?",
    "Tell me a joke.",
    "What colour is the sky?",
    "Translate 'hello' to Spanish.",
    "Who wrote Hamlet?",
    "Is water wet?",
    "Give me a number between one and ten.",
    "What is 2 + 2?",
]


def test_json_schema_always_validates(server) -> None:
    client = server.openai()
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    for seed, prompt in enumerate(PROMPTS):
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": prompt}],
            response_format=response_format,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_regex(server) -> None:
    client = server.openai()
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, response_format={"type": "json_object"}, max_tokens=80
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, extra_body={"regex": "(sunny|rainy), [0-9]{1,2} C"}, max_tokens=16
    )
    assert reply.choices[0].message.content.startswith(("sunny, ", "rainy, "))


def test_required_yields_a_parseable_call(server) -> None:
    reply = server.openai().chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_streamed_call_deltas_assemble_to_the_same_call(server) -> None:
    client = server.openai()
    request = dict(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    whole = client.chat.completions.create(**request).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        (c["name"], json.loads(c["arguments"])) for c in calls.values()
    ]
    assert whole.message.tool_calls[0].function.name == "get_weather"


def test_tool_history_renders_and_none_never_calls(server) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 21 C"}'},
    ]
    client = server.openai()
    for seed in range(3):
        reply = client.chat.completions.create(
            model="smollm2",
            messages=history,
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=40,
            seed=seed,
            temperature=1.0,
        )
        choice = reply.choices[0]
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    with server.http() as http:
        rendered = http.post(
            "/v1/chat/completions/render", json={"messages": history, "tools": [WEATHER]}
        ).json()
    assert '"forecast": "sunny, 21 C"' in rendered["prompt"] and '"name": "get_weather"' in rendered["prompt"]


BAD = [
    (
        "unknown tool in tool_choice",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    (
        "bad tool name",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "pattern",
    ),
    (
        "bad tool type",
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        "tools[0].type",
        "function",
    ),
    (
        "bad schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            }
        },
        "response_format.json_schema.schema",
        "objectx",
    ),
    ("json_schema missing", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("bad regex", {"regex": "a(b"}, "regex", "parenthesis"),
    (
        "two constraints",
        {"regex": "a", "response_format": {"type": "json_object"}},
        "regex",
        "cannot be combined",
    ),
    (
        "bad tool parameters",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            "tool_choice": "required",
        },
        "tools",
        "Type should be",
    ),
]


@pytest.mark.parametrize("body, param, words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_a_400_naming_the_problem(server, body, param, words) -> None:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert error["type"] == "invalid_request_error"
        assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200


def test_openai_client_raises_bad_request(server) -> None:
    with pytest.raises(openai.BadRequestError, match="nope"):
        server.openai().chat.completions.create(
            model="smollm2",
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
