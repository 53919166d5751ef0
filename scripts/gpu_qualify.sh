#!/usr/bin/env bash
# One command qualifies a GPU build where users run it: `morion serve` with a hybrid model, FP8 weights and
# K/V, host and disk tiers, checked by `morion validate` (docs/validate.md, README "Qualify a GPU build").
#
#   bash scripts/gpu_qualify.sh MODEL [PART...]
#
# MODEL: 80b (preset:qwen3-next-80b-a3b), 80b-12l (its 12-layer preset, for a card the whole model does
# not fit), flash-next (preset:qwen3.8-flash-next, shorter), flash-next-12l (its 12 layers), or cpu-smoke
# (the default model on a CPU: checks this script itself). PARTs, in the order given (default: all):
#   restore: restore over generated token-id conversations (cold, device and host hits; every answer
#            compared with its cold one, logprob for logprob) with soak's clients running beside it; the
#            server stops at the end, its disk writes finished;
#   disk:    a new server on the same disk cache (a restart), and the disk hit of every conversation
#            (`morion validate restore --restore-resume` of the restore part's results);
#   perf:    the decode sweep through the server (`morion validate perf`); with QUALIFY_PROFILE_S=N, py-spy
#            (where installed and allowed to attach) samples the server for its first N seconds into
#            perf-profile.txt (collapsed stacks per thread);
#   offline: `morion bench` in-process with the same engine flags, on the same machine;
#   report:  all of it into results/<date>-<label>.json + .md (python -m morion.validate.qualify): exit 1 on
#            any wrong answer, too few hits per tier, a failed soak or invalid perf figures;
#   all:     restore disk perf offline report.
# On the H200, `restore` fills one device call (about 8 minutes for 80b) and `disk perf offline report` the
# next, on the same machine (its disk holds the cache: chain the calls while it stays warm).
# Results and logs stay in $QUALIFY_DIR (default /tmp/morion-qualify) from one call to the next; where $OUT is
# set (the device tool's folder that comes back), each invocation ends by packing that directory into
# $OUT/qualify-<time>.tgz. Carry .whl/ (scripts/gpu_wheels.sh); set MORION_SOURCE_COMMIT where the tree
# arrives without its history.
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: gpu_qualify.sh 80b|80b-12l|flash-next|flash-next-12l|cpu-smoke [restore|disk|perf|offline|report|all]...}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(all)
out=${QUALIFY_DIR:-/tmp/morion-qualify}
back=${OUT:-}
source scripts/gpu_env.sh
port=${QUALIFY_PORT:-8765}
url=http://127.0.0.1:$port
disk=${QUALIFY_DISK_DIR:-/tmp/morion-qualify-disk}
mkdir -p "$disk"
fp8=(--weight-dtype fp8 --kv-cache-dtype fp8)
# Soak's clients run beside restore: the other traffic a restored answer must be immune to. Not on a CPU,
# whose BLAS computes a row differently at other batch sizes (docs/validate.md).
beside=(--soak-during-restore)
case "$model" in
80b)
    label=h200-qualify-qwen3-next-80b-a3b
    engine=(--model preset:qwen3-next-80b-a3b "${fp8[@]}" --host-cache-gb 24 --max-running-requests 16
        --cuda-graph-max-batch 16)
    restore=(--restore-conversations 100 --restore-lengths 1024:65536 --restore-group 10)
    min_hits=100  # per tier: issue #20's bar
    # Long replies, few requests: each one leaves two 75 MB snapshots in the host and disk tiers, which must
    # still hold every conversation of restore at its disk step.
    soak=(--soak-clients 8 --soak-minutes 5 --soak-turn-tokens 256 --soak-max-tokens 2048)
    # Cold prefill at issue #24's lengths: TTFT at 1K, tok/s at 8K and 64K.
    perf=(--perf-concurrency 1,4,8 --perf-contexts 1024 --perf-output-tokens 256 --perf-repeats 2
        --perf-prefill-lengths 1024,8192,65536)
    # --logprobs 0: the server, serving a preset without a tokenizer, is timed through `logprobs: 0`;
    # the offline engine does the same work (a log-softmax per step), so the ratio compares like with like.
    offline=(--concurrency 1,4,8 --contexts 1024 --output-tokens 256 --repeats 2 --prefill-lengths 1024
        --logprobs 0)
    # Issue #24's agent turn through the server: 1K new tokens on a cached 32K conversation (target 100 ms).
    turn=(--turn-prefix 32768 --turn-new 1024)
    turn_target_ms=100
    ;;
