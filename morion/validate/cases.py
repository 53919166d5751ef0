"""The frozen case files under `cases/`: each suite reads one, by name and version, and records its SHA-256.

Cases are frozen (pennyroyal-runtime.md §2): a file whose digest is not the one recorded here is refused,
so results that name `needle-v1` always mean the same prompts. A change is a new file (`needle-v2.json`)
with its digest added below, never an edit of an old one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

from morion.errors import MorionError

CASES_DIR = Path(__file__).resolve().parent / "cases"

# file name -> SHA-256 of its bytes
FROZEN = {
    "needle-v1.json": "2ffc1b5365e3e03084d112f32d760fa64d3b31b7c39d6851c59ed5272733f414",
    "restore-v1.json": "cec3275930c2d6ed9c2bef55b8b9cee619aa4e9c528dc83d4616bcdbdd882009",
    "soak-v1.json": "1b37da0eb1f8074fa4947e6d367727f27bc619154a504f0cdcc5087663e8c4c5",
    "tools-v1.json": "f1e2656a9f0fd57babfbb1967de8ab09b80ad7092d78f8d9c07a442edab75f4b",
    "vision-v1.json": "2585b30bccc200b70e3182e0b2e653d271693a040e044a9d70362550aa743a04",
}
# the version each suite runs
CURRENT = {
    "needle": "needle-v1.json",
    "restore": "restore-v1.json",
    "soak": "soak-v1.json",
    "tools": "tools-v1.json",
    "vision": "vision-v1.json",
}


class CaseFile(NamedTuple):
    name: str
    sha256: str
    data: dict[str, Any]

    def identity(self) -> dict[str, Any]:
        """What a result records about the cases it ran."""
        return {"file": self.name, "version": self.data.get("version"), "sha256": self.sha256}


def load(suite: str) -> CaseFile:
    name = CURRENT[suite]
    raw = (CASES_DIR / name).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    check_digest(name, digest, FROZEN[name])
    return CaseFile(name, digest, json.loads(raw))


def check_digest(name: str, digest: str, frozen: str) -> None:
    """A case file (or a file a case names, such as an image) must have its recorded SHA-256."""
    if digest != frozen:
        raise MorionError(
            f"case file {name} has SHA-256 {digest}, not its frozen {frozen}: cases are frozen; "
            "put changed cases in a new version"
        )


def select(cases: list[dict[str, Any]], wanted: tuple[str, ...]) -> list[dict[str, Any]]:
    """The cases whose id is in `wanted`, in file order; all of them when `wanted` names none of them
    (`--cases` narrows each suite it names a case of, and leaves the others whole)."""
    chosen = {case["id"] for case in cases} & set(wanted)
    return [case for case in cases if not chosen or case["id"] in chosen]
