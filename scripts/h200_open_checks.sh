#!/usr/bin/env bash
# The GPU checks and measurements the open issues need, in device calls of under 10 minutes each on
# an H200 (a fresh machine compiles every Triton kernel on first use: the limits allow for it). Results go
# to $OUT, logs into $OUT/logs-PART.tgz (the device tool returns at most 8 files); carry .whl/
# (scripts/gpu_wheels.sh) and set MORION_SOURCE_COMMIT.
#   part1: every gpu-marked test: Qwen3.8-Flash-Next's (decode, verify and MTP draft graphs, the UVA table
#          gather, QSA kernels), then the engine, speculative, tier, sampling and op ones.
#   part2: the op kernel tests compiled for the device; speculative decoding with the MTP drafter at a forced
#          acceptance on the 80B preset (#8, `morion bench --workloads spec`, SYNTHETIC); the 64K restore
#          with the page cache evicted (#7).
#   part3: the full-size Qwen3.8-Flash-Next preset: memory, decode and prefill (1K to 32K), and MTP
#          speculation at a forced acceptance (#9).
#   part4: where Flash-Next's slow prefill goes (12-layer preset, scripts/profile_prefill.py) and where a
#          speculative step goes on the 80B preset (scripts/profile_spec.py).
#   part5: tune the fused MoE tiles for the 80B expert shape (the JSON lands in morion/ops/moe_configs and
#          $OUT), the kernels of the decode, verify and draft graphs and of an eager step by module
#          (scripts/profile_kernels.py), and the
#          attention and MoE op tests compiled for the device.
#   part6: the engine and speculative GPU tests, then part2's speculative bench.
#   part7: part5's MoE tile sweep, with the swapped-operand and GEMV tiles (commit the JSON it writes
#          to $OUT into morion/ops/moe_configs/ before part8).
#   part8: the speculative bench at C1 and C4 with the tuned tiles, then at C1 with FR-Spec's reduced
#          draft head: a map of the 65,536 lowest ids (scripts/lowest_ids_token_map.py; the preset has
#          no tokenizer, and at a forced acceptance only the head's size matters).
#   part9: n-gram speculation at its real acceptance with the default model (SmolLM2-135M) on code-edit
#          prompts, C1 and C2: the model arrives in two calls (scripts/device_model_parts.sh says how);
#          a call that brings the first part only keeps it and stops.
#   part10: part7's tile sweep (exact MMA modes only), the MoE op tests on the GPU with the tiles it
#          chose, part8's speculative bench at C1 and C4, then the engine and speculative GPU tests.
#   part11: where a speculative step's time goes now: device gaps by host phase
#          (scripts/profile_spec_timeline.py, trace in $OUT) and the graphs' kernels by name
#          (scripts/profile_kernels.py).
#   part12: the MoE op tests with the committed tiles, part8's speculative bench at C1 and C4 (3 runs each),
#          then part11's timeline.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: h200_open_checks.sh part1|...|part12}
results=${OUT:-/tmp/morion-open-checks}
out=/tmp/morion-open-checks-logs
source scripts/gpu_env.sh
trap 'tar czf "$results/logs-$part.tgz" -C "$out" . 2>/dev/null' EXIT
pytest=(python3 -m pytest -q -p no:cacheprovider)
fp8=(--load-format dummy --weight-dtype fp8 --kv-cache-dtype fp8)
# The 80B preset's speculative bench (SYNTHETIC: MTP drafts at a forced 2.58 tokens per verify step);
# each part adds --repeats and --label.
spec_bench=(python3 -m morion bench --model preset:qwen3-next-80b-a3b "${fp8[@]}" --kv-cache-tokens 65536
    --no-prefix-cache --max-running-requests 4 --cuda-graph-max-batch 4 --workloads spec --speculative mtp
    --spec-width 3 --spec-mean-accepted 2.58 --concurrency 1,4 --contexts 1024 --output-tokens 256 --out "$results")
spec_timeline=(python3 scripts/profile_spec_timeline.py preset:qwen3-next-80b-a3b 3 2.58 "$results/spec-timeline.json.gz")
moe_gpu_tests=("${pytest[@]}" -m gpu tests/ops/test_moe_decode_triton_gpu.py tests/ops/test_moe_fp8_gpu.py)
spec_gpu_tests=("${pytest[@]}" -m gpu tests/engine/test_speculative_gpu.py tests/engine/test_engine_gpu.py)
# tune_moe SECONDS: the 80B expert shape's tile sweep; the tiles file it writes comes back in $results.
tune_moe() {
    step moe-tune "$1" python3 -m morion.ops.moe_tune --experts 512 --hidden 2048 --intermediate 512 --top-k 10 \
        --dtype fp8 --tokens 1,4
    cp morion/ops/moe_configs/NVIDIA_H200_E512_H2048_I512_fp8.json "$results/"
}
case "$part" in
part1)
    step gpu-flash-next 300 "${pytest[@]}" -m gpu tests/models/test_qwen4_exp_gpu.py
    # tests/server, tests/validate and the bench URL test need the openai client, not carried here.
    step gpu-rest 270 "${pytest[@]}" -m gpu tests --ignore=tests/server --ignore=tests/validate \
        --ignore=tests/bench/test_bench_url.py --ignore=tests/models/test_qwen4_exp_gpu.py
    ;;
