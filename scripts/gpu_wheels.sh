#!/usr/bin/env bash
# Downloads the pure-Python dependencies that a GPU runner without network access lacks into .whl/, to be
# carried there with the working tree (scripts/gpu_env.sh installs them): the engine's, and the server's for
# `morion serve` (scripts/gpu_qualify.sh). Its CUDA torch, triton and transformers are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    gguf==0.19.0 fla-core==0.6.0 einops xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types \
    typing-inspection fastapi starlette uvicorn opentelemetry-api py-spy
ls -la .whl
