#!/usr/bin/env bash
# Downloads the pure-Python dependencies that a GPU runner without network access lacks into .whl/, to be
# carried there with the working tree (scripts/gpu_env.sh installs them): the engine's, and the server's for
# `morion serve` (scripts/gpu_qualify.sh). Its CUDA torch, triton and transformers are used as they are.
# GPU_WHEELS_PROFILER=1 adds py-spy (3 MB; `QUALIFY_PROFILE_S`): the device tool carries at most 64 MiB
# with the tracked tree (~48 MB with results/) and Triton's cache, so only when a profile is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
profiler=()
[ "${GPU_WHEELS_PROFILER:-0}" = 1 ] && profiler=(py-spy)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    gguf==0.19.0 fla-core==0.6.0 einops xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types \
    typing-inspection fastapi starlette uvicorn opentelemetry-api "${profiler[@]}"
ls -la .whl
