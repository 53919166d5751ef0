#!/usr/bin/env bash
# Triton's compiled kernels carried from one device machine to the next. Each machine starts bare, and a
# model's first warm-up there compiles every kernel: Flash-Next's took 93.8 s against 8.9 s with a warm
# cache (session 22), paid again on every machine of a session.
#
#   bash scripts/triton_cache.sh pack DIR     # the cache into DIR/triton-cache.tgz.partNN, 15 MiB each
#                                             # (the device tool brings back files of up to 16 MiB)
#   bash scripts/triton_cache.sh unpack DIR   # DIR's parts into the cache, where the cache is still empty
#
# Packed is what a cache hit reads: each kernel's binary (.cubin), its metadata and the group file naming
# them (.json); Triton skips a group's files that are missing (its IR). A group file names its files by
# absolute path, so both ends use one cache directory: $TRITON_CACHE_DIR, /tmp/morion-triton-cache unless
# set (scripts/gpu_env.sh sets it). Triton's cache key covers the kernel's source, its constants, the GPU
# and Triton's version, so a kernel packed for other code is never hit, only unused. More than
# MAX_MIB (45: the carried paths of a device call hold 64 MiB, the wheels ~12) is not packed.
set -uo pipefail
cache=${TRITON_CACHE_DIR:-/tmp/morion-triton-cache}
max_mib=45

case "${1:-}" in
pack)
    dir=${2:?usage: triton_cache.sh pack DIR}
    [ -d "$cache" ] || { echo "triton_cache: no Triton cache at $cache, nothing packed"; exit 0; }
    mkdir -p "$dir" && rm -f "$dir"/triton-cache.tgz.part*
    (cd "$cache" && find . -type f -name '*.cubin' -o -type f -name '*.json' | sort | tar czf - -T -) |
        split -b 15m -d - "$dir/triton-cache.tgz.part"
    kib=$(du -ck "$dir"/triton-cache.tgz.part* | tail -1 | cut -f1)
    if [ "$kib" -gt $((max_mib * 1024)) ]; then
        rm -f "$dir"/triton-cache.tgz.part*
        echo "triton_cache: $((kib / 1024)) MiB packed, more than $max_mib MiB to carry: dropped"
        exit 0
    fi
    echo "triton_cache: $(find "$cache" -name '*.cubin' | wc -l) kernels from $cache in $((kib / 1024 + 1)) MiB: $(ls "$dir"/triton-cache.tgz.part* | xargs -n1 basename | tr '\n' ' ')"
    ;;
unpack)
    dir=${2:?usage: triton_cache.sh unpack DIR}
    compgen -G "$dir/triton-cache.tgz.part*" > /dev/null || { echo "triton_cache: no parts in $dir"; exit 0; }
    if [ -n "$(ls -A "$cache" 2> /dev/null)" ]; then
        echo "triton_cache: $cache already holds kernels, left as it is"
        exit 0
    fi
    mkdir -p "$cache"
    cat "$dir"/triton-cache.tgz.part* | tar xzf - -C "$cache" &&
        echo "triton_cache: $(find "$cache" -name '*.cubin' | wc -l) kernels into $cache"
    ;;
*)
    echo "usage: triton_cache.sh pack DIR | unpack DIR" >&2
    exit 2
    ;;
esac
