#!/usr/bin/env bash
# Installs morion into the current Python. Where no torch is installed, the CPU build goes in first: a
# bare `torch` requirement would pull a multi-GB CUDA build. Users with a CUDA torch keep theirs.
# Usage: bash scripts/install.sh [--dev]   (--dev adds the test and lint tools)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
pip=("$python" -m pip install --disable-pip-version-check --quiet)
if ! "$python" -c "import torch" 2>/dev/null; then
    echo "installing torch==2.13.0" >&2
    "${pip[@]}" torch==2.13.0
fi
extras=""
if [[ "${1:-}" == "--dev" ]]; then extras="[dev]"; fi
echo "installing morion${extras}" >&2
"${pip[@]}" -e ".${extras}"
