"""OpenAI response bodies: whole responses and stream chunks of chat and text completions.

A `ResponseFormat` turns engine deltas into the JSON shapes of one endpoint; `serving.py` decides when to
emit them. Logprob token strings are decoded one token at a time (special tokens included), as OpenAI
reports them; the text itself comes from the engine's incremental detokenizer. A server without a
tokenizer has no text: logprobs name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids` form), and
its completions carry the generated `token_ids` (completion_format.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from morion.engine.outputs import PromptLogprob, Usage
from morion.server.engine_messages import RequestDelta
from morion.server.parsers.chat_output import ChatOutputParser, ParsedDelta
from morion.server.parsers.tool_calls import ParsedToolCall, ToolCallDelta
from morion.text.tokenizer import Tokenizer


class TokenTexts:
    """Token id -> its text, for logprobs; decoded once per id. Without a tokenizer, `token_id:N`: every
    token keeps a distinct name, and none of it is text (`has_text` is False)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.has_text = tokenizer is not None

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


class UsageTotals:
    """Usage of one HTTP request. Its n choices per prompt share one prompt: it is counted once, with the
    cached tokens of the prompt's first choice (the others find it in the cache that choice filled)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, choice: int, usage: Usage | None) -> None:
        if usage is None:
            return
        self.completion_tokens += usage.completion_tokens
        if choice % self._n == 0:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Choice:
    """What one choice has produced so far (non-streaming responses, completion text offsets), and the
    parser that reads its chat output (None: all text is content)."""

    def __init__(self, parser: ChatOutputParser | None = None) -> None:
        self.parser = parser
        self.call_ids: list[str] = []  # of the tool calls streamed so far, by index
        self.text_parts: list[str] = []
        self.text_length = 0
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.token_ids: list[int] = []
        self.cumulative_logprob = 0.0  # of its chosen tokens, when the engine reported them
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        self.opened = False  # its first entry was written (completions: the echoed prompt)

    def record(self, delta: RequestDelta) -> None:
        """What a delta says besides its text (`add`, after the format has read `text_length`)."""
        self.token_ids += delta.token_ids
        self.cumulative_logprob += sum(delta.logprobs or ())
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def add(self, text: str) -> None:
        self.text_parts.append(text)
        self.text_length += len(text)


class ResponseFormat:
    """Shared fields of both endpoints; subclasses fill in choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, token_texts: TokenTexts, logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_texts = token_texts
        self.wants_logprobs = logprobs

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, choices)
        if usage is not None:
            body["usage"] = usage
        return body

    def response(self, choices: list[Choice], usage: UsageTotals) -> dict[str, Any]:
        body = self._envelope(self.object_name, [self.final_choice(i, c) for i, c in enumerate(choices)])
        body["usage"] = usage.body()
        return body

    def new_choice(self) -> Choice:
        return Choice()

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        raise NotImplementedError

    def finish_choices(self, index: int, reason: str, choice: Choice) -> list[dict[str, Any]]:
        """The choice's last stream entries: text a parser held back, then the finish reason."""
        raise NotImplementedError

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def collect(self, index: int, delta: RequestDelta, choice: Choice) -> None:
        """A delta of a whole (not streamed) response: its logprobs and text into the choice."""
        if self.wants_logprobs and delta.token_ids:
            self.delta_logprobs(delta, choice)
        choice.add(delta.text)

    def delta_logprobs(self, delta: RequestDelta, choice: Choice) -> Any:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        model: str,
        token_texts: TokenTexts,
        logprobs: bool,
        output_parser: Callable[[], ChatOutputParser | None] | None = None,
        reasoning: bool = False,
        echo: str = "",
        prompt_token_ids: list[int] | None = None,
        return_token_ids: bool = False,
    ) -> None:
        """`output_parser` makes each choice's parser; `reasoning`: messages carry `reasoning_content`.
        `echo`: text the answer starts with (the last assistant message, for `echo`). `prompt_token_ids`:
        the prompt, for `prompt_logprobs`, and with `return_token_ids` in the response, every choice with
        its own token ids."""
        super().__init__(response_id, model, token_texts, logprobs)
        self._output_parser = output_parser
        self._reasoning = reasoning
        self._echo = echo
        self._prompt_token_ids = prompt_token_ids
        self._return_token_ids = return_token_ids

    def new_choice(self) -> Choice:
        return Choice(self._output_parser() if self._output_parser else None)

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": self._echo}
        chunks = [
            self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            for i in range(num_choices)
        ]
        if self._return_token_ids and chunks:
            chunks[0]["prompt_token_ids"] = self._prompt_token_ids
        return chunks

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        logprobs = self.delta_logprobs(delta, choice) if self.wants_logprobs else None
        parsed = choice.parser.feed(delta.text) if choice.parser else ParsedDelta("", delta.text, [])
        if not parsed and not logprobs and not (self._return_token_ids and delta.token_ids):
            return None
        entry = {
            "index": index,
            "delta": self._delta(parsed, choice) if parsed else {},
            "logprobs": {"content": logprobs} if logprobs else None,
            "finish_reason": None,
        }
        if self._return_token_ids:
            entry["token_ids"] = delta.token_ids
        return entry

    def finish_choices(self, index: int, reason: str, choice: Choice) -> list[dict[str, Any]]:
        entries = []
        last = choice.parser.finish() if choice.parser is not None else None
        if last:
            entries.append(
                {"index": index, "delta": self._delta(last, choice), "logprobs": None, "finish_reason": None}
            )
        reason = _finish_reason(reason, choice)
        finish = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return [*entries, finish | {"stop_reason": choice.stop_reason}]

    def _delta(self, parsed: ParsedDelta, choice: Choice) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            # `reasoning` is the newer name (vLLM, OpenRouter), `reasoning_content` the one most clients read.
            delta["reasoning_content"] = delta["reasoning"] = parsed.reasoning
        if parsed.content or not (parsed.reasoning or parsed.tool_calls):
            delta["content"] = parsed.content
        if parsed.tool_calls:
            pieces = merged_pieces(parsed.tool_calls)
            delta["tool_calls"] = [_streamed_call(piece, choice) for piece in pieces]
        return delta

    def response(self, choices: list[Choice], usage: UsageTotals) -> dict[str, Any]:
        body = super().response(choices, usage)
        if self._return_token_ids:
            body["prompt_token_ids"] = self._prompt_token_ids
        if choices and choices[0].prompt_logprobs is not None and self._prompt_token_ids is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(
                self._prompt_token_ids, choices[0].prompt_logprobs, self.token_texts
            )
        return body

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        parsed = whole_output(choice)
        message: dict[str, Any] = {"role": "assistant", "content": self._echo + parsed.content}
        calls = assembled_calls(parsed.tool_calls)
        if calls:
            message["content"] = message["content"] or None  # OpenAI: null content beside tool calls
            message["tool_calls"] = [_tool_call(call) for call in calls]
        if self._reasoning:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
        entry = {
            "index": index,
            "message": message,
            "logprobs": {"content": choice.logprobs} if self.wants_logprobs else None,
            "finish_reason": _finish_reason(choice.finish_reason, choice),
            "stop_reason": choice.stop_reason,
        }
        if self._return_token_ids:
            entry["token_ids"] = choice.token_ids
        return entry

    def delta_logprobs(self, delta: RequestDelta, choice: Choice) -> list[dict[str, Any]]:
        entries = []
        for token_id, logprob, top in zip(
            delta.token_ids, delta.logprobs or (), delta.top_logprobs or (), strict=False
        ):
            entry = self._token_entry(token_id, logprob)
            entry["top_logprobs"] = [self._token_entry(t, lp) for t, lp in top]
            entries.append(entry)
        choice.logprobs += entries
        return entries

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def prompt_logprobs_body(
    prompt: list[int], entries: list[PromptLogprob | None], token_texts: TokenTexts
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none) the token itself and the most
    likely ones there, by id: `{"id": {"logprob", "rank", "decoded_token"}}`."""
    body: list[dict[str, Any] | None] = []
    for token_id, entry in zip(prompt, entries, strict=True):
        if entry is None:
            body.append(None)
            continue
        alternatives = {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": token_texts(t)}
            for rank, (t, lp) in enumerate(entry.top, start=1)
        }
        own = {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": token_texts(token_id)}
        body.append({str(token_id): own, **alternatives})
    return body


def whole_output(choice: Choice) -> ParsedDelta:
    """A finished choice's text through its parser at once (the same split the stream made)."""
    text = "".join(choice.text_parts)
    if choice.parser is None:
        return ParsedDelta("", text, [])
    first, last = choice.parser.feed(text), choice.parser.finish()
    return ParsedDelta(
        first.reasoning + last.reasoning, first.content + last.content, first.tool_calls + last.tool_calls
    )


