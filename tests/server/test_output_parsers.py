"""Reasoning and tool-call parsers: recorded outputs, fed whole and split at every position (and token by
token), give the same reasoning, content and calls; a call's arguments stream before the call ends."""

from __future__ import annotations

import json

import pytest

from morion.server.parsers.chat_output import ChatOutputParser, ParsedDelta
from morion.server.parsers.reasoning import Qwen3ReasoningParser
from morion.server.parsers.tool_calls import TOOL_CALL_PARSERS, ToolCallDelta
from morion.server.responses import assembled_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = {"get_weather": WEATHER, "noop": None}


def _parser(tool_parser: str | None, reasoning: bool, in_reasoning: bool = False) -> ChatOutputParser:
    tools = TOOL_CALL_PARSERS[tool_parser](TOOLS) if tool_parser else None
    starts = tools.start_markers if tools else ()
    think = Qwen3ReasoningParser(in_reasoning, starts) if reasoning else None
    return ChatOutputParser(think, tools)


def _run(parser: ChatOutputParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return _merge(deltas)


def _merge(deltas: list[ParsedDelta]) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    pieces = [piece for delta in deltas for piece in delta.tool_calls]
    calls = [(call.name, _value(call.arguments)) for call in assembled_calls(pieces)]
    return reasoning, content, calls


def _value(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the model's own text, compared as it is


def _splits(text: str) -> list[list[str]]:
    """The text whole, split once at every position, and one character at a time."""
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


# (name, tool parser, reasoning parser on, prompt opened <think>, output, reasoning, content, calls)
CASES = [
    (
        "think then answer",
        None,
        True,
        False,
        "<think>\nThe user greets.\n</think>\n\nHello there!",
        "\nThe user greets.\n",
        "Hello there!",
        [],
    ),
    ("no think block", None, True, False, "Just an <answer>.", "", "Just an <answer>.", []),
    ("opened by the prompt", None, True, True, "still thinking</think>Done", "still thinking", "Done", []),
    ("unclosed think", None, True, False, "<think>hmm <thi", "hmm <thi", "", []),
    (
        "hermes call after think",
        "hermes",
        True,
        False,
        '<think>need weather</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>",
        "need weather",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes call inside unclosed think",
        "hermes",
        True,
        False,
        '<think>I will call it <tool_call>{"name": "noop", "arguments": {}}</tool_call>',
        "I will call it ",
        "",
        [("noop", {})],
    ),
    (
        "hermes text and two calls",
        "qwen25",
        False,
        False,
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
        "\n</tool_call>\n"
        '<tool_call>\n{"name": "noop", "arguments": "{}"}\n</tool_call>\n',
        "",
        "Sure.",
        [("get_weather", {"city": "Oslo", "days": 2}), ("noop", {})],
    ),
    (
        "hermes call of a known tool keeps arguments that are not JSON",
        "hermes",
        False,
        False,
        'A <tool_call>{"name": "get_weather", "arguments": {city}}</tool_call> B',
        "",
        "A  B",
        [("get_weather", "{city}")],
    ),
    (
        "hermes envelope that is not JSON is text",
        "hermes",
        False,
        False,
        "A <tool_call>{name: get_weather}</tool_call> B",
        "",
        "A <tool_call>{name: get_weather}</tool_call> B",
        [],
    ),
    (
        "hermes arguments before the name",
        "hermes",
        False,
        False,
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',
        "",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "hermes unknown function is text",
        "hermes",
        False,
        False,
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        "",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes unterminated but complete",
        "hermes",
        False,
        False,
        '<tool_call>\n{"name": "noop", "arguments": {}}\n',
        "",
        "",
        [("noop", {})],
    ),
    (
        "hermes unterminated and cut",
        "hermes",
        False,
        False,
        '<tool_call>\n{"name": "noop", "argu',
        "",
        '<tool_call>\n{"name": "noop", "argu',
        [],
    ),
    (
        "qwen3_coder xml call after think",
        "qwen3_coder",
        True,
        False,
        "<think>call</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "call",
        "",
        [("get_weather", {"city": "New York", "days": 3})],
    ),
    (
        "qwen3_coder bare function",
        "qwen3_coder",
        False,
        False,
        "Ok <function=noop>\n</function> done",
        "",
        "Ok  done",
        [("noop", {})],
    ),
    (
        "qwen3_coder garbage is text",
        "qwen3_coder",
        False,
        False,
        "<tool_call>not xml</tool_call>",
        "",
        "<tool_call>not xml</tool_call>",
        [],
    ),
]


@pytest.mark.parametrize(
    "tool_parser, reasoning, in_reasoning, output, want_reasoning, want_content, want_calls",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_every_split_gives_the_same_result(
    tool_parser, reasoning, in_reasoning, output, want_reasoning, want_content, want_calls
) -> None:
    want = (want_reasoning, want_content, want_calls)
    for pieces in _splits(output):
        got = _run(_parser(tool_parser, reasoning, in_reasoning), pieces)
        assert got == want, pieces


def test_held_back_tag_prefix_is_not_emitted_early() -> None:
    parser = _parser("hermes", reasoning=True)
    assert parser.feed("<thi") == ParsedDelta("", "", [])
    assert parser.feed("nk>abc</th").reasoning == "abc"  # "</th" may be the end tag: held
    delta = parser.feed("ink>Answer <tool_")
    assert (delta.reasoning, delta.content) == ("", "Answer")  # " <tool_" may start a call: held
    assert parser.feed("box").content == " <tool_box"


def test_whole_token_pieces_from_a_recorded_stream() -> None:
    # Token texts as the engine streamed them for a Qwen3-style answer (tags split across tokens).
    tokens = ["<", "think", ">\n", "Plan", ".\n", "</", "think", ">\n\n", "<tool", "_call", ">\n", '{"name"',
              ': "get_weather", "arguments": {"city": "Rome"}}', "\n</", "tool_call", ">"]  # fmt: skip
    got = _run(_parser("hermes", reasoning=True), tokens)
    assert got == ("\nPlan.\n", "", [("get_weather", {"city": "Rome"})])


def test_hermes_arguments_stream_as_written_before_the_call_ends() -> None:
    parser = _parser("hermes", reasoning=False)
    assert parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa').tool_calls == [
        ToolCallDelta(0, "get_weather", '{"city": "Pa')
    ]
    assert parser.feed('ris"}').tool_calls == [ToolCallDelta(0, None, 'ris"')]  # "}" may close the envelope
    assert parser.feed(', "days": 2}').tool_calls == [ToolCallDelta(0, None, '}, "days": 2')]
    assert parser.feed("}\n</tool_call>").tool_calls == [ToolCallDelta(0, None, "}")]
    second = parser.feed('<tool_call>{"name": "noop", "arguments": {}}</tool_call>').tool_calls
    assert second == [ToolCallDelta(1, "noop", "{}")]


def test_qwen3_coder_arguments_stream_parameter_by_parameter() -> None:
    parser = _parser("qwen3_coder", reasoning=False)
    head = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert head.tool_calls == [ToolCallDelta(0, "get_weather", "{")]
    assert parser.feed("is\n</parameter>\n<parameter=days>\n2").tool_calls == [
        ToolCallDelta(0, None, '"city": "Paris"')
    ]
    assert parser.feed("\n</parameter>\n</function>\n</tool_call>").tool_calls == [
        ToolCallDelta(0, None, ', "days": 2}')
    ]
