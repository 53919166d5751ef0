"""Reading the small JSON files users hand to morion (policies, token maps), with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from morion.errors import MorionError


def read_json_file(path: str | Path, what: str) -> Any:
    """The parsed content of `path`; a `MorionError` naming `what` (e.g. "spec policy") and the path when it
    cannot be read or is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as error:
        raise MorionError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise MorionError(f"{what} {path}: not valid JSON: {error}") from None
