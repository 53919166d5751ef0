#!/usr/bin/env bash
# Installs morion (editable) into the active Python environment.
#
# Where that Python is a system one that refuses pip installs (PEP 668 "externally managed": Debian's and
# Ubuntu's python3) and no virtual environment is active, it creates .venv in the repository, installs
# there, and says how to activate it.
#
# Where no torch is installed, the CPU build goes in first, from PyTorch's CPU index on Linux (a bare
# `torch` requirement resolves PyPI's multi-GB CUDA build there); PyPI's wheels elsewhere are CPU builds.
# A torch that is already installed (a CUDA build, say) is kept.
#
# Usage: bash scripts/install.sh [--dev]   (--dev adds the test and lint tools)
# Environment: PYTHON (the interpreter to start from, default python3), MORION_VENV (the directory for
# the environment it creates, default .venv), MORION_INSTALL_DRY_RUN=1 (print what it would run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh

extras=""
if [[ "${1:-}" == "--dev" ]]; then extras="[dev]"; fi

python=$(morion_python)
if [[ "$python" == "$MORION_VENV/bin/python" ]]; then
    if [[ ! -x "$python" ]]; then
        echo "$(base_python) is externally managed: creating a virtual environment in $MORION_VENV" >&2
        run "$(base_python)" -m venv "$MORION_VENV" || {
            echo "install.sh: error: could not create $MORION_VENV (on Debian/Ubuntu: apt install python3-venv)" >&2
            exit 1
        }
    else
        echo "using the virtual environment in $MORION_VENV" >&2
    fi
fi

pip=("$python" -m pip install --disable-pip-version-check --quiet)
if "$python" -c "import torch" 2>/dev/null; then
    echo "keeping the installed torch $("$python" -c "import torch; print(torch.__version__)")" >&2
else
    if [[ "$(uname -s)" == "Linux" ]]; then
        echo "installing torch 2.13.0, CPU build (PyTorch's CPU index)" >&2
        run "${pip[@]}" "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX"
    else
        echo "installing torch 2.13.0 (PyPI's build for $(uname -s) runs on the CPU)" >&2
        run "${pip[@]}" "torch==2.13.0"
    fi
fi
echo "installing morion${extras}" >&2
run "${pip[@]}" -e ".${extras}"
if [[ "$python" == "$MORION_VENV/bin/python" ]]; then
    echo "morion is installed in $MORION_VENV: activate it with  . $MORION_VENV/bin/activate" >&2
fi
