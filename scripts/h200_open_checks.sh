#!/usr/bin/env bash
# The GPU checks and measurements the open issues need, in one device call (~9 minutes on an H200):
# the gpu-marked speculative and tier tests and the strided-index kernel test (#8, #7), speculative
# decoding with the MTP drafter at a forced acceptance on the 80B preset (#8, `morion bench --workloads
# spec`, SYNTHETIC), the 64K restore TTFT cold / device / host / disk (#7), and the full-size
# Qwen3.8-Flash-Next preset's memory breakdown and first decode/prefill numbers (#9). Results go to $OUT,
# logs into $OUT/logs.tgz (the device tool returns at most 8 files); carry .whl/ (scripts/gpu_wheels.sh)
# and set MORION_SOURCE_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${OUT:-/tmp/morion-open-checks}
out=/tmp/morion-open-checks-logs
source scripts/gpu_env.sh
trap 'tar czf "$results/logs.tgz" -C "$out" . 2>/dev/null' EXIT
pytest=(python3 -m pytest -q -p no:cacheprovider)
step gpu-tests 150 "${pytest[@]}" -m gpu tests/engine/test_speculative_gpu.py tests/engine/test_cache_tiers_gpu.py
step strided-kernels 60 "${pytest[@]}" tests/ops/test_gdn_triton.py -k "strided or decode"
step spec 170 python3 -m morion bench --model preset:qwen3-next-80b-a3b --load-format dummy \
    --weight-dtype fp8 --kv-cache-dtype fp8 --kv-cache-tokens 65536 --no-prefix-cache \
    --max-running-requests 4 --cuda-graph-max-batch 4 --workloads spec --speculative mtp --spec-width 3 \
    --spec-mean-accepted 2.58 --concurrency 1,4 --contexts 1024 --output-tokens 256 --repeats 2 \
    --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic --out "$results"
disk=$(mktemp -d /tmp/morion-restore.XXXX)
step restore 130 python3 -m morion bench --model preset:qwen3-next-80b-a3b --load-format dummy \
    --weight-dtype fp8 --kv-cache-dtype fp8 --max-running-requests 8 --cuda-graph-max-batch 8 \
    --workloads restore --restore-length 65536 --restore-repeats 1 --host-cache-gb 8 --disk-cache-dir "$disk" \
    --label h200-qwen3-next-80b-a3b-fp8-restore-buffered --out "$results"
free -g | head -2 > "$out/host-memory.txt"
step flash-next 170 python3 -m morion bench --model preset:qwen3.8-flash-next --load-format dummy \
    --weight-dtype fp8 --kv-cache-dtype fp8 --max-running-requests 2 --workloads decode,prefill \
    --concurrency 1 --contexts 1024 --output-tokens 32 --repeats 1 --warmup-runs 1 --prefill-lengths 1024,8192 \
    --label h200-qwen3.8-flash-next-fp8-first --out "$results"
