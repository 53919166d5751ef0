"""Content keys of pages: what the host and disk tiers index by (design §3, "Keys and namespaces").

The key of page i is SHA-256 over (key of page i-1, the page's token ids as 4-byte little-endian), with
32 zero bytes before the first page. A page with an image token's cache id (>= 2^32, derived from the
image's content hash: multimodal/prompt_images.py) hashes its ids as 8-byte little-endian instead; text
pages keep the 4-byte form, so their keys, and disk caches written before images existed, are unchanged.
A key therefore names a page *and its whole prefix*: two sequences share the key of page i exactly when
they agree on every token up to the end of page i. A state snapshot
taken after n tokens (n a multiple of the page size) is keyed by the key of page n / page_size - 1, the
page it ends on. Keys carry no model identity: the disk tier separates models by namespace directory,
and the host tier belongs to one engine.

A request with a cache salt (`SamplingParams.cache_salt`, vLLM's `cache_salt`) starts its chain from
`chain_root(salt)` instead of the 32 zero bytes: its keys, hence its pages and snapshots on the host and
disk tiers, are shared only with requests of the same salt (the radix tree separates chains by the same
root). Unsalted chains keep the zero root, so their keys are those of before salts existed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_KEY = bytes(32)
KEY_BYTES = 32
_WIDE_ID = 1 << 32  # cache ids of image tokens (multimodal/prompt_images.py) are this or above
# Hashed before a salt, so that a salted root is no key a chain of pages could reach (a page key hashes
# 32 bytes of key, then token ids).
_SALT_DOMAIN = b"morion cache_salt\0"


def chain_root(cache_salt: str | None) -> bytes:
    """The key before a chain's first page: ROOT_KEY without a salt, else SHA-256 over a domain tag and
    the salt's UTF-8."""
    if cache_salt is None:
        return ROOT_KEY
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"a cache salt is a non-empty string, got {cache_salt!r}")
    return hashlib.sha256(_SALT_DOMAIN + cache_salt.encode()).digest()


def extend_page_keys(
    keys: list[bytes], token_ids: Sequence[int], page_size: int, num_pages: int, root: bytes = ROOT_KEY
) -> list[bytes]:
    """Extend `keys` (the keys of the first len(keys) pages of `token_ids`, in the chain that starts at
    `root`: `chain_root`) in place to `num_pages` keys, and return it. Needs `num_pages * page_size <=
    len(token_ids)`."""
    start = len(keys)
    if num_pages <= start:
        return keys
    if num_pages * page_size > len(token_ids):
        raise ValueError(f"{num_pages} pages of {page_size} need more than {len(token_ids)} tokens")
    ids = np.asarray(token_ids[start * page_size : num_pages * page_size], dtype=np.int64)
    previous = keys[-1] if keys else root
    if not len(ids) or ids.max() < _WIDE_ID:
        data, stride = ids.astype("<u4").tobytes(), page_size * 4
        for offset in range(0, len(data), stride):
            previous = hashlib.sha256(previous + data[offset : offset + stride]).digest()
            keys.append(previous)
        return keys
    for page in ids.reshape(-1, page_size):
        data = page.astype("<u8" if page.max() >= _WIDE_ID else "<u4").tobytes()
        previous = hashlib.sha256(previous + data).digest()
        keys.append(previous)
    return keys


def page_keys(token_ids: Sequence[int], page_size: int, root: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of every full page of `token_ids`, in the chain that starts at `root`."""
    return extend_page_keys([], token_ids, page_size, len(token_ids) // page_size, root)
