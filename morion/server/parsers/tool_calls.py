"""`--tool-call-parser`: tool calls out of the model's text, streamed or whole.

`hermes` / `qwen25`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3).
`qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>…</function></tool_call>` (XML).
A call the parser cannot read (bad JSON, an unknown function) is returned as text, never dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, NamedTuple

from morion.server.parsers.tag_scanner import TagScanner


class ParsedToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


class ToolPiece(NamedTuple):
    content: str
    calls: list[ParsedToolCall]


class ToolCallParser:
    """Streams text through, cutting out calls between a start and an end marker.

    Text outside calls passes on (minus a held-back possible start marker); a call's text is held until
    its end marker, then parsed. At the end of the output an unterminated call is parsed as it is (a
    model may stop right after the arguments), and returned as text if that fails.
    """

    name: ClassVar[str]
    structural_tag_model: ClassVar[str]  # xgrammar's builtin format of the same syntax (forced calls)
    markers: ClassVar[tuple[tuple[str, str], ...]]  # (start, end) pairs

    def __init__(self, parameters: dict[str, dict[str, Any] | None]) -> None:
        """`parameters`: each tool's name and its parameters' JSON schema."""
        self.parameters = parameters
        self._scanner = TagScanner()
        self._open: tuple[str, str] | None = None  # the start and end marker of the call being read
        self._body: list[str] = []
        self._ends = dict(self.markers)

    @property
    def start_markers(self) -> list[str]:
        return [start for start, _ in self.markers]

    def feed(self, text: str) -> ToolPiece:
        self._scanner.feed(text)
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if self._open is None:
                scan = self._scanner.scan(self.start_markers)
                content.append(scan.text)
                if scan.marker is None:
                    break
                self._open = (scan.marker, self._ends[scan.marker])
                continue
            start, end = self._open
            scan = self._scanner.scan([end])
            self._body.append(scan.text)
            if scan.marker is None:
                break
            self._close(start, end, content, calls)
        return ToolPiece("".join(content), calls)

    def finish(self) -> ToolPiece:
        held = self._scanner.take()
        if self._open is None:
            return ToolPiece(held, [])
        self._body.append(held)
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        self._close(self._open[0], None, content, calls)
        return ToolPiece("".join(content), calls)

    def _close(self, start: str, end: str | None, content: list[str], calls: list[ParsedToolCall]) -> None:
        body = "".join(self._body)
        self._open, self._body = None, []
        call = self.parse_call(start, body, end)
        if call is not None and call.name in self.parameters:
            calls.append(call)
        else:
            content.append(start + body + (end or ""))

    def parse_call(self, start: str, body: str, end: str | None) -> ParsedToolCall | None:
        """The call between `start` and `end` (None: the output ended first), or None if unreadable."""
        raise NotImplementedError

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        """A call as the model writes it (for chat templates that cannot render `tool_calls`)."""
        raise NotImplementedError


class HermesToolParser(ToolCallParser):
    name = "hermes"
    structural_tag_model = "qwen_3"
    markers = (("<tool_call>", "</tool_call>"),)

    def parse_call(self, start: str, body: str, end: str | None) -> ParsedToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"


class Qwen25ToolParser(HermesToolParser):
    name = "qwen25"


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderToolParser(ToolCallParser):
    name = "qwen3_coder"
    structural_tag_model = "qwen_3_coder"
    markers = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def parse_call(self, start: str, body: str, end: str | None) -> ParsedToolCall | None:
        text = body if start == "<tool_call>" else start + body + (end or "")
        function = _FUNCTION.search(text)
        if function is None or text[: function.start()].strip():
            return None
        name = function.group(1).strip()
        schema = (self.parameters.get(name) or {}).get("properties", {})
        arguments = {
            key.strip(): _typed_value(_strip_one_newline(value), schema.get(key.strip()))
            for key, value in _PARAMETER.findall(function.group(2))
        }
        return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        parameters = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in (arguments.items() if isinstance(arguments, dict) else ())
        )
        return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def _strip_one_newline(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _typed_value(text: str, schema: Any) -> Any:
    """XML parameter values are text; the parameter's schema says whether it was a number, object..."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds or kinds == [None]:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesToolParser, Qwen25ToolParser, Qwen3CoderToolParser)
}
