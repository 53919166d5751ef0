"""Where a result came from: commit, machine, GPU, driver, library versions (design.md §6, Evidence)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import morion

_REPO = Path(morion.__file__).resolve().parent.parent
_NVIDIA_SMI_QUERY = ("--query-gpu=name,driver_version,power.limit", "--format=csv,noheader")


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(repo: Path = _REPO) -> dict[str, Any]:
    """The checkout morion runs from: commit and whether tracked files differ from it.

    `MORION_SOURCE_COMMIT` names the commit instead, for machines that receive a copy of a clean working
    tree without its history (a remote GPU runner); the record says where the commit came from."""
    declared = os.environ.get("MORION_SOURCE_COMMIT")
    if declared:
        return {"git_commit": declared, "git_dirty": False, "git_commit_source": "MORION_SOURCE_COMMIT"}
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def gpus() -> list[dict[str, str]]:
    """One entry per GPU from nvidia-smi (name, driver, power limit); empty without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    text = _run(["nvidia-smi", *_NVIDIA_SMI_QUERY])
    entries = []
    for line in (text or "").splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3:
            entries.append(dict(zip(("name", "driver_version", "power_limit"), fields, strict=True)))
    return entries


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(command: str, device: str | None = None) -> dict[str, Any]:
    """Everything but the configuration, which the caller records beside it; `command` as typed."""
    import torch

    now = datetime.datetime.now(datetime.timezone.utc)
    info: dict[str, Any] = {
        **git_state(),
        "morion_version": morion.__version__,
        "date": now.date().isoformat(),
        "time_utc": now.isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "httpx": _version("httpx"),
        "command": command,
        "gpus": gpus(),
    }
    if device is not None and device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        info["device_name"] = torch.cuda.get_device_name(index)
        info["device_memory_gib"] = round(torch.cuda.get_device_properties(index).total_memory / 2**30, 2)
    return info
