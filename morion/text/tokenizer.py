"""The tokenizer a model ships with: encode/decode, special ids and its chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from morion.text.chat_template import ChatTemplate

# Texts this long are encoded with the GIL released. Shorter ones take the plain call: it is a few
# microseconds cheaper, and the batch call starts the tokenizers library's thread pool, after which a fork
# prints a warning.
_GIL_FREE_FROM_CHARS = 16384


class Tokenizer:
    def __init__(
        self,
        backend: FastTokenizer,
        eos_token_ids: Sequence[int],
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = ChatTemplate(chat_template, bos_token, eos_token) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _GIL_FREE_FROM_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # `encode` holds the GIL throughout (seconds for megabytes); the batch call releases it, so a
        # server thread tokenizing a huge prompt leaves the event loop running.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template writes BOS itself where the model wants one, so no special tokens are added here.
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)
