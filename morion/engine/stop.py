"""Stop strings over incrementally decoded text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopCheck(NamedTuple):
    """`emit` is safe to send to the client now; `stopped` means a stop string ended generation."""

    emit: str
    stopped: bool


class StopStringMatcher:
    """Finds the first stop string in a stream of text pieces, holding back text that might start one.

    Invariant: the held-back text is the longest suffix of everything fed so far that is a proper prefix
    of some stop string. So a stop string can only begin inside held + new text, and emitted text never
    has to be taken back. After a stop, the matcher stays stopped and emits nothing more.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, new_text: str) -> StopCheck:
        """Add decoded text; return what can be emitted and whether a stop string was reached.

        On a match, `emit` is the text up to (not including) the earliest stop string.
        """
        if self._stopped:
            return StopCheck("", True)
        text = self._held + new_text
        matches = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if matches:
            at, self.matched = min(matches, key=lambda match: match[0])
            self._held = ""
            self._stopped = True
            return StopCheck(text[:at], True)
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :]
        return StopCheck(text[: len(text) - keep], False)

    def flush(self) -> str:
        """Held-back text, to emit when generation ends for another reason (empty after a stop)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[-n:]):
                    longest = n
                    break
        return longest
