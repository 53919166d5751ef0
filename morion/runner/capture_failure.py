"""What a failed CUDA graph capture tells the operator, and which failures leave no eager fallback."""

from __future__ import annotations

import sys
import traceback

from morion.errors import MorionError

# CUDA errors after which the context is unusable: no eager fallback can follow them.
_DEVICE_FAULTS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
)


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` is a sticky CUDA fault (a kernel read or wrote out of bounds, or asserted)."""
    text = str(error).lower()
    return any(fault in text for fault in _DEVICE_FAULTS)


def report_capture_failure(what: str, error: RuntimeError) -> None:
    """One line for the operator, then where it failed (the innermost frames: the op that synced or
    faulted), so a failed capture can be traced without a rerun. A device fault is raised instead: the
    CUDA context is lost, so running eagerly would only fail later and further from the cause."""
    print(f"morion: {what}: {error}", file=sys.stderr)
    frames = traceback.extract_tb(error.__traceback__)[-6:]
    print("".join(traceback.format_list(frames)).rstrip(), file=sys.stderr)
    if is_device_fault(error):
        raise MorionError(
            f"a kernel faulted during CUDA graph capture ({str(error).splitlines()[0]}); the CUDA context "
            "is unusable, so the engine stops here (the frames above show where)"
        ) from error
