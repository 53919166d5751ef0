"""Functions of the C library that Python does not wrap, where the platform has them (ctypes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def libc_function(name: str, restype: type, argtypes: tuple[type, ...]) -> Callable[..., int] | None:
    """The C library's `name` with its signature, or None where the library or the function is missing
    (`malloc_trim` is glibc's: not in musl or macOS)."""
    path = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(path), name) if path else None
    except (OSError, AttributeError):
        return None
    if function is not None:
        function.restype, function.argtypes = restype, list(argtypes)
    return function
