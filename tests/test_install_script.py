"""scripts/install.sh's choices, run for real in dry-run mode (MORION_INSTALL_DRY_RUN prints the commands
instead of running pip): a system Python that refuses pip installs (PEP 668, Debian's /usr/bin/python3)
gets a .venv, any other Python is installed into, and torch is the CPU build on Linux. A full install
downloads hundreds of megabytes, too much for the suite: it is checked by hand on Debian's Python."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBIAN_PYTHON = Path("/usr/bin/python3")


def _dry_run(python: str, *args: str) -> str:
    env = {**os.environ, "PYTHON": python, "MORION_INSTALL_DRY_RUN": "1"}
    done = subprocess.run(
        ["bash", "scripts/install.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def _externally_managed(python: Path) -> bool:
    probe = "import os, sys, sysconfig; print(os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), " \
        "'EXTERNALLY-MANAGED')) and sys.prefix == sys.base_prefix)"  # fmt: skip
    return subprocess.run([str(python), "-c", probe], capture_output=True, text=True).stdout.strip() == "True"


def test_an_ordinary_python_is_installed_into():
    assert (
        sys.prefix != sys.base_prefix or not Path(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED").exists()
    )
    out = _dry_run(sys.executable, "--dev")
    assert "-m venv" not in out and "virtual environment" not in out
    assert "keeping the installed torch" in out  # a torch already there (CUDA or not) is never replaced
    assert f"would run: {sys.executable} -m pip install --disable-pip-version-check --quiet -e .[dev]" in out


@pytest.mark.skipif(
    not DEBIAN_PYTHON.exists() or not _externally_managed(DEBIAN_PYTHON),
    reason="needs an externally managed system Python at /usr/bin/python3",
)
def test_an_externally_managed_python_gets_a_venv_and_the_cpu_torch():
    out = _dry_run(str(DEBIAN_PYTHON))
    assert "/usr/bin/python3 is externally managed: creating a virtual environment in .venv" in out
    assert "would run: /usr/bin/python3 -m venv .venv" in out
    torch_line = next(line for line in out.splitlines() if "torch==" in line)
    if platform.system() == "Linux":
        assert "torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert torch_line.startswith("would run: .venv/bin/python -m pip install")
    assert "would run: .venv/bin/python -m pip install --disable-pip-version-check --quiet -e ." in out
    assert "activate it with  . .venv/bin/activate" in out
    # test.sh then lints and tests with the same interpreter.
    chosen = subprocess.run(
        ["bash", "-c", "source scripts/python_env.sh && morion_python"],
        cwd=REPO, env={**os.environ, "PYTHON": str(DEBIAN_PYTHON)}, capture_output=True, text=True,
    )  # fmt: skip
    assert chosen.stdout.strip() == ".venv/bin/python"
