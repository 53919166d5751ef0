"""One chat answer as a sequence of blocks, for the endpoints whose output is a list of typed parts.

The Responses API (output items) and the Anthropic Messages API (content blocks) both write an answer
as reasoning, text and tool-call parts in the order the model produced them. `answer_blocks` reads one
engine request's deltas through the chat output parser (reasoning, content, calls streamed piece by
piece) and turns them into `BlockEvent`s: a block starts, grows, stops; the stream ends with `Finished`.
A whole (not streamed) response is built from the same events, so both forms say the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from morion.engine.outputs import Usage
from morion.server.engine_client import RequestStream, delta_error
from morion.server.parsers.chat_output import ChatOutputParser, ParsedDelta

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


class BlockEvent(NamedTuple):
    action: str  # "start", "delta" or "stop"
    kind: str  # REASONING, TEXT or TOOL_CALL
    text: str = ""  # delta: the next piece (a tool call's: of its arguments' JSON)
    name: str | None = None  # start of a tool call: the function


class Finished(NamedTuple):
    reason: str  # the engine's: stop or length
    stop_reason: str | int | None  # the stop string or token id that ended it (None: EOS)
    usage: Usage
    called_tools: bool


class _Blocks:
    """Which block is open; a part of another kind (or a new tool call) stops it and starts its own."""

    def __init__(self) -> None:
        self._open: tuple[str, int] | None = None  # (kind, tool call index)

    def feed(self, parsed: ParsedDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if parsed.reasoning:
            events += self._switch((REASONING, -1))
            events.append(BlockEvent("delta", REASONING, parsed.reasoning))
        if parsed.content:
            events += self._switch((TEXT, -1))
            events.append(BlockEvent("delta", TEXT, parsed.content))
        for piece in parsed.tool_calls:
            if piece.name is not None:
                events += self._switch((TOOL_CALL, piece.index), piece.name)
            if piece.arguments:
                events.append(BlockEvent("delta", TOOL_CALL, piece.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        kind, self._open = self._open[0], None
        return [BlockEvent("stop", kind)]

    def _switch(self, block: tuple[str, int], name: str | None = None) -> list[BlockEvent]:
        if self._open == block:
            return []
        events = self.close()
        self._open = block
        return [*events, BlockEvent("start", block[0], name=name)]


async def answer_blocks(
    stream: RequestStream, new_parser: Callable[[], ChatOutputParser | None]
) -> AsyncIterator[BlockEvent | Finished]:
    """The blocks of one engine request's answer; an engine error or abort raises `APIError` (400, 500 or
    503: `delta_error`)."""
    parser = new_parser()
    blocks = _Blocks()
    called_tools = False
    async for batch in stream.batches():
        for _, delta in batch:
            error = delta_error(delta)
            if error is not None:
                raise error
            parsed = parser.feed(delta.text) if parser else ParsedDelta("", delta.text, [])
            called_tools = called_tools or bool(parsed.tool_calls)
            for event in blocks.feed(parsed):
                yield event
            if delta.finish_reason is None:
                continue
            last = parser.finish() if parser else ParsedDelta("", "", [])
            called_tools = called_tools or bool(last.tool_calls)
            for event in [*blocks.feed(last), *blocks.close()]:
                yield event
            usage = delta.usage or Usage(0, 0, 0)
            yield Finished(delta.finish_reason, delta.stop_reason, usage, called_tools)
