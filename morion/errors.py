"""Errors that reach users. Their messages are one line and name the bad value."""

from __future__ import annotations


class MorionError(Exception):
    """A problem the user can fix (bad path, bad flag, bad file); the CLI prints it as one line."""


class ModelLoadError(MorionError):
    """A model path, file or config that morion cannot load."""


class InvalidRequestError(MorionError, ValueError):
    """A request or sampling parameter outside its valid range (an HTTP 400 in the server)."""
