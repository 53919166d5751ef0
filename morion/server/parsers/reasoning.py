"""`--reasoning-parser qwen3`: `<think>…</think>` at the start of the output becomes `reasoning_content`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from morion.server.parsers.tag_scanner import TagScanner

THINK_START = "<think>"
THINK_END = "</think>"

_OPENING, _REASONING, _AFTER_REASONING, _CONTENT = range(4)


class ReasoningPiece(NamedTuple):
    reasoning: str
    content: str


def prompt_opens_reasoning(prompt: str) -> bool:
    """Templates of thinking-only models (Qwen3 *-Thinking) end the prompt with `<think>`: the output
    then starts inside the reasoning, with no opening tag of its own."""
    return prompt.rstrip().endswith(THINK_START)


class Qwen3ReasoningParser:
    """Splits a streamed output into reasoning and content.

    The output is reasoning if it starts (after whitespace) with `<think>`, or if the prompt already
    opened it; the reasoning ends at `</think>`, or at the start of a tool call (Qwen3 models sometimes
    call a tool without closing their thoughts, and such a call must not be lost inside the reasoning).
    Whitespace right after `</think>` is dropped. Output that does not start with `<think>` is content.
    """

    def __init__(self, in_reasoning: bool = False, tool_call_starts: Sequence[str] = ()) -> None:
        self._scanner = TagScanner()
        self._state = _REASONING if in_reasoning else _OPENING
        self._end_markers = (THINK_END, *tool_call_starts)

    def feed(self, text: str) -> ReasoningPiece:
        self._scanner.feed(text)
        reasoning, content = [], []
        while True:
            if self._state == _OPENING:
                buffered = self._scanner.peek()
                stripped = buffered.lstrip()
                if stripped.startswith(THINK_START):
                    self._scanner.take()
                    self._scanner.feed(stripped[len(THINK_START) :])
                    self._state = _REASONING
                    continue
                if THINK_START.startswith(stripped):
                    break  # still undecided (nothing but whitespace and part of the tag so far)
                self._state = _CONTENT
            elif self._state == _REASONING:
                scan = self._scanner.scan(self._end_markers)
                reasoning.append(scan.text)
                if scan.marker is None:
                    break
                if scan.marker == THINK_END:
                    self._state = _AFTER_REASONING
                else:
                    self._scanner.unread(scan.marker)  # a tool call: it is the tool parser's
                    self._state = _CONTENT
            elif self._state == _AFTER_REASONING:
                rest = self._scanner.take().lstrip()
                if not rest:
                    break
                content.append(rest)
                self._state = _CONTENT
            else:
                content.append(self._scanner.take())
                break
        return ReasoningPiece("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningPiece:
        """The end of the output: whatever was held back is final now."""
        held = self._scanner.take()
        if self._state == _REASONING:
            return ReasoningPiece(held, "")
        if self._state == _AFTER_REASONING:
            return ReasoningPiece("", held.lstrip())
        return ReasoningPiece("", held)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