def merged_pieces(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one (a call's name and its first arguments in one delta)."""
    merged: list[ToolCallDelta] = []
    for piece in pieces:
        if merged and merged[-1].index == piece.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.name, last.arguments + piece.arguments)
        else:
            merged.append(piece)
    return merged


def assembled_calls(pieces: list[ToolCallDelta]) -> list[ParsedToolCall]:
    """Whole calls, in order, from all of an output's pieces."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.name is not None:
            names[piece.index] = piece.name
        arguments.setdefault(piece.index, []).append(piece.arguments)
    return [ParsedToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: ParsedToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": new_call_id(), "type": "function", "function": function}


def _streamed_call(piece: ToolCallDelta, choice: Choice) -> dict[str, Any]:
    """OpenAI's streamed form: the first delta of a call has its id, type and name, later ones arguments."""
    if piece.name is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    choice.call_ids.append(new_call_id())
    function = {"name": piece.name, "arguments": piece.arguments}
    return {"index": piece.index, "id": choice.call_ids[-1], "type": "function", "function": function}


def _finish_reason(reason: str | None, choice: Choice) -> str | None:
    # A choice that called tools and stopped by itself finished to call them.
    if reason == "stop" and choice.parser is not None and choice.parser.called_tools:
        return "tool_calls"
    return reason
