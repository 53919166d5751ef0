"""Page keys by cache salt: unsalted keys stay what they were before salts existed (disk caches written
then stay valid), and a salt seeds a chain of its own."""

from __future__ import annotations

import pytest

from morion.cache.page_keys import ROOT_KEY, chain_root, extend_page_keys, page_keys

# What page_keys returned before cache salts existed (commit 5deb1c7), for a text prompt and for pages
# with an image token's 8-byte cache id: a change here orphans every disk cache already written.
TEXT_KEYS = [
    "d3e2a97933ebedb0c193fd3dd4fb0317ab8aa820ad40041fe4c8bf32a1769546",
    "ec55248a9d4fda957fa5ace3c293dfd6062974881fe02df9b7a9d5bf8984cb61",
]
IMAGE_KEYS = [
    "edcb278a6266e31c4831a0bcb1c7fd29c93ee0b0e319500f71cb70d7a473fe3a",
    "89d1b4406e5dfd40a0b0d3a72f6d976dea7c7b85c7de798d3d4a3da006ecdc0d",
]
TEXT = list(range(1000, 1040))
WITH_IMAGE = [5, 2**32 + 7, 9, 11, 3, 1, 4, 1]


def test_unsalted_keys_are_the_keys_of_before_salts() -> None:
    assert [key.hex() for key in page_keys(TEXT, 16)] == TEXT_KEYS
    assert [key.hex() for key in page_keys(WITH_IMAGE, 4)] == IMAGE_KEYS
    assert chain_root(None) == ROOT_KEY
    assert page_keys(TEXT, 16, chain_root(None)) == page_keys(TEXT, 16)


def test_a_salt_seeds_a_chain_of_its_own() -> None:
    salted = page_keys(TEXT, 16, chain_root("tenant-a"))
    assert page_keys(TEXT, 16, chain_root("tenant-a")) == salted  # the same salt: the same keys
    others = [page_keys(TEXT, 16), page_keys(TEXT, 16, chain_root("tenant-b"))]
    assert all(not set(salted) & set(keys) for keys in others)  # no page shared with another chain
    assert len({chain_root("a"), chain_root("b"), chain_root("é"), ROOT_KEY}) == 4
    # A request extends its keys: the root matters only for the first page.
    root = chain_root("tenant-a")
    assert extend_page_keys(salted[:1], TEXT, 16, 2, root) == salted


@pytest.mark.parametrize("salt", ["", 7])
def test_a_salt_is_a_non_empty_string(salt) -> None:
    with pytest.raises(ValueError, match="cache salt"):
        chain_root(salt)
