"""Unique random prompts: every (workload, point, run, request) gets its own ids, seeded by a per-invocation
salt, so no prompt can hit a prefix cached by an earlier run (or by an earlier bench on the same server)."""

from __future__ import annotations

import random
import secrets

# Random ids stay below this even for larger vocabularies: the tail of big vocabularies holds special
# and control tokens (Qwen from 151643, Llama 3 from 128000), which some servers treat differently.
_ID_CEILING = 32000
_ID_FLOOR = 3  # ids 0-2 are bos / eos / pad in many small vocabularies


class PromptFactory:
    def __init__(self, vocab_size: int | None, salt: int | None = None) -> None:
        self.salt = secrets.randbits(63) if salt is None else salt
        ceiling = _ID_CEILING if vocab_size is None else min(vocab_size, _ID_CEILING)
        self.low = _ID_FLOOR if ceiling > 2 * _ID_FLOOR else 0
        self.high = ceiling

    def make(self, key: str, length: int) -> list[int]:
        """`length` ids drawn from a generator seeded by the salt and `key` (one key per request)."""
        rng = random.Random(f"{self.salt}:{key}")
        return [rng.randrange(self.low, self.high) for _ in range(length)]
