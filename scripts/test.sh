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
if [ $# -gt 0 ]; then
  exec "$python" -m pytest -q -n auto --dist loadfile "$@"
fi
# The whole suite: the kernel tests' Triton launches are recorded as they run (tests/ops/launch_recorder.py),
# and the sm_90 compile test takes them afterwards instead of running tests/ops a second time for them.
compile_test=tests/ops/test_hopper_compile.py::test_every_kernel_launch_of_the_cpu_kernel_tests_compiles_for_sm90
launches_dir=$(mktemp -d)
trap 'rm -rf "$launches_dir"' EXIT
MORION_LAUNCHES_OUT="$launches_dir/launches.json" "$python" -m pytest -q -n auto --dist loadfile \
  -p tests.ops.launch_recorder --deselect "$compile_test"
MORION_LAUNCHES_FROM="$launches_dir/launches.json" "$python" -m pytest -q -p no:cacheprovider "$compile_test"
