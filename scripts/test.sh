#!/usr/bin/env bash
# Installs morion with its test tools, then lints and runs the whole test suite (GPU tests skip on CPU).
# Runs in the Python that install.sh installs into (scripts/python_env.sh: .venv for an externally
# managed system Python).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
bash scripts/install.sh --dev
python=$(morion_python)
"$python" -m ruff check .
"$python" -m ruff format --check .
"$python" -m pytest -q "$@"
