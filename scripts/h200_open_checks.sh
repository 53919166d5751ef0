#!/usr/bin/env bash
# The GPU checks and measurements the open issues need, in two device calls of under 10 minutes each on an
# H200. Results go to $OUT, logs into $OUT/logs-PART.tgz (the device tool returns at most 8 files); carry
# .whl/ (scripts/gpu_wheels.sh) and set MORION_SOURCE_COMMIT.
#   part1: the gpu-marked engine, speculative, tier, Qwen3.8-Flash-Next and MoE-kernel tests (#8, #7, #9,
#          #6; the MoE test prints fused-vs-grouped timings); speculative decoding with the MTP drafter at a
#          forced acceptance on the 80B preset (#8, `morion bench --workloads spec`, SYNTHETIC); the 64K
#          restore TTFT cold / device / host / disk (#7).
#   part2: the full-size Qwen3.8-Flash-Next preset's memory breakdown and first decode/prefill numbers
#          (#9), and the 80B decode profile with each --moe-kernel (#6).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: h200_open_checks.sh part1|part2}
results=${OUT:-/tmp/morion-open-checks}
out=/tmp/morion-open-checks-logs
source scripts/gpu_env.sh
trap 'tar czf "$results/logs-$part.tgz" -C "$out" . 2>/dev/null' EXIT
pytest=(python3 -m pytest -q -p no:cacheprovider)
if [ "$part" = part1 ]; then
    step gpu-tests 240 "${pytest[@]}" -m gpu tests/engine/test_speculative_gpu.py \
        tests/engine/test_cache_tiers_gpu.py tests/models/test_qwen4_exp_gpu.py \
        tests/ops/test_moe_decode_triton_gpu.py tests/layers/test_moe_kernel_choice.py -s
    step spec 150 python3 -m morion bench --model preset:qwen3-next-80b-a3b --load-format dummy \
        --weight-dtype fp8 --kv-cache-dtype fp8 --kv-cache-tokens 65536 --no-prefix-cache \
        --max-running-requests 4 --cuda-graph-max-batch 4 --workloads spec --speculative mtp --spec-width 3 \
        --spec-mean-accepted 2.58 --concurrency 1,4 --contexts 1024 --output-tokens 256 --repeats 2 \
        --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic --out "$results"
    disk=$(mktemp -d /tmp/morion-restore.XXXX)
    step restore 150 python3 -m morion bench --model preset:qwen3-next-80b-a3b --load-format dummy \
        --weight-dtype fp8 --kv-cache-dtype fp8 --max-running-requests 8 --cuda-graph-max-batch 8 \
        --workloads restore --restore-length 65536 --restore-repeats 2 --host-cache-gb 8 \
        --disk-cache-dir "$disk" --label h200-qwen3-next-80b-a3b-fp8-restore --out "$results"
else
    free -g | head -2 > "$out/host-memory.txt"
    step flash-next 360 python3 -m morion bench --model preset:qwen3.8-flash-next --load-format dummy \
        --weight-dtype fp8 --kv-cache-dtype fp8 --kv-cache-tokens 65536 --max-running-requests 2 \
        --cuda-graph-max-batch 2 --workloads decode,prefill --concurrency 1 --contexts 1024 --output-tokens 64 \
        --repeats 1 --prefill-lengths 1024,8192 --label h200-qwen3.8-flash-next-fp8-first --out "$results"
    step profile-grouped 90 python3 scripts/profile_decode.py preset:qwen3-next-80b-a3b-12l grouped
    step profile-triton 90 python3 scripts/profile_decode.py preset:qwen3-next-80b-a3b-12l triton
fi
