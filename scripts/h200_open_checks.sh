#!/usr/bin/env bash
# The GPU measurements the open issues still need, in one device call (~9 minutes on an H200): the grammar
# mask on CUDA (#11), FP8-vs-BF16 K/V top-1 agreement on the 12-layer preset (#6), the transformers
# baseline on the same preset (#6), and the 64K restore TTFT cold / device / host / disk (#7). Results
# and logs go to $OUT; carry .whl/ (scripts/gpu_wheels.sh) and set MORION_SOURCE_COMMIT to the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/morion-open-checks}
source scripts/gpu_env.sh
step grammar-mask 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_grammar_mask_devices.py
step kv-agreement 150 python3 scripts/kv_fp8_agreement.py --model preset:qwen3-next-80b-a3b-12l \
    --weight-dtype fp8 --prompts 4 --steps 256 --out "$out/kv-fp8-agreement.json"
step hf-baseline 150 python3 -m morion bench --model preset:qwen3-next-80b-a3b-12l --load-format dummy \
    --max-running-requests 4 --cuda-graph-max-batch 4 --workloads decode --concurrency 1 --contexts 1024 \
    --output-tokens 128 --repeats 3 --baseline hf --label h200-qwen3-next-12l-vs-transformers --out "$out"
disk=$(mktemp -d /tmp/morion-restore.XXXX)
step restore 240 python3 -m morion bench --model preset:qwen3-next-80b-a3b --load-format dummy \
    --weight-dtype fp8 --kv-cache-dtype fp8 --max-running-requests 8 --cuda-graph-max-batch 8 \
    --workloads restore --restore-length 65536 --restore-repeats 2 --host-cache-gb 8 --disk-cache-dir "$disk" \
    --label h200-qwen3-next-80b-a3b-fp8-restore --out "$out"
