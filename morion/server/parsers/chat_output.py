"""One choice's output, split into reasoning, content and tool calls, streamed or whole.

A whole response is the same parser fed the whole text at once, so the streamed pieces always add up
to the non-streamed message.
"""

from __future__ import annotations

from typing import NamedTuple

from morion.server.parsers.reasoning import Qwen3ReasoningParser, ReasoningPiece
from morion.server.parsers.tool_calls import ToolCallDelta, ToolCallParser


class ParsedDelta(NamedTuple):
    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]  # pieces of calls: a call's first names it (tool_calls.py)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Reasoning first (its content goes on to the tool parser), then tool calls.

    With tools, trailing whitespace of the content is held back until real text follows; at the end it
    is dropped if the model called a tool (the newlines around calls are not part of an answer).
    """

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._pending_space = ""
        self.called_tools = False

    def feed(self, text: str) -> ParsedDelta:
        piece = self._reasoning.feed(text) if self._reasoning else ReasoningPiece("", text)
        return self._after_reasoning(piece, final=False)

    def finish(self) -> ParsedDelta:
        piece = self._reasoning.finish() if self._reasoning else ReasoningPiece("", "")
        return self._after_reasoning(piece, final=True)

    def _after_reasoning(self, piece: ReasoningPiece, final: bool) -> ParsedDelta:
        if self._tools is None:
            return ParsedDelta(piece.reasoning, piece.content, [])
        first = self._tools.feed(piece.content)
        content, calls = first.content, list(first.calls)
        if final:
            last = self._tools.finish()
            content += last.content
            calls += last.calls
        self.called_tools = self.called_tools or bool(calls)
        # Trailing whitespace waits for what follows: text (then it is sent) or the end (then it is
        # dropped after a tool call), whichever way the output was split.
        content = self._pending_space + content
        kept = content.rstrip()
        self._pending_space = content[len(kept) :]
        if final and not self.called_tools:
            kept, self._pending_space = kept + self._pending_space, ""
        return ParsedDelta(piece.reasoning, kept, calls)
