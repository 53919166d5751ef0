"""Why a restored answer differs from cold: the prompt computed cold once more, in the process that served
the hit (restore_tokens.py sends it after each wrong answer).

A wrong answer (a cache hit that answers otherwise than the conversation's cold run) has two causes that
look alike, above all after a restart: the restored state is wrong; or it is exact, and the process that
served the hit computes this prompt otherwise than the one that served cold (it decodes in another batch
company, or makes a choice of its own: a kernel's tuning, a split count). So the prompt is sent once more
with a fresh random `cache_salt` (vLLM's field, morion's too): it shares no cached prefix with anything,
so the server computes it cold, in this process, now. Its answer, `cold_here`, gives the wrong answer
its cause:

- `restore`: cold here answers as the first cold run did: this process computes the prompt as that one
  did, so what differs is the restored state;
- `process`: cold here answers as the hit: the restored state is exact, and this process (or its batch
  company) computes the prompt otherwise than the first did;
- `neither`: it answers as neither of them;
- `unknown`: there is no cold answer here: the server refused `cache_salt` (an older server: said once,
  and `cold_here` is "unavailable" for every wrong answer from then on) or ignored it (its salted request
  was a cache hit), or the request failed.

A wrong answer is wrong whatever its cause: the cause is evidence for finding why, never the verdict.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

CAUSES = ("restore", "process", "neither", "unknown")
UNAVAILABLE = "unavailable"  # what `cold_here` records where the server takes no cache_salt
_ANSWER_KEYS = ("text", "token_logprobs", "token_ids", "completion_tokens")
_REJECTED = (400, 422)  # how a server that validates its fields refuses one it does not know
_WHY = {
    "restore": "cold here answers as cold: restore (the restored state is wrong)",
    "process": "cold here answers as this hit: process (the restore is exact; this process computes the "
    "prompt otherwise than the first)",
    "neither": "cold here answers as neither: neither",
}


def differs(reply: dict[str, Any], other: dict[str, Any]) -> bool:
    """Two answers differ in text, in any token's log probability, in token ids or in length."""
    return any(reply.get(key) != other.get(key) for key in _ANSWER_KEYS)


class ColdHere:
    """Sends a prompt with a fresh salt each time. `send(tokens, salt)` is the suite's request: a reply,
    or {"error": ..., "status": HTTP status} where the server refused it. After the server has refused or
    ignored the salt once (`refused` says how), nothing more is sent."""

    def __init__(self, send: Callable[[Sequence[int], str], dict[str, Any]], say: Callable[[str], None]):
        self._send = send
        self._say = say
        self.refused: str | None = None

    def send(self, tokens: Sequence[int]) -> dict[str, Any] | str:
        """The reply to `tokens` with a fresh `cache_salt` (recorded in it), or UNAVAILABLE."""
        if self.refused is not None:
            return UNAVAILABLE
        salt = secrets.token_hex(16)
        reply = self._send(tokens, salt)
        if reply.get("status") in _REJECTED:
            self.refused = f"it rejected cache_salt: {reply['error'][:200]}"
        elif reply.get("cached_tokens"):
            self.refused = f"it ignored cache_salt: a fresh salt hit {reply['cached_tokens']} cached tokens"
        if self.refused is None:
            return {**reply, "cache_salt": salt}
        self._say(f"restore: the server takes no cache_salt ({self.refused}); wrong answers get no cause")
        return UNAVAILABLE


def cause(cold_here: dict[str, Any] | str | None, hit: dict[str, Any], cold: dict[str, Any]) -> str:
    """The cause of the wrong answer `hit` (one of CAUSES), from `cold_here` (ColdHere.send's answer, None
    where none was sent)."""
    if not isinstance(cold_here, dict) or "error" in cold_here:
        return "unknown"
    if not differs(cold_here, cold):
        return "restore"
    return "neither" if differs(cold_here, hit) else "process"


def explain(found: str, cold_here: dict[str, Any] | str | None) -> str:
    """`found` (a cause) for a wrong answer's reason line."""
    if found != "unknown":
        return _WHY[found]
    if cold_here == UNAVAILABLE:
        return "cold here unavailable (the server takes no cache_salt): unknown"
    if isinstance(cold_here, dict):
        return f"cold here failed ({cold_here['error']}): unknown"
    return "cold here not sent: unknown"


def by_cause(counts: dict[str, int] | None) -> str:
    """Wrong answers counted by cause (`wrong_by_cause` of the suite's figures), as a report's sentence."""
    listed = ", ".join(f"{name} {count}" for name, count in (counts or {}).items()) or "not classified"
    return (
        "By cause, from the prompt computed cold again with a fresh cache_salt in the process that served "
        f"the hit: {listed} (restore: that answers as cold, the restored state is wrong; process: it "
        "answers as the hit, the restore is exact and that process computes the prompt otherwise; a wrong "
        "answer fails whatever its cause)."
    )


def recorded(cold_here: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
    """`cold_here` as a case records it: its answer and salt, UNAVAILABLE, its error, or None."""
    if not isinstance(cold_here, dict) or "error" in cold_here:
        return cold_here
    return {**{key: cold_here.get(key) for key in _ANSWER_KEYS}, "cache_salt": cold_here.get("cache_salt")}
