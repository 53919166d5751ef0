"""Log a message the first time it occurs: which implementation of an op runs, and why (design.md §2:
ops never fall back silently), without repeating it on every forward."""

from __future__ import annotations

import logging

_seen: set[str] = set()


def log_once(logger: logging.Logger, message: str) -> None:
    if message not in _seen:
        _seen.add(message)
        logger.info(message)
