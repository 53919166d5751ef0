"""Counting a chat prompt's tokens as the server will: the first of these the server (or user) offers.

1. `POST /v1/chat/completions/render` (morion; Pennyroyal's needle runner): the rendered prompt's ids.
2. `POST /tokenize` with `messages` (morion, vLLM): the same count through the chat template.
3. `--tokenizer PATH`: a local tokenizer with a chat template (a tokenizer.json directory or a .gguf).
4. The server's own `usage.prompt_tokens` of a one-token request (any OpenAI server; costs a prefill).

The method is settled on the first count and kept for the run; results record which one counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from morion.errors import MorionError
from morion.validate.session import Session


class Count(NamedTuple):
    tokens: int
    token_ids: list[int] | None  # None when the method gives only a number

    def sha256(self, messages: list[dict[str, Any]]) -> str:
        """The prompt's identity: of its token ids when known, else of the messages' JSON."""
        data = self.token_ids if self.token_ids is not None else messages
        return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()


class PromptCounter:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.method: str | None = None
        self.unavailable: dict[str, str] = {}  # method -> why it was passed over
        self._tokenizer: Any = None

    def count(self, messages: list[dict[str, Any]]) -> Count:
        if self.method is not None:
            return self._count_with(self.method, messages)
        for method in ("render", "tokenize", "tokenizer", "usage"):
            try:
                result = self._count_with(method, messages)
            except _Unavailable as why:
                self.unavailable[method] = str(why)
                continue
            self.method = method
            return result
        raise MorionError(f"no way to count prompt tokens: {self.unavailable}")

    def _count_with(self, method: str, messages: list[dict[str, Any]]) -> Count:
        if method == "render":
            body = self._post(
                "/v1/chat/completions/render", {"model": self.session.model, "messages": messages}
            )
            ids = body.get("token_ids")
            return Count(int(body.get("count", len(ids or ()))), ids)
        if method == "tokenize":
            body = self._post(
                "/tokenize",
                {"model": self.session.model, "messages": messages, "add_generation_prompt": True},
            )
            ids = body.get("tokens")
            return Count(int(body.get("count", len(ids or ()))), ids)
        if method == "tokenizer":
            ids = self._local_tokenizer().encode_chat(messages)
            return Count(len(ids), ids)
        reply = self.session.chat.ask(messages, 1)
        if reply.prompt_tokens is None:
            raise _Unavailable("the server reports no usage.prompt_tokens")
        return Count(reply.prompt_tokens, None)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async def post() -> httpx.Response:
            async with self.session.endpoint.client() as client:
                return await client.post(path, json=body)

        response = asyncio.run(post())
        if response.status_code != 200:
            raise _Unavailable(f"{path} answered {response.status_code}")
        try:
            return response.json()
        except ValueError:
            raise _Unavailable(f"{path} did not answer JSON") from None

    def _local_tokenizer(self) -> Any:
        path = self.session.options.tokenizer
        if path is None:
            raise _Unavailable("no --tokenizer given")
        if self._tokenizer is None:
            from morion.loader.tokenizer_loader import load_tokenizer

            tokenizer = load_tokenizer(Path(path))
            if tokenizer is None or tokenizer.chat_template is None:
                raise MorionError(f"--tokenizer {path}: no tokenizer with a chat template there")
            self._tokenizer = tokenizer
        return self._tokenizer


class _Unavailable(Exception):
    pass
