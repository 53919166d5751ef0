"""The streaming state machine under every output parser: find markers in text that arrives in pieces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Scan(NamedTuple):
    """`text` comes before `marker` (None: no marker yet; `text` is then all that is safe to pass on)."""

    text: str
    marker: str | None


class TagScanner:
    """Buffers streamed text and splits it at the earliest of the markers a parser is looking for.

    Invariant: whatever `scan` returns as text without a marker can never become part of a marker; the
    held-back text is the longest suffix of the buffer that is a proper prefix of one of the markers. So a
    tag split at any position across pieces is found exactly as if it had arrived whole.
    """

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> None:
        self._buffer += text

    def unread(self, text: str) -> None:
        """Put text back in front of the buffer (a marker that belongs to the next parser)."""
        self._buffer = text + self._buffer

    def scan(self, markers: Sequence[str]) -> Scan:
        """Consume up to and including the earliest marker, or all text that cannot start one."""
        buffer = self._buffer
        found = [(index, marker) for marker in markers if (index := buffer.find(marker)) >= 0]
        if found:
            index, marker = min(found, key=lambda hit: (hit[0], -len(hit[1])))
            self._buffer = buffer[index + len(marker) :]
            return Scan(buffer[:index], marker)
        keep = _partial_marker_length(buffer, markers)
        self._buffer = buffer[len(buffer) - keep :]
        return Scan(buffer[: len(buffer) - keep], None)

    def peek(self) -> str:
        return self._buffer

    def take(self) -> str:
        """Everything buffered (at the end of the output, a held-back prefix is plain text)."""
        text, self._buffer = self._buffer, ""
        return text


def _partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest
