"""OpenAI response bodies: whole responses and stream chunks of chat and text completions.

A `ResponseFormat` turns engine deltas into the JSON shapes of one endpoint; `serving.py` decides when to
emit them. Logprob token strings are decoded one token at a time (special tokens included), as OpenAI
reports them; the text itself comes from the engine's incremental detokenizer. A server without a
tokenizer has no text: its completion choices carry the generated `token_ids` (vLLM's field of that
name), and logprobs name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids` form).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from morion.engine.messages import RequestDelta
from morion.engine.outputs import Usage
from morion.server.parsers.chat_output import ChatOutputParser, ParsedDelta
from morion.server.parsers.tool_calls import ParsedToolCall
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
        self.tool_calls_sent = 0  # streamed tool calls, which number the next one
        self.text_parts: list[str] = []
        self.text_length = 0
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None

    def add(self, delta: RequestDelta) -> None:
        self.text_parts.append(delta.text)
        self.text_length += len(delta.text)
        self.token_ids += delta.token_ids


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
    ) -> None:
        """`output_parser` makes each choice's parser; `reasoning`: messages carry `reasoning_content`."""
        super().__init__(response_id, model, token_texts, logprobs)
        self._output_parser = output_parser
        self._reasoning = reasoning

    def new_choice(self) -> Choice:
        return Choice(self._output_parser() if self._output_parser else None)

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            for i in range(num_choices)
        ]

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        logprobs = self.delta_logprobs(delta, choice) if self.wants_logprobs else None
        parsed = choice.parser.feed(delta.text) if choice.parser else ParsedDelta("", delta.text, [])
        if not parsed and not logprobs:
            return None
        return {
            "index": index,
            "delta": self._delta(parsed, choice),
            "logprobs": {"content": logprobs} if logprobs else None,
            "finish_reason": None,
        }

    def finish_choices(self, index: int, reason: str, choice: Choice) -> list[dict[str, Any]]:
        entries = []
        last = choice.parser.finish() if choice.parser is not None else None
        if last:
            entries.append(
                {"index": index, "delta": self._delta(last, choice), "logprobs": None, "finish_reason": None}
            )
        reason = _finish_reason(reason, choice)
        return [*entries, {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]

    def _delta(self, parsed: ParsedDelta, choice: Choice) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content or not (parsed.reasoning or parsed.tool_calls):
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [
                {"index": choice.tool_calls_sent + i, **_tool_call(call)}
                for i, call in enumerate(parsed.tool_calls)
            ]
            choice.tool_calls_sent += len(parsed.tool_calls)
        return delta

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        text = "".join(choice.text_parts)
        parsed = ParsedDelta("", text, [])
        if choice.parser is not None:
            first, last = choice.parser.feed(text), choice.parser.finish()
            parsed = ParsedDelta(
                first.reasoning + last.reasoning,
                first.content + last.content,
                first.tool_calls + last.tool_calls,
            )
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["content"] = parsed.content or None  # OpenAI: null content beside tool calls
            message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
        if self._reasoning:
            message["reasoning_content"] = parsed.reasoning or None
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": choice.logprobs} if self.wants_logprobs else None,
            "finish_reason": _finish_reason(choice.finish_reason, choice),
        }

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


class CompletionFormat(ResponseFormat):
    """`token_ids`: every choice (and stream chunk) also carries its generated token ids (the server has no
    tokenizer, so they are the only output)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self, response_id: str, model: str, token_texts: TokenTexts, logprobs: bool, token_ids: bool = False
    ) -> None:
        super().__init__(response_id, model, token_texts, logprobs)
        self.token_ids = token_ids

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        logprobs = self.delta_logprobs(delta, choice) if self.wants_logprobs else None
        token_ids = self.token_ids and delta.token_ids
        if not delta.text and not logprobs and not token_ids:
            return None
        return self._choice(index, delta.text, logprobs, None, delta.token_ids)

    def finish_choices(self, index: int, reason: str, choice: Choice) -> list[dict[str, Any]]:
        return [self._choice(index, "", None, reason, [])]

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if self.wants_logprobs:
            logprobs = _LegacyLogprobs.merge(choice.logprobs)
        text = "".join(choice.text_parts)
        return self._choice(index, text, logprobs, choice.finish_reason, choice.token_ids)

    def _choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, token_ids: list[int]
    ) -> dict[str, Any]:
        body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.token_ids:
            body["token_ids"] = list(token_ids)
        return body

    def delta_logprobs(self, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        if not delta.token_ids or delta.logprobs is None:
            return None
        tokens = [self.token_texts(t) for t in delta.token_ids]
        offsets = []
        offset = choice.text_length  # the delta's text has not been added to the choice yet
        for token in tokens:
            offsets.append(offset)
            offset += len(token) if self.token_texts.has_text else 0  # no text: every offset is 0
        part = _LegacyLogprobs(
            tokens,
            list(delta.logprobs),
            [{self.token_texts(t): lp for t, lp in top} for top in delta.top_logprobs or ()],
            offsets,
        )
        choice.logprobs.append(part)
        return part.body()


def _tool_call(call: ParsedToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _finish_reason(reason: str | None, choice: Choice) -> str | None:
    # A choice that called tools and stopped by itself finished to call them.
    if reason == "stop" and choice.parser is not None and choice.parser.called_tools:
        return "tool_calls"
    return reason


class _LegacyLogprobs(NamedTuple):
    """/v1/completions logprobs: parallel lists over the generated tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    def body(self) -> dict[str, Any]:
        return self._asdict()

    @staticmethod
    def merge(parts: list[_LegacyLogprobs]) -> dict[str, Any]:
        return {
            field: [v for part in parts for v in getattr(part, field)] for field in _LegacyLogprobs._fields
        }
