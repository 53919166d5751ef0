"""morion's own log lines (which kernel runs, automatic choices) on stderr, as `morion: ...`.

Only the `morion` logger gets a handler: libraries' INFO chatter (an HTTP client's per-request lines,
say) stays off. Records still propagate, so pytest's caplog and an application's root handlers see them.
Called by the CLI and by the engine process, which starts a fresh interpreter.
"""

from __future__ import annotations

import logging
import sys


def show_morion_logs(level: int = logging.INFO) -> None:
    logger = logging.getLogger("morion")
    if any(getattr(handler, "_morion", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("morion: %(message)s"))
    handler._morion = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
