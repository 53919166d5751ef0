# Sourced by the GPU scripts, from the repository root, with $out set: installs the wheels carried in .whl/
# (scripts/gpu_wheels.sh) where present, makes morion importable from here, and defines
# `step NAME SECONDS COMMAND...`: run COMMAND with a time limit, log to $out/NAME.log, print one summary line.
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    # Only where they install (wheels for the GPU box's Python: elsewhere they are not for this one).
    python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target /tmp/morion-site \
        .whl/*.whl 2> /dev/null && export PYTHONPATH=/tmp/morion-site:$PWD PATH=/tmp/morion-site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
step() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: rc=$? $(grep -E 'passed|failed|error|agree|\.json' "$out/$name.log" | tail -1 | cut -c1-200)"
}
