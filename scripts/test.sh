#!/usr/bin/env bash
# Installs morion with its test tools, then lints and runs the whole test suite (GPU tests skip on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
bash scripts/install.sh --dev
"$python" -m ruff check .
"$python" -m ruff format --check .
"$python" -m pytest -q "$@"
