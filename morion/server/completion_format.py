"""`/v1/completions` bodies: legacy logprobs, `echo`, `best_of`, and vLLM's token-id extensions.

Logprobs follow OpenAI's: per generated token its text, its logprob, and `top_logprobs` with the
`logprobs` most likely tokens plus the chosen one (so `logprobs: 0` gives the chosen token alone).
With `echo` the prompt comes first, in the text and (with logprobs) in every list, its first token
without a logprob. With `best_of`, each prompt's candidates are ranked by the sum of their chosen tokens'
logprobs and the best `n` are returned; usage counts every candidate's tokens, as OpenAI bills them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from morion.engine.outputs import PromptLogprob
from morion.server.engine_messages import RequestDelta
from morion.server.prepare import EngineJob
from morion.server.protocol import CompletionRequest
from morion.server.responses import Choice, ResponseFormat, TokenTexts, UsageTotals, prompt_logprobs_body
from morion.text.tokenizer import Tokenizer


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        model: str,
        token_texts: TokenTexts,
        request: CompletionRequest,
        job: EngineJob,
        tokenizer: Tokenizer | None,
    ) -> None:
        super().__init__(response_id, model, token_texts, request.logprobs is not None)
        self._request = request
        # Without a tokenizer the ids are the only output: every choice carries them, asked or not.
        self._token_ids = request.return_token_ids or tokenizer is None
        self._prompts = job.prompts
        self._candidates = job.n  # engine requests per prompt
        # echo writes the prompt as the client sent it (text), or decoded (token ids).
        self._prompt_texts = [
            prompt if isinstance(prompt, str) else (tokenizer.decode(prompt) if tokenizer else "")
            for prompt in request.prompt
        ]

    def delta_choice(self, index: int, delta: RequestDelta, choice: Choice) -> dict[str, Any] | None:
        first = not choice.opened
        text, logprobs = self._opening(index, choice)
        if self.wants_logprobs and delta.token_ids:
            logprobs = _LegacyLogprobs.join([logprobs, self.delta_logprobs(delta, choice)])
        text += delta.text
        if not text and not logprobs and not (self._token_ids and delta.token_ids):
            return None
        entry = {"index": index, "text": text, "logprobs": logprobs.body() if logprobs else None}
        entry["finish_reason"] = None
        if self._token_ids:
            entry["token_ids"] = delta.token_ids
            if first and self._request.return_token_ids:
                entry["prompt_token_ids"] = self._prompts[index // self._candidates]
        return entry

    def finish_choices(self, index: int, reason: str, choice: Choice) -> list[dict[str, Any]]:
        text, logprobs = self._opening(index, choice)  # a choice that ended before any token
        entry = {"index": index, "text": text, "logprobs": logprobs.body() if logprobs else None}
        if self._token_ids:
            entry["token_ids"] = []  # every chunk of a choice carries the field
        return [entry | {"finish_reason": reason, "stop_reason": choice.stop_reason}]

    def collect(self, index: int, delta: RequestDelta, choice: Choice) -> None:
        self._opening(index, choice)
        super().collect(index, delta, choice)

    def _opening(self, index: int, choice: Choice) -> tuple[str, _LegacyLogprobs | None]:
        """The echoed prompt, once per choice: its text and (with logprobs) its tokens' logprobs, which
        arrive with the choice's first tokens."""
        if choice.opened:
            return "", None
        choice.opened = True
        if not self._request.echo:
            return "", None
        prompt = self._prompts[index // self._candidates]
        text = self._prompt_texts[index // self._candidates]
        choice.add(text)
        if not self.wants_logprobs:
            return text, None
        part = self._prompt_part(prompt, choice.prompt_logprobs)
        choice.logprobs.append(part)
        return text, part

    def response(self, choices: list[Choice], usage: UsageTotals) -> dict[str, Any]:
        """With best_of, the best n candidates of each prompt, most likely first."""
        kept = list(enumerate(choices))
        if self._candidates > self._request.n:
            kept = []
            for first in range(0, len(choices), self._candidates):
                group = list(enumerate(choices[first : first + self._candidates], start=first))
                kept += sorted(group, key=lambda item: -item[1].cumulative_logprob)[: self._request.n]
        body = self._envelope(self.object_name, [self._final(i, *item) for i, item in enumerate(kept)])
        body["usage"] = usage.body()
        return body

    def final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return self._final(index, index, choice)

    def _final(self, index: int, source: int, choice: Choice) -> dict[str, Any]:
        """`source`: the choice's engine request (its prompt is `source // candidates`)."""
        prompt = self._prompts[source // self._candidates]
        entry = {
            "index": index,
            "text": "".join(choice.text_parts),
            "logprobs": _LegacyLogprobs.join(choice.logprobs).body() if self.wants_logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self._token_ids:
            entry["token_ids"] = choice.token_ids
        if self._request.return_token_ids:
            entry["prompt_token_ids"] = prompt
        if choice.prompt_logprobs is not None and self._request.prompt_logprobs is not None:
            entry["prompt_logprobs"] = prompt_logprobs_body(prompt, choice.prompt_logprobs, self.token_texts)
        return entry

    def delta_logprobs(self, delta: RequestDelta, choice: Choice) -> _LegacyLogprobs:
        tokens = [self.token_texts(t) for t in delta.token_ids]
        offsets = []
        position = choice.text_length  # the delta's text has not been added to the choice yet
        for token in tokens:
            offsets.append(position)
            position += len(token) if self.token_texts.has_text else 0  # no text: every offset is 0
        tops = [
            self._with_chosen(top, token_id, logprob)
            for token_id, logprob, top in zip(
                delta.token_ids, delta.logprobs or (), delta.top_logprobs or (), strict=False
            )
        ]
        part = _LegacyLogprobs(tokens, list(delta.logprobs or ()), tops, offsets)
        choice.logprobs.append(part)
        return part

    def _with_chosen(self, top: list[tuple[int, float]], chosen: int, logprob: float) -> dict[str, float]:
        entries = {self.token_texts(t): lp for t, lp in top}
        entries.setdefault(self.token_texts(chosen), logprob)
        return entries

    def _prompt_part(self, prompt: list[int], entries: list[PromptLogprob | None] | None) -> _LegacyLogprobs:
        tokens = [self.token_texts(t) for t in prompt]
        offsets, position = [], 0
        for token in tokens:
            offsets.append(position)
            position += len(token) if self.token_texts.has_text else 0  # no text: every offset is 0
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token_id, entry in zip(prompt, entries or [None] * len(prompt), strict=True):
            logprobs.append(entry.logprob if entry is not None else None)
            tops.append(self._with_chosen(entry.top, token_id, entry.logprob) if entry is not None else None)
        return _LegacyLogprobs(tokens, logprobs, tops, offsets)


class _LegacyLogprobs(NamedTuple):
    """/v1/completions logprobs: parallel lists over the tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def body(self) -> dict[str, Any]:
        return self._asdict()

    @staticmethod
    def join(parts: list[_LegacyLogprobs | None]) -> _LegacyLogprobs:
        present = [part for part in parts if part is not None]
        return _LegacyLogprobs(
            *([v for part in present for v in getattr(part, field)] for field in _LegacyLogprobs._fields)
        )
