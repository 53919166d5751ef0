"""Progress lines on stderr for long-running steps (pulling, loading, benchmarks)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts up to `total` and redraws one status line; on a non-terminal, prints at most every 2 s."""

    def __init__(self, label: str, total: int, unit: str = "", stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._stream = stream or sys.stderr
        self._interactive = self._stream.isatty()
        self._started = time.perf_counter()
        self._last_draw = 0.0

    def advance(self, amount: int = 1) -> None:
        self.done += amount
        now = time.perf_counter()
        if now - self._last_draw >= (0.1 if self._interactive else 2.0):
            self._draw(final=False)
            self._last_draw = now

    def finish(self) -> None:
        self._draw(final=True)

    def _draw(self, final: bool) -> None:
        elapsed = time.perf_counter() - self._started
        line = f"{self.label}: {self.done}/{self.total}{self.unit} ({elapsed:.1f}s)"
        end = "\n" if final or not self._interactive else ""
        self._stream.write(("\r" if self._interactive else "") + line + end)
        self._stream.flush()
