"""`--tool-call-parser qwen3_coder --reasoning-parser qwen3` end to end: one server of its own for these
flags. The default model never thinks, so reasoning is checked for shape here (and for content in
test_output_parsers.py); the XML tool-call grammar and parser are checked for real."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.server.conftest import RunningServer, start_server, stop

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris in two days?"}]


@pytest.fixture(scope="module")
def flagged_server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf) -> Iterator[RunningServer]:
    directory = tmp_path_factory.mktemp("flagged")
    args = ["--device", "cpu", "--kv-cache-tokens", "4096", "--max-model-len", "1024"]
    args += ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"]
    running = start_server(args, directory / "serve.log")
    yield running
    assert stop(running) == 0, running.log()


def test_xml_tool_call_streamed_and_whole(flagged_server) -> None:
    client = flagged_server.openai()
    request = dict(model="smollm2-135m-instruct", messages=ASK, tools=[WEATHER], tool_choice="required")
    whole = client.chat.completions.create(**request, max_tokens=60, temperature=0).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    call = whole.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(arguments["days"], int)
    assert whole.message.reasoning_content is None  # the field is there (parser on), empty
    streamed = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**request, max_tokens=60, temperature=0, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            streamed["name"] += delta.function.name or ""
            streamed["arguments"] += delta.function.arguments or ""
    assert (streamed["name"], json.loads(streamed["arguments"])) == ("get_weather", arguments)


def test_plain_answer_with_thinking_off(flagged_server) -> None:
    reply = flagged_server.openai().chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.choices[0].message.content


def test_server_info_names_the_chosen_parsers(flagged_server) -> None:
    features = flagged_server.server_info()["features"]
    assert features["tool_call_parser"] == "qwen3_coder" and features["reasoning_parser"] == "qwen3"