80b-12l)
    # 12 of the 80B preset's 48 layers (19 GiB of FP8 weights): the same checks on a card that the whole
    # model does not fit (an H100 when no H200 comes). A check of the serving path's answers; its speed is
    # not the 80B's.
    label=gpu-qualify-qwen3-next-80b-a3b-12l
    engine=(--model preset:qwen3-next-80b-a3b-12l "${fp8[@]}" --host-cache-gb 24 --max-running-requests 16
        --cuda-graph-max-batch 16)
    restore=(--restore-conversations 30 --restore-lengths 1024:65536 --restore-group 10)
    min_hits=30
    soak=(--soak-clients 8 --soak-minutes 2 --soak-turn-tokens 256 --soak-max-tokens 2048)
    perf=(--perf-concurrency 1,4,8 --perf-contexts 1024 --perf-output-tokens 256 --perf-repeats 2
        --perf-prefill-lengths 1024,8192)
    offline=(--concurrency 1,4,8 --contexts 1024 --output-tokens 256 --repeats 2 --prefill-lengths 1024
        --logprobs 0)
    turn=(--turn-prefix 32768 --turn-new 1024)
    turn_target_ms=
    ;;
flash-next-12l)
    # 12 of Flash-Next's 48 layers: its serving path's answers (the hyper-connection mix, QSA, the PLE
    # rows) on a card that the whole model does not fit. A check of answers; its speed is not Flash-Next's.
    label=gpu-qualify-qwen3.8-flash-next-12l
    engine=(--model preset:qwen3.8-flash-next-12l "${fp8[@]}" --host-cache-gb 16 --max-running-requests 8
        --cuda-graph-max-batch 8)
    restore=(--restore-conversations 30 --restore-lengths 1024:32768 --restore-group 10)
    min_hits=30
    soak=(--soak-clients 4 --soak-minutes 2 --soak-turn-tokens 512 --soak-max-tokens 512)
    # Two runs a point: with one, session 38's two machines read C1 7% apart the other way from its A/B.
    perf=(--perf-concurrency 1,4 --perf-contexts 1024 --perf-output-tokens 128 --perf-repeats 2
        --perf-prefill-lengths 1024,8192)
    offline=(--concurrency 1,4 --contexts 1024 --output-tokens 128 --repeats 2 --prefill-lengths 1024
        --logprobs 0)
    turn=(--turn-prefix 32768 --turn-new 1024)
    turn_target_ms=
    ;;
flash-next)
    label=h200-qualify-qwen3.8-flash-next
    engine=(--model preset:qwen3.8-flash-next "${fp8[@]}" --host-cache-gb 16 --max-running-requests 8
        --cuda-graph-max-batch 8)
    restore=(--restore-conversations 30 --restore-lengths 1024:32768 --restore-group 10)
    min_hits=30  # the shorter run: every conversation a hit on every tier
    soak=(--soak-clients 4 --soak-minutes 2 --soak-turn-tokens 512 --soak-max-tokens 512)
    perf=(--perf-concurrency 1,4,8 --perf-contexts 1024 --perf-output-tokens 128 --perf-repeats 2
        --perf-prefill-lengths 1024,8192,32768)  # issue #24's lengths for Flash-Next
    offline=(--concurrency 1,4,8 --contexts 1024 --output-tokens 128 --repeats 2 --prefill-lengths 1024
        --logprobs 0)  # as for 80b
    turn=(--turn-prefix 32768 --turn-new 1024)
    turn_target_ms=200
    ;;
cpu-smoke)
    label=cpu-qualify-smoke
    beside=()
    engine=(--device cpu --kv-cache-tokens 4096 --max-model-len 1024 --host-cache-gb 0.25)
    restore=(--restore-conversations 4 --restore-lengths 40:400 --restore-group 2)
    min_hits=4
    soak=(--soak-clients 2 --soak-minutes 0.3 --soak-turn-tokens 32 --soak-max-tokens 8)
    perf=(--perf-concurrency 1,2 --perf-contexts 64 --perf-output-tokens 8 --perf-repeats 1
        --perf-prefill-lengths 64)
    offline=(--concurrency 1,2 --contexts 64 --output-tokens 8 --repeats 1 --prefill-lengths 64)
    turn=(--turn-prefix 64 --turn-new 16)
    turn_target_ms=
    ;;
