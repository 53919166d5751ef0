"""Helpers for the `morion bench` tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from morion.cli import main


def run_bench(flags: list[str], out: Path) -> tuple[int, str]:
    """Runs `morion bench FLAGS --out OUT` with stderr captured in OUT/stderr.txt: (exit status, stderr)."""
    capture = pytest.MonkeyPatch()
    stderr = out / "stderr.txt"
    with stderr.open("w") as sink:
        capture.setattr("sys.stderr", sink)
        try:
            status = main(["bench", *flags, "--out", str(out)])
        finally:
            capture.undo()
    return status, stderr.read_text()
