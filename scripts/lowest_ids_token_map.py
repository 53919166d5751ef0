"""Writes an FR-Spec token map of the `size` lowest ids of a `vocab_size` vocabulary, for random-weight
presets, which have no tokenizer or corpus to build a real map from (`morion frspec build`). The map
only sets the draft head's shape, hence its cost; at a forced acceptance that is all a benchmark
measures. Label results that use it as such.
Usage: python scripts/lowest_ids_token_map.py VOCAB_SIZE SIZE OUT.json"""

from __future__ import annotations

import sys

from morion.spec.frspec import lowest_ids_map, write_token_map


def main() -> None:
    vocab_size, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    write_token_map(lowest_ids_map(vocab_size, size), path)
    print(f"wrote {path}: the {size} lowest of {vocab_size} ids")


if __name__ == "__main__":
    main()
