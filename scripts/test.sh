#!/usr/bin/env bash
# Installs morion with its test tools, then lints and runs the whole test suite (GPU tests skip on CPU),
# spread over the machine's cores (pytest-xdist).
# Runs in the Python that install.sh installs into (scripts/python_env.sh: .venv for an externally
# managed system Python).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
bash scripts/install.sh --dev
python=$(morion_python)
"$python" -m ruff check .
"$python" -m ruff format --check .
# One worker per core, each taking whole files (a module's shared server starts once); -n 0 runs serially.
"$python" -m pytest -q -n auto --dist loadfile "$@"
