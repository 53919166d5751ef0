"""morion's own log lines (which kernel runs, automatic choices) on stderr, as `morion: ...`.

Only the `morion` logger gets a handler: libraries' INFO chatter (an HTTP client's per-request lines,
say) stays off. Records still propagate, so pytest's caplog and an application's root handlers see them.
Called by the CLI and by the engine process, which starts a fresh interpreter.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_VARIABLE = "MORION_LOG_LEVEL"  # `morion serve --log-level` sets it for its engine process too


def show_morion_logs(level: int | str | None = None) -> None:
    """`level` (a logging level or its name), else $MORION_LOG_LEVEL, else INFO."""
    logger = logging.getLogger("morion")
    chosen = level or os.environ.get(LEVEL_VARIABLE) or logging.INFO
    logger.setLevel(chosen.upper() if isinstance(chosen, str) else chosen)
    if any(getattr(handler, "_morion", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("morion: %(message)s"))
    handler._morion = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
