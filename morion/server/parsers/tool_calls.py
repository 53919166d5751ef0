"""`--tool-call-parser`: tool calls out of the model's text, streamed piece by piece or whole.

`hermes` / `qwen25`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3).
`qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>…</function></tool_call>` (XML).

A call is announced (its name, in its first `ToolCallDelta`) as soon as the name is read and names one of
the tools; its arguments then follow as the model writes them: Hermes' JSON text as written, Qwen3-Coder's
parameters as JSON members, each once complete. What is streamed of a call depends only on its text so
far, never on how the text was split, so the pieces add up to what the whole text gives. A call whose name
cannot be read, or names no tool, is returned as text, never dropped; a call announced is kept even if
its arguments turn out not to be JSON (as OpenAI's own: clients check them).
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, NamedTuple

from morion.server.parsers.tag_scanner import TagScanner


class ParsedToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


class ToolCallDelta(NamedTuple):
    index: int  # the call's place in this output, from 0
    name: str | None  # set on the call's first delta only
    arguments: str  # the next piece of the arguments' JSON text


class ToolPiece(NamedTuple):
    content: str
    calls: list[ToolCallDelta]


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
        self._calls = 0  # calls announced so far
        self._announced = False  # the open call's name has been sent
        self._sent = 0  # characters of the open call's arguments sent

    @property
    def start_markers(self) -> list[str]:
        return [start for start, _ in self.markers]

    def feed(self, text: str) -> ToolPiece:
        self._scanner.feed(text)
        content: list[str] = []
        calls: list[ToolCallDelta] = []
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
                self._stream(start, calls)
                break
            self._close(start, end, content, calls)
        return ToolPiece("".join(content), calls)

    def finish(self) -> ToolPiece:
        held = self._scanner.take()
        if self._open is None:
            return ToolPiece(held, [])
        self._body.append(held)
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        self._close(self._open[0], None, content, calls)
        return ToolPiece("".join(content), calls)

    def _stream(self, start: str, calls: list[ToolCallDelta]) -> None:
        progress = self.streamed_call(start, "".join(self._body), None, final=False)
        if progress is not None:
            self._send(progress, calls)

    def _send(self, progress: ParsedToolCall, calls: list[ToolCallDelta]) -> None:
        piece = progress.arguments[self._sent :]
        if not self._announced or piece:
            calls.append(ToolCallDelta(self._calls, None if self._announced else progress.name, piece))
        self._announced, self._sent = True, len(progress.arguments)

    def _close(self, start: str, end: str | None, content: list[str], calls: list[ToolCallDelta]) -> None:
        body = "".join(self._body)
        self._open, self._body = None, []
        call = self.streamed_call(start, body, end, final=True)
        if call is None:  # never streamable: read as a whole
            call = self.parse_call(start, body, end)
            if call is None or call.name not in self.parameters:
                content.append(start + body + (end or ""))
                return
        self._send(call, calls)
        self._calls += 1
        self._announced, self._sent = False, 0

    def streamed_call(self, start: str, body: str, end: str | None, final: bool) -> ParsedToolCall | None:
        """The call as far as `body` shows it: its name (a known tool) and the arguments text that can be
        sent already (`final`: all of it, `end` being the end marker or None when the output ended), or
        None while (and if) the call cannot be streamed. Once not None for a body it stays so, and its
        arguments only grow, for every longer body."""
        return None

    def parse_call(self, start: str, body: str, end: str | None) -> ParsedToolCall | None:
        """The call between `start` and `end` (None: the output ended first) read as a whole, for calls
        `streamed_call` cannot stream, or None if unreadable."""
        return None

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        """A call as the model writes it (for chat templates that cannot render `tool_calls`)."""
        raise NotImplementedError


# `{"name": "NAME", "arguments": ` up to the first character of the value (so that whitespace before it
# is never sent, however the text was split).
_HERMES_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_ENVELOPE_TAIL = re.compile(r"\s*\}?\s*\Z")  # may still be the end of the envelope around the arguments


class HermesToolParser(ToolCallParser):
    name = "hermes"
    structural_tag_model = "qwen_3"
    markers = (("<tool_call>", "</tool_call>"),)

    def streamed_call(self, start: str, body: str, end: str | None, final: bool) -> ParsedToolCall | None:
        head = _HERMES_HEAD.match(body)
        if head is None or body[head.end()] == '"':  # arguments written as a JSON string: read whole
            return None
        try:
            name = json.loads(head.group(1))
        except ValueError:  # a bad escape in the name
            return None
        if name not in self.parameters:
            return None
        rest = body[head.end() :]
        if not final:
            return ParsedToolCall(name, rest[: _ENVELOPE_TAIL.search(rest).start()])
        whole = rest.rstrip()
        if not _is_json(whole):  # the usual case: the envelope's closing brace follows the arguments
            whole = rest[: _ENVELOPE_TAIL.search(rest).start()]
        return ParsedToolCall(name, whole)

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


_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
# A parameter known to be complete before the function is: its end tag, or the next parameter, follows.
_COMPLETE_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=))", re.DOTALL)


class Qwen3CoderToolParser(ToolCallParser):
    name = "qwen3_coder"
    structural_tag_model = "qwen_3_coder"
    markers = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def streamed_call(self, start: str, body: str, end: str | None, final: bool) -> ParsedToolCall | None:
        """Arguments as JSON members (`{"P": value, ...`), one per parameter once it is complete; the
        closing brace at the end. Joined, they are `json.dumps` of the arguments."""
        text = body if start == "<tool_call>" else start + body + (end or "")
        head = _FUNCTION_HEAD.match(text)
        if head is None or head.group(1).strip() not in self.parameters:
            return None
        name = head.group(1).strip()
        region = text[head.end() :]
        close = region.find("</function>")
        complete = final or close >= 0
        if close >= 0:
            region = region[:close]
        schema = (self.parameters.get(name) or {}).get("properties", {})
        members = [
            f"{json.dumps(key.strip(), ensure_ascii=False)}: "
            + json.dumps(_typed_value(_strip_one_newline(value), schema.get(key.strip())), ensure_ascii=False)
            for key, value in (_PARAMETER if complete else _COMPLETE_PARAMETER).findall(region)
        ]
        return ParsedToolCall(name, "{" + ", ".join(members) + ("}" if final else ""))

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        parameters = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in (arguments.items() if isinstance(arguments, dict) else ())
        )
        return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


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
