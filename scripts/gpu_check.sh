#!/usr/bin/env bash
# GPU qualification: the gpu-marked tests, then every kernel test of tests/ops compiled for the device
# (on a CPU they run in Triton's interpreter). Logs go to $OUT (default /tmp/morion-gpu-check); the last
# lines are a summary. Carried wheels: scripts/gpu_env.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/morion-gpu-check}
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
pytest=(python3 -m pytest -q -p no:cacheprovider)
# Files that import the server tests' fixtures need the openai client, which GPU machines lack.
step gpu-marked "${GPU_CHECK_TIMEOUT:-300}" "${pytest[@]}" -m gpu tests --ignore=tests/server --ignore=tests/validate \
    --ignore=tests/bench/test_bench_url.py --ignore=tests/loader/test_hf_hub.py
step kernels-compiled "${GPU_CHECK_TIMEOUT:-300}" "${pytest[@]}" -m "not gpu" tests/ops
