"""The one-command qualification (scripts/gpu_qualify.sh) runs end to end: its CPU smoke profile serves the
default model, restores every conversation from each tier (a restart in between), soaks, measures decode
through the server and offline, and reports a pass. On the GPU the same script, with the 80B and Flash-Next
profiles, is the gate of every serving change; this keeps the script itself from breaking unseen.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT_TIMEOUT_S = 900


def _qualify(part: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """scripts/gpu_qualify.sh's CPU smoke profile, one part, with $OUT unset (the device tool's folder)."""
    env = {name: value for name, value in env.items() if name != "OUT"}
    return subprocess.run(
        ["bash", "scripts/gpu_qualify.sh", "cpu-smoke", part],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(shutil.which("curl") is None, reason="the script waits for /health with curl")
def test_the_cpu_smoke_qualification_passes(tmp_path: Path) -> None:
    results = tmp_path / "qualify"
    env = {
        **os.environ,
        # The script runs `python3 -m morion`: the interpreter running these tests.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "QUALIFY_DIR": str(results),
        "QUALIFY_DISK_DIR": str(tmp_path / "disk"),
        "QUALIFY_PORT": str(free_port()),
        # A short run (the knobs that confirm a change within one device call): fewer conversations, each
        # still a hit on every tier, and a shorter soak; its files say so in their label.
        "QUALIFY_CONVERSATIONS": "3",
        "QUALIFY_SOAK_MINUTES": "0.2",
        # Engine flags beyond the profile's reach the server and the offline bench (here a no-op on a CPU:
        # programmatic dependent launch is off without a Hopper GPU).
        "QUALIFY_ENGINE_FLAGS": "--pdl launch",
    }
    run = _qualify("all", env=env, timeout=SCRIPT_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = [path for path in results.glob("*-cpu-qualify-smoke-short-flags.json")]
    assert len(reports) == 1, sorted(path.name for path in results.iterdir())
    report = json.loads(reports[0].read_text())
    assert "--pdl launch" in report["serve_command"] and "--pdl launch" in report["offline_command"]
    summary = report["summary"]
    assert summary["verdict"] == "pass", summary["problems"]
    restore = summary["restore"]
    assert restore["hits"] == {"device": 3, "host": 3, "disk": 3}
    assert restore["wrong_answers"] == 0
    assert summary["soak"]["errors"] == 0
    # Issue #24's agent turn through the same server: measured and reported, no target on a CPU.
    turn = summary["turn"]
    assert turn["prefix_tokens"] == 64 and turn["new_tokens"] == 16 and turn["failures"] == []
    assert turn["turn_ttft_s"] > 0 and turn["target_ttft_s"] is None
    assert turn["offline_turn_ttft_s"] > 0  # the offline bench's, same flags: what the server adds to


def test_a_report_without_a_restore_run_names_the_missing_part(tmp_path: Path) -> None:
    """When the server never came up (a card the model does not fit), the disk and report parts say in one
    line that the restore run is missing, instead of a Python traceback."""
    env = {**os.environ, "QUALIFY_DIR": str(tmp_path / "empty"), "QUALIFY_DISK_DIR": str(tmp_path / "disk")}
    run = _qualify("report", env=env, timeout=60)
    assert run.returncode == 1
    assert "no restore run in" in run.stderr and "Traceback" not in run.stderr, run.stderr