*)
    echo "gpu_qualify.sh: unknown model $model (80b, 80b-12l, flash-next, flash-next-12l, cpu-smoke)" >&2
    exit 2
    ;;
esac
# A shorter run of the same checks, to confirm a change within one device call: QUALIFY_CONVERSATIONS=N
# sets restore's conversations and the hits each tier needs, QUALIFY_SOAK_MINUTES soak's length (each
# appended after the model's own flag: the later one wins). The label ends in -short, so that a short run's
# results never stand in for the full one's.
if [ -n "${QUALIFY_CONVERSATIONS:-}${QUALIFY_SOAK_MINUTES:-}" ]; then
    label=$label-short
    if [ -n "${QUALIFY_CONVERSATIONS:-}" ]; then
        restore+=(--restore-conversations "$QUALIFY_CONVERSATIONS")
        min_hits=$QUALIFY_CONVERSATIONS
    fi
    [ -n "${QUALIFY_SOAK_MINUTES:-}" ] && soak+=(--soak-minutes "$QUALIFY_SOAK_MINUTES")
fi
# Engine flags beyond the preset's (QUALIFY_ENGINE_FLAGS, e.g. "--pdl prefetch"), for the server and the
# offline bench alike: a setting qualified before it becomes a default. Its files end in -flags.
if [ -n "${QUALIFY_ENGINE_FLAGS:-}" ]; then
    read -r -a extra_flags <<< "$QUALIFY_ENGINE_FLAGS"
    engine+=("${extra_flags[@]}")
    label=$label-flags
fi
# The disk tier holds every conversation until the disk step: most of the filesystem's free space, measured
# once and kept (measured again at the restart, the tier's own objects would shrink it, and the start-up
# trim would evict what the disk step needs: the first 80b qualification lost its disk step so).
budget_file=$out/disk-budget-gb
if [ ! -s "$budget_file" ]; then
    df -k --output=avail "$disk" | tail -1 | awk '{printf "%d\n", $1 / 1048576 * 0.85}' > "$budget_file"
fi
disk_gb=$(cat "$budget_file")
serve_args=("${engine[@]}" --disk-cache-dir "$disk" --disk-cache-gb "$disk_gb")
serve_command="morion serve ${serve_args[*]} --port $port"

server_up() {  # LOG: `morion serve` in the background unless one of this script's is running; waits for /health
    if [ -f "$out/server.pid" ] && kill -0 "$(cat "$out/server.pid")" 2> /dev/null; then return 0; fi
    setsid python3 -m morion serve "${serve_args[@]}" --port "$port" > "$1" 2>&1 &
    echo $! > "$out/server.pid"
    for _ in $(seq 1200); do
        if curl -sf "$url/health" > /dev/null; then return 0; fi
        if ! kill -0 "$(cat "$out/server.pid")" 2> /dev/null; then
            echo "morion serve exited while starting: $(tail -5 "$1")" >&2
            return 1
        fi
        sleep 1
    done
    echo "morion serve was not ready in 20 minutes" >&2
    return 1
}

stop_server() {  # SIGTERM drains and exits 0; the engine finishes its disk writes first
    [ -f "$out/server.pid" ] || return 0
    local pid
    pid=$(cat "$out/server.pid")
    rm -f "$out/server.pid"
    kill -TERM "$pid" 2> /dev/null || return 0
    for _ in $(seq 600); do kill -0 "$pid" 2> /dev/null || return 0; sleep 1; done
    echo "morion serve did not stop in 10 minutes; killing it" >&2
    kill -KILL "$pid"
}
finish() {
    stop_server
    if [ -n "$back" ] && [ "$back" != "$out" ]; then tar czf "$back/qualify-$(date +%H%M%S).tgz" -C "$out" .; fi
}
trap finish EXIT
trap 'exit 143' TERM INT  # a time limit still packs what is there

restore_part() {
    server_up "$out/serve.log" || return 1
    python3 -m morion validate restore soak --url "$url" "${beside[@]}" --soak-prompts token-ids \
        "${restore[@]}" "${soak[@]}" --label "$label-restore" --out "$out" 2>&1 | tee "$out/validate-restore.log"
    local status=${PIPESTATUS[0]}
    stop_server  # the disk step needs a new process: a restart
    return "$status"
}

