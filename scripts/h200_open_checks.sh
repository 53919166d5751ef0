#!/usr/bin/env bash
# The GPU checks and measurements the open issues need, in one device call (~10 minutes on an H200):
# the gpu-marked engine tests (speculative verify graphs #8, FP8 K/V host restores #7, grammar mask #11),
# FP8-vs-BF16 K/V top-1 agreement with its BF16 control on the 12-layer preset (#6), the 64K restore TTFT
# cold / device / host / disk (#7), and speculative decoding with the synthetic drafter on the 80B preset
# (#8). Results go to $OUT, logs into $OUT/logs.tgz (the device tool returns at most 8 files); carry .whl/
# (scripts/gpu_wheels.sh) and set MORION_SOURCE_COMMIT to the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${OUT:-/tmp/morion-open-checks}
out=/tmp/morion-open-checks-logs
source scripts/gpu_env.sh
trap 'tar czf "$results/logs.tgz" -C "$out" . 2>/dev/null' EXIT
pytest=(python3 -m pytest -q -p no:cacheprovider)
step gpu-engine-tests 240 "${pytest[@]}" -m gpu tests/engine
step kv-agreement 240 python3 scripts/kv_fp8_agreement.py --model preset:qwen3-next-80b-a3b-12l \
    --weight-dtype fp8 --prompts 4 --steps 256 --out "$results/kv-fp8-agreement.json"
disk=$(mktemp -d /tmp/morion-restore.XXXX)
step restore 240 python3 -m morion bench --model preset:qwen3-next-80b-a3b --load-format dummy \
    --weight-dtype fp8 --kv-cache-dtype fp8 --max-running-requests 8 --cuda-graph-max-batch 8 \
    --workloads restore --restore-length 65536 --restore-repeats 2 --host-cache-gb 8 --disk-cache-dir "$disk" \
    --label h200-qwen3-next-80b-a3b-fp8-restore --out "$results"
step spec 240 python3 scripts/spec_bench.py --model preset:qwen3-next-80b-a3b --weight-dtype fp8 \
    --kv-cache-dtype fp8 --concurrency 1,4 --output-tokens 256 --repeats 2 --out "$results"
