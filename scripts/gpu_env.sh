# Sourced by the GPU scripts, from the repository root, with $out set: installs the wheels carried in .whl/
# (scripts/gpu_wheels.sh) where present, makes morion importable from here, fills Triton's cache from
# .triton-cache/ where carried (scripts/triton_cache.sh), and defines
# `step NAME SECONDS COMMAND...`: run COMMAND with a time limit, log to $out/NAME.log, print one summary line.
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    # Only where they install (wheels for the GPU box's Python: elsewhere they are not for this one).
    python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target /tmp/morion-site \
        .whl/*.whl 2> /dev/null && export PYTHONPATH=/tmp/morion-site:$PWD PATH=/tmp/morion-site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
# One Triton cache directory on every machine (its group files name kernels by absolute path), filled from
# the parts an earlier machine packed where they were carried in .triton-cache/ (scripts/triton_cache.sh).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/morion-triton-cache}
bash scripts/triton_cache.sh unpack .triton-cache > /dev/null
step() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: rc=$? $(grep -E 'passed|failed|error|agree|\.json' "$out/$name.log" | tail -1 | cut -c1-200)"
}
