"""OpenAI response bodies: whole responses and stream chunks of chat and text completions.

A `ResponseFormat` turns engine deltas into the JSON shapes of one endpoint; `serving.py` decides when to
emit them. Logprob token strings are decoded one token at a time (special tokens included), as OpenAI
reports them; the text itself comes from the engine's incremental detokenizer.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from morion.engine.messages import RequestDelta
from morion.engine.outputs import Usage
from morion.text.tokenizer import Tokenizer


class TokenTexts:
    """Token id -> its text, for logprobs; decoded once per id."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer else ""
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
    """What one choice has produced so far (non-streaming responses, completion text offsets)."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.text_length = 0
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None

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

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        raise NotImplementedError

    def finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def delta_logprobs(self, delta: RequestDelta, choice: Choice) -> Any:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            for i in range(num_choices)
        ]

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        logprobs = self.delta_logprobs(delta, choice) if self.wants_logprobs else None
        if not delta.text and not logprobs:
            return None
        return {
            "index": index,
            "delta": {"content": delta.text},
            "logprobs": {"content": logprobs} if logprobs else None,
            "finish_reason": None,
        }

    def finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(choice.text_parts)},
            "logprobs": {"content": choice.logprobs} if self.wants_logprobs else None,
            "finish_reason": choice.finish_reason,
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
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        logprobs = self.delta_logprobs(delta, choice) if self.wants_logprobs else None
        if not delta.text and not logprobs:
            return None
        return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}

    def finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if self.wants_logprobs:
            logprobs = _LegacyLogprobs.merge(choice.logprobs)
        return {
            "index": index,
            "text": "".join(choice.text_parts),
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    def delta_logprobs(self, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        if not delta.token_ids or delta.logprobs is None:
            return None
        tokens = [self.token_texts(t) for t in delta.token_ids]
        offsets = []
        offset = choice.text_length  # the delta's text has not been added to the choice yet
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        part = _LegacyLogprobs(
            tokens,
            list(delta.logprobs),
            [{self.token_texts(t): lp for t, lp in top} for top in delta.top_logprobs or ()],
            offsets,
        )
        choice.logprobs.append(part)
        return part.body()


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