restore_run() {  # the restore part's JSON, the newest; else one line on stderr and status 1
    local restored
    restored=$(ls -t "$out"/*-validate-"$label"-restore.json 2> /dev/null | head -1)
    [ -n "$restored" ] || { echo "gpu_qualify.sh: no restore run in $out (the restore part failed: see its serve.log)" >&2; return 1; }
    echo "$restored"
}

disk_part() {
    local restored
    restored=$(restore_run) || return 1
    server_up "$out/serve-restarted.log" || return 1
    python3 -m morion validate restore --url "$url" --restore-resume "$restored" --label "$label-disk" \
        --out "$out" 2>&1 | tee "$out/validate-disk.log"
    return "${PIPESTATUS[0]}"
}

profile_server() {  # SECONDS: py-spy samples the server's processes (front end, engine) into $out, if it can
    command -v py-spy > /dev/null || { echo "profile: no py-spy (GPU_WHEELS_PROFILER=1 bash scripts/gpu_wheels.sh carries it)"; return 0; }
    py-spy record --pid "$(cat "$out/server.pid")" --subprocesses --threads --nonblocking --rate 250 \
        --duration "$1" --format raw -o "$out/perf-profile.txt" > "$out/perf-profile.log" 2>&1 ||
        echo "profile: py-spy could not sample the server: $(tail -2 "$out/perf-profile.log")"
}

perf_part() {
    server_up "$out/serve-perf.log" || return 1
    # Optional (QUALIFY_PROFILE_S): a sampled profile of the server while perf runs, beside its figures.
    [ -n "${QUALIFY_PROFILE_S:-}" ] && profile_server "$QUALIFY_PROFILE_S" &
    python3 -m morion validate perf --url "$url" "${perf[@]}" --label "$label-perf" --out "$out" 2>&1 |
        tee "$out/validate-perf.log"
    local status=${PIPESTATUS[0]}
    # Issue #24's agent turn, through the same server: reported beside the verdict, not part of it.
    python3 -m morion bench --url "$url" --workloads turn "${turn[@]}" --repeats 2 --label "$label-turn" --out "$out" 2>&1 |
        tee "$out/turn.log"
    return "$status"
}

offline_part() {
    stop_server  # the GPU for the in-process engine
    # The same engine flags as the server's, disk tier included (a directory of its own); the agent turn
    # too, so that the report sets what the server adds to it beside the server's.
    python3 -m morion bench "${engine[@]}" --disk-cache-dir "$disk-offline" --disk-cache-gb "$disk_gb" --workloads decode,prefill,turn "${offline[@]}" "${turn[@]}" --label "$label-offline" \
        --out "$out" 2>&1 | tee "$out/offline.log"
}

report_part() {
    # restore + soak, then the disk step's run (its restore suite, the whole one, replaces the first), perf.
    local restored disk perf offline turned
    restored=$(restore_run) || return 1
    disk=$(ls -t "$out"/*-validate-"$label"-disk.json 2> /dev/null | head -1)
    perf=$(ls -t "$out"/*-validate-"$label"-perf.json 2> /dev/null | head -1)
    offline=$(ls -t "$out"/*-"$label"-offline.json 2> /dev/null | head -1)
    turned=$(ls -t "$out"/*-"$label"-turn.json 2> /dev/null | head -1)
    python3 -m morion.validate.qualify --validate "$restored" ${disk:+--validate "$disk"} ${perf:+--validate "$perf"} \
        ${offline:+--offline "$offline"} ${turned:+--turn "$turned"} \
        ${turn_target_ms:+--turn-target-ms "$turn_target_ms"} --label "$label" --serve-command "$serve_command" \
        --min-hits "${QUALIFY_MIN_HITS:-$min_hits}" --out "$out"
}

status=0
for part in "${parts[@]}"; do
    case "$part" in
    restore) restore_part || status=1 ;;
    disk) disk_part || status=1 ;;
    perf) perf_part || status=1 ;;
    offline) offline_part || status=1 ;;
    report) report_part || status=1 ;;
    all)
        for each in restore_part disk_part perf_part offline_part report_part; do "$each" || status=1; done
        ;;
    *) echo "gpu_qualify.sh: unknown part $part (restore, disk, perf, offline, report, all)" >&2; exit 2 ;;
    esac
done
exit "$status"
