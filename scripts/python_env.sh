# Which Python morion's scripts install into and run with (sourced by install.sh and test.sh).
#
# The active one (PYTHON, default python3), unless it is an externally managed system Python (PEP 668:
# an EXTERNALLY-MANAGED file beside its standard library) outside any virtual environment: then the
# virtual environment in $MORION_VENV (.venv), which install.sh creates.

MORION_VENV=${MORION_VENV:-.venv}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

base_python() {
    echo "${PYTHON:-python3}"
}

# Prints "yes" when the interpreter refuses pip installs of its own (and is not inside a venv).
externally_managed() {
    "$1" - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print("yes" if os.path.isfile(marker) and not in_venv else "no")
EOF
}

morion_python() {
    local python
    python=$(base_python)
    if [[ "$(externally_managed "$python")" == "yes" ]]; then
        echo "$MORION_VENV/bin/python"
    else
        echo "$python"
    fi
}

# Runs a command, or with MORION_INSTALL_DRY_RUN set only prints it.
run() {
    if [[ -n "${MORION_INSTALL_DRY_RUN:-}" ]]; then
        echo "would run: $*"
    else
        "$@"
    fi
}
