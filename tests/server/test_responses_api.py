"""The Responses API of a real `morion serve`, driven by the official `openai` client (`client.responses`):
text, streamed events that add up to the whole response, function calls with their arguments streamed,
structured text, stored responses continued with `previous_response_id`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_text_response_and_its_stream_agree(server):
    client = server.openai()
    whole = client.responses.create(
        model="smollm2", input="What is the capital of France?", max_output_tokens=12, temperature=0
    )
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output[0].type == "message" and whole.output_text
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = list(
        client.responses.create(
            model="smollm2",
            input="What is the capital of France?",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == deltas


def test_function_call_item_with_streamed_arguments(server):
    client = server.openai()
    events = list(
        client.responses.create(
            model="smollm2",
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(pieces)
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The tool's result goes back as a function_call_output item, with the call that asked for it.
    follow_up = client.responses.create(
        model="smollm2",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert follow_up.output[0].type == "message" and follow_up.output_text


def test_json_schema_text_format(server):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    response = server.openai().responses.create(
        model="smollm2",
        input="What is 2 + 2? Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "sum", "schema": schema}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_stored_responses_continue_and_can_be_retrieved(server):
    client = server.openai()
    first = client.responses.create(
        model="smollm2", input="My name is Ada.", max_output_tokens=6, temperature=0
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model="smollm2",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    alone = client.responses.create(
        model="smollm2", input="What is my name?", max_output_tokens=6, temperature=0
    )
    # The continuation's prompt holds the first turn and its answer.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="smollm2", input="x", previous_response_id="resp_nope", max_output_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"background": True}, "background"),
    ],
)
def test_what_does_not_translate_is_a_400(server, fields, param):
    body = {"model": "smollm2", "input": "hi", "max_output_tokens": 2} | fields
    with server.http() as http:
        response = http.post("/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
