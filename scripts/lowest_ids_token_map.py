"""Writes an FR-Spec token map of the `size` lowest ids of a `vocab_size` vocabulary, for random-weight
presets, which have no tokenizer or corpus to build a real map from (`morion frspec build`). The map
only sets the draft head's shape, hence its cost; at a forced acceptance that is all a benchmark
measures. Label results that use it as such.
Usage: python scripts/lowest_ids_token_map.py VOCAB_SIZE SIZE OUT.json"""

from __future__ import annotations

import sys

import numpy as np

from morion.spec.frspec import FORMAT, VERSION, _ids_sha256, write_token_map


def main() -> None:
    vocab_size, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    token_ids = np.arange(size, dtype=np.int64)
    write_token_map(
        {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": {"source": "none: the lowest ids of a random-weight preset", "sha256": None,
                          "vocab_size": vocab_size},
            "size": size,
            "base_count": size,
            "special_ids": [],
            "corpus": None,
            "ids_sha256": _ids_sha256(token_ids),
            "token_ids": token_ids.tolist(),
        },
        path,
    )  # fmt: skip
    print(f"wrote {path}: the {size} lowest of {vocab_size} ids")


if __name__ == "__main__":
    main()
