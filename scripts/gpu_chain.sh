#!/usr/bin/env bash
# A session's GPU work as one chain of steps that runs in the background on the device machine, so that
# it outlasts a device call (10 minutes at most) and the machine never idles between calls:
#
#   MORION_SOURCE_COMMIT=SHA [CHAIN_REQUIRE_GPU=H200] bash scripts/gpu_chain.sh start STEPS_FILE
#                                                   # first call: copies the tree, starts the steps, returns
#                                                   # (exit 3 at once where the card's name lacks CHAIN_REQUIRE_GPU)
#   bash scripts/gpu_chain.sh wait SECONDS [WORD]   # each later call, issued at once (the machine goes back
#                                                   # after 30 s idle): progress until a status line holds
#                                                   # WORD (default: done) or SECONDS pass, then packs
#
# STEPS_FILE holds one step a line, `NAME SECONDS COMMAND...` (# comments and blank lines skipped). Each
# runs in a copy of the tree (/tmp/morion-chain/tree: the device tool's next call re-sends the working
# tree, which must not change under a running step) with scripts/gpu_env.sh's environment and
# $CHAIN_OUT (/tmp/morion-chain/out) for its files, under `timeout SECONDS`, its output in
# /tmp/morion-chain/logs/NAME.log; a failed step does not stop the chain. Every step sees
# MORION_SOURCE_COMMIT (results' provenance): the device's copy of the tree has no git, so `start` takes
# the commit from that variable, else from git where it runs, and refuses to start without one. /tmp/morion-chain/status gets
# `NAME rc=N SECONDSs` per step and `done` at the end. `wait` prints the status, the running step's last
# lines, and packs logs/ and out/ into $OUT/chain-<time>.tgz (the folder the device tool brings back);
# once the chain is done, also Triton's compiled kernels ($OUT/triton-cache.tgz.partNN,
# scripts/triton_cache.sh): copied into .triton-cache/ here and carried, they spare the next machine's first
# warm-up its compilation (~90 s).
set -uo pipefail
cd "$(dirname "$0")/.."
chain=${CHAIN_DIR:-/tmp/morion-chain}

run_steps() {  # STEPS_FILE: the background runner
    local name limit command start
    MORION_SOURCE_COMMIT=$(cat "$chain/commit")
    export MORION_SOURCE_COMMIT
    while read -r name limit command; do
        [[ -z "$name" || "$name" == \#* ]] && continue
        echo "$name started $(date +%T)" >> "$chain/status"
        start=$(date +%s)
        (cd "$chain/tree" && out="$chain/out" && source scripts/gpu_env.sh > /dev/null 2>&1 &&
            CHAIN_OUT="$chain/out" timeout "$limit" bash -c "$command") > "$chain/logs/$name.log" 2>&1
        echo "$name rc=$? $(($(date +%s) - start))s" >> "$chain/status"
    done < "$1"
    echo "done $(date +%T)" >> "$chain/status"
}

case "${1:-}" in
start)
    steps=${2:?usage: gpu_chain.sh start STEPS_FILE}
    [ -f "$steps" ] || { echo "gpu_chain.sh: no steps file $steps" >&2; exit 2; }
    commit=${MORION_SOURCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
    [ -n "$commit" ] || {
        echo "gpu_chain.sh: no commit for the results' provenance: set MORION_SOURCE_COMMIT (no git here)" >&2
        exit 2
    }
    # CHAIN_REQUIRE_GPU (e.g. H200): steps written for one card refuse another at once (a call for an H200
    # may get an H100, where the full presets do not fit and each step would fail after loading).
    if [ -n "${CHAIN_REQUIRE_GPU:-}" ]; then
        card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)
        [[ "$card" == *"$CHAIN_REQUIRE_GPU"* ]] || {
            echo "gpu_chain.sh: these steps need a card named like $CHAIN_REQUIRE_GPU; this machine has ${card:-no GPU}: not started" >&2
            exit 3
        }
    fi
    rm -rf "$chain" && mkdir -p "$chain/tree" "$chain/logs" "$chain/out"
    # The tree with its carried wheels (.whl), without history or a local virtual environment.
    tar cf - --exclude=./.git --exclude=./.venv . | tar xf - -C "$chain/tree"
    cp "$steps" "$chain/steps"
    echo "$commit" > "$chain/commit"
    : > "$chain/status"
    setsid nohup bash "$chain/tree/scripts/gpu_chain.sh" run "$chain/steps" > "$chain/runner.log" 2>&1 < /dev/null &
    echo "gpu_chain: started $(grep -cvE '^\s*(#|$)' "$steps") steps in $chain"
    ;;
run)
    run_steps "${2:?}"
    ;;
wait)
    limit=${2:?usage: gpu_chain.sh wait SECONDS [WORD]}
    word=${3:-done}
    [ -f "$chain/status" ] || { echo "gpu_chain.sh: no chain started in $chain" >&2; exit 2; }
    start=$(date +%s)
    while [ $(($(date +%s) - start)) -lt "$limit" ] && ! grep -q -- "$word" "$chain/status"; do sleep 2; done
    cat "$chain/status"
    running=$(tail -1 "$chain/status" | awk '$2 == "started" {print $1}')
    [ -n "$running" ] && tail -3 "$chain/logs/$running.log"
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/chain-$(date +%H%M%S).tgz" -C "$chain" logs out status
        # Once the chain is done, its machine's compiled kernels too, for the next machine to carry.
        grep -q "^done" "$chain/status" && bash scripts/triton_cache.sh pack "$OUT"
    fi
    grep -q "^done" "$chain/status"  # exit 0 once the chain has finished
    ;;
*)
    echo "usage: gpu_chain.sh start STEPS_FILE | wait SECONDS [WORD]" >&2
    exit 2
    ;;
esac