part2 | part6)
    if [ "$part" = part2 ]; then
        step ops-compiled 170 "${pytest[@]}" -m "not gpu" tests/ops
    else
        step gpu-spec 240 "${spec_gpu_tests[@]}"
    fi
    step spec 170 "${spec_bench[@]}" --repeats 2 --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic
    [ "$part" = part6 ] && exit 0
    disk=$(mktemp -d /tmp/morion-restore.XXXX)
    step restore 200 python3 -m morion bench --model preset:qwen3-next-80b-a3b "${fp8[@]}" \
        --max-running-requests 8 --cuda-graph-max-batch 8 --workloads restore --restore-length 65536 \
        --restore-repeats 2 --host-cache-gb 8 --disk-cache-dir "$disk" \
        --label h200-qwen3-next-80b-a3b-fp8-restore --out "$results"
    ;;
part3)
    free -g | head -2 > "$out/host-memory.txt"
    step flash-next 560 python3 -m morion bench --model preset:qwen3.8-flash-next "${fp8[@]}" \
        --kv-cache-tokens 65536 --max-running-requests 2 --cuda-graph-max-batch 2 \
        --workloads decode,prefill,spec --speculative mtp --spec-width 3 --spec-mean-accepted 2.58 \
        --concurrency 1 --contexts 1024 --output-tokens 64 --repeats 1 --prefill-lengths 1024,8192,32768 \
        --label h200-qwen3.8-flash-next-fp8 --out "$results"
    ;;
part4)
    step profile-prefill 300 python3 scripts/profile_prefill.py preset:qwen3.8-flash-next-12l 1024
    step profile-spec 200 python3 scripts/profile_spec.py preset:qwen3-next-80b-a3b 3 2.58
    ;;
part5)
    tune_moe 280
    step profile-kernels 200 python3 scripts/profile_kernels.py preset:qwen3-next-80b-a3b 3
    step ops-gpu 150 "${pytest[@]}" -s tests/ops/test_paged_attention_gpu.py tests/ops/test_moe_decode_triton_gpu.py \
        tests/ops/test_paged_attention.py tests/ops/test_moe_decode_triton.py
    ;;
part7)
    tune_moe 560
    ;;
part10)
    tune_moe 200
    step ops-moe 120 "${moe_gpu_tests[@]}"
    step spec 170 "${spec_bench[@]}" --repeats 2 --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic
    step gpu-spec 200 "${spec_gpu_tests[@]}"
    ;;
part11)
    step spec-timeline 240 "${spec_timeline[@]}"
    step profile-kernels 240 python3 scripts/profile_kernels.py preset:qwen3-next-80b-a3b 3
    ;;
part12)
    step ops-moe 120 "${moe_gpu_tests[@]}"
    step spec 230 "${spec_bench[@]}" --repeats 3 --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic-confirm
    step spec-timeline 240 "${spec_timeline[@]}"
    ;;
part8)
    step spec 200 "${spec_bench[@]}" --repeats 2 --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic
    python3 scripts/lowest_ids_token_map.py 151936 65536 "$out/lowest-ids-64k.json"
    step spec-frspec 200 python3 -m morion bench --model preset:qwen3-next-80b-a3b "${fp8[@]}" \
        --kv-cache-tokens 65536 --no-prefix-cache --max-running-requests 1 --cuda-graph-max-batch 1 \
        --workloads spec --speculative mtp --spec-width 3 --spec-mean-accepted 2.58 \
        --spec-token-map "$out/lowest-ids-64k.json" --concurrency 1 --contexts 1024 --repeats 3 \
        --label h200-qwen3-next-80b-a3b-fp8-spec-synthetic-frspec64k --out "$results"
    ;;
part9)
    parts=/tmp/morion-model-parts
    mkdir -p "$parts"
    cp .device_parts/part-* "$parts"/ 2>/dev/null || true
    have=$(find "$parts" -name 'part-*' | wc -l)
    if [ "$have" -lt 2 ]; then
        echo "model parts: $have of 2 on this machine"
        exit 0
    fi
    export MORION_HOME=/tmp/morion-home
    mkdir -p "$MORION_HOME/models/smollm2-135m-instruct"
    cat "$parts"/part-* > "$MORION_HOME/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    step ngram-spec 400 python3 -m morion bench --model smollm2-135m-instruct --device cuda \
        --kv-cache-tokens 8192 --speculative ngram --spec-width 4 --workloads spec --concurrency 1,2 \
        --contexts 1024 --output-tokens 128 --label h200-smollm2-135m-ngram-spec --out "$results"
    ;;
*)
    echo "usage: h200_open_checks.sh part1|part2|...|part12" >&2
    exit 2
    ;;
esac
