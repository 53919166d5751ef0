#!/usr/bin/env bash
# Splits the default model's GGUF (SmolLM2-135M-Instruct, 98 MB: over the device tool's 64 MiB per call)
# into two parts under .device_parts/ (ignored), to reach a warm device machine in two calls:
#   call 1: carry [".device_parts/part-aa"], command `bash scripts/h200_open_checks.sh part9`;
#   call 2, within the machine's idle window: carry [".whl", ".device_parts/part-ab"], the same command.
# part9 keeps each part it receives in /tmp, and once both are there puts the model into a model store
# (verified against its SHA-256 when the bench loads it) and runs the n-gram speculative bench.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(python3 -c 'from morion.loader.model_store import pull; print(pull())')
rm -rf .device_parts
mkdir -p .device_parts
split -n 2 "$model" .device_parts/part-
ls -l .device_parts
