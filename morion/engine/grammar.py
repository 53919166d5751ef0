"""Grammar-constrained decoding with xgrammar: compile once, match per request, mask logits per step.

The server's front end compiles in a child process it can bound (`morion/server/grammar_worker.py`; offline,
`GrammarCompilerCache` compiles in-process), cached by spec, and sends the compiled grammar serialized in
`SamplingParams.grammar`; the engine only deserializes it (about a millisecond, cached by key) and keeps
one `GrammarMatcher` per request, dropped when the request ends. Each step, before sampling, the matchers fill
one row each of a CPU bitmask, which is applied to the logits on their device (xgrammar's CPU kernel for
CPU tensors, its Triton kernel for CUDA ones). xgrammar is imported only when a grammar is used.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only in annotations: the server's front end imports this module without it
    import torch
    import xgrammar

    from morion.text.tokenizer import Tokenizer

# Compiled grammars kept per process (schemas repeat across an agent's requests), bounded in number and in
# bytes: one grammar can take hundreds of megabytes.
_CACHE_ENTRIES = 64
CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class GrammarSpec:
    """What a request is constrained to, before compilation. `kind` is "json_schema" (`source` is the
    schema as JSON text), "regex", "ebnf" (xgrammar's EBNF dialect), "structural_tag" (xgrammar's
    structural tag as JSON text) or "json_object" (any JSON object)."""

    kind: str
    source: str = ""

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar as it travels to the engine: xgrammar's serialized form and a cache key."""

    key: str
    serialized: str

    def __repr__(self) -> str:  # the serialized form is tens of kilobytes
        return f"CompiledGrammar(key={self.key[:12]}..., {len(self.serialized)} chars)"


class GrammarError(ValueError):
    """The spec is not a valid schema, regex or grammar; the message says what is wrong."""


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the tokenizer, with `vocab_size` the model's logits width (it may pad)."""
    import xgrammar

    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    # The vocabulary itself is the best evidence of its byte encoding: GGUF-built tokenizers may lack the
    # decoder that xgrammar's metadata detection reads; then whether a space is prepended is observed.
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    vocab_type, add_prefix_space = metadata["vocab_type"], metadata["add_prefix_space"]
    from_vocab = xgrammar.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != vocab_type:
        vocab_type = from_vocab
        first = tokenizer.backend.encode("a", add_special_tokens=False).tokens[:1]
        add_prefix_space = bool(first) and first[0][:1] in ("Ġ", "▁")
    return xgrammar.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(tokenizer.eos_token_ids) or None,
        add_prefix_space=add_prefix_space,
    )


class GrammarLRU:
    """A thread-safe least-recently-used map of grammars, bounded in entries and in their total size."""

    def __init__(self, max_entries: int = _CACHE_ENTRIES, max_bytes: int = CACHE_BYTES) -> None:
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self.nbytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value: Any, nbytes: int) -> None:
        """Keeps `value` (of `nbytes`) unless it alone is over the byte bound; evicts the oldest."""
        with self._lock:
            if key in self._items or nbytes > self._max_bytes:
                return
            self._items[key] = (value, nbytes)
            self.nbytes += nbytes
            while len(self._items) > self._max_entries or self.nbytes > self._max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.nbytes -= dropped


class GrammarCompilerCache:
    """Compiles `GrammarSpec`s for one tokenizer, in this process, with no bound on the time or memory a
    compilation takes (offline use; the server compiles in `grammar_worker`). Thread-safe. Invalid specs
    raise `GrammarError`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_threads: int = 1) -> None:
        import xgrammar

        self._compiler = xgrammar.GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size), max_threads=max_threads, cache_enabled=False
        )
        self._compiled = GrammarLRU()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = spec.key
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = CompiledGrammar(key, compile_spec(self._compiler, spec).serialize_json())
            self._compiled.put(key, compiled, len(compiled.serialized))
        return compiled


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
    """`spec` compiled by `compiler`; an invalid schema, regex or grammar raises `GrammarError`."""
    try:
        if spec.kind == "json_schema":
            # Compact separators and no free whitespace: small models otherwise emit newlines forever.
            return compiler.compile_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.source)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.source)
    except (RuntimeError, ValueError) as error:  # xgrammar's parse errors (pydantic's for tags)
        raise GrammarError(_clean_message(error)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def _clean_message(error: Exception) -> str:
    # "[04:13:17] /project/cpp/regex_converter.cc:83: Regex parsing error ..." -> the part after the source.
    text = str(error).strip()
    _, sep, tail = text.partition(".cc:")
    if sep:
        text = tail.split(":", 1)[-1].strip()
    return text.splitlines()[0] if text else type(error).__name__


class GrammarRuntime:
    """The engine side: the tokenizer info (built on first use) and deserialized grammars by key."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._info: xgrammar.TokenizerInfo | None = None
        self._grammars = GrammarLRU()

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        import xgrammar

        if self._tokenizer is None:
            raise ValueError("a grammar needs a tokenizer, and this model has none")
        if self._info is None:
            self._info = tokenizer_info(self._tokenizer, self._vocab_size)
        compiled = self._grammars.get(grammar.key)
        if compiled is None:
            compiled = xgrammar.CompiledGrammar.deserialize_json(grammar.serialized, self._info)
            self._grammars.put(grammar.key, compiled, compiled.memory_size_bytes)
        return GrammarMatcher(xgrammar.GrammarMatcher(compiled), self._vocab_size)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may be generated."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_terminated() and not self._matcher.accept_token(token_id):
            # Cannot happen for a token sampled under this matcher's mask; a bug if it does.
            raise RuntimeError(f"the grammar rejected token {token_id} that its own mask allowed")


def apply_grammar_masks(scores: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Set the logits of tokens each row's grammar forbids to -inf, in place; rows without one keep all.

    The bitmask is filled on the CPU (where the matchers live) and applied where `scores` is.
    """
    import xgrammar

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), scores.shape[-1])
    for row in rows:
        matchers[row].fill(bitmask, row)  # type: ignore[union-attr]
    if scores.device.type != "cpu":
        bitmask = bitmask.to(scores.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(scores, bitmask, indices=rows)
