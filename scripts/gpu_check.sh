#!/usr/bin/env bash
# GPU qualification: the gpu-marked tests, then every kernel test of tests/ops compiled for the device
# (on a CPU they run in Triton's interpreter). Logs go to $OUT (default /tmp/morion-gpu-check); the last
# lines are a summary. Wheels in .whl/ (scripts/gpu_wheels.sh) are installed first where present.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/morion-gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target /tmp/morion-site .whl/*.whl
    export PYTHONPATH=/tmp/morion-site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
run() {
    local name=$1
    shift
    timeout "${GPU_CHECK_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
    echo "$name: rc=$? $(grep -E 'passed|failed|error' "$out/$name.log" | tail -1)"
}
run gpu-marked -m gpu tests --ignore=tests/server
run kernels-compiled -m "not gpu" tests/ops
