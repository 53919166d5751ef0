"""Reading image URLs (server/chat_images.py) from real files and data: URLs: file:// only under the allowed
directory (symlinks resolved), data: URLs of the three formats, everything else refused with a reason."""

from __future__ import annotations

import base64

import pytest

from morion.multimodal.image_decode import ImageError
from morion.server.chat_images import read_image_url
from tests import tiny_vlm

PNG = tiny_vlm.png(8, 8, seed=0)


def test_file_urls_are_read_only_under_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    assert read_image_url(f"file://{allowed}/cat.png", allowed) == PNG
    assert read_image_url(f"file://localhost{allowed}/cat.png", allowed) == PNG
    for url, words in [
        (f"file://{outside}/secret.png", "outside the allowed"),
        (f"file://{allowed}/../private/secret.png", "outside the allowed"),
        (f"file://{allowed}/link.png", "outside the allowed"),
        (f"file://{allowed}/missing.png", "cannot read"),
        (f"file://otherhost{allowed}/cat.png", "not a host"),
    ]:
        with pytest.raises(ImageError, match=words):
            read_image_url(url, allowed)
    with pytest.raises(ImageError, match="--allowed-local-media-path"):
        read_image_url(f"file://{allowed}/cat.png", None)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64," + base64.b64encode(PNG).decode(), None),
        ("data:image/webp;base64,AAAA", None),
        ("data:image/png," + "x" * 8, "base64-encoded"),
        ("data:text/plain;base64,AAAA", "unsupported image type"),
        ("data:image/png;base64", "comma"),
        ("http://127.0.0.1/cat.png", "does not fetch"),
        ("ftp://host/cat.png", "unsupported image URL scheme"),
        ("cat.png", "unsupported image URL scheme"),
    ],
)
def test_data_and_other_urls(url, words):
    if words is None:
        assert read_image_url(url, None) == base64.b64decode(url.split(",", 1)[1])
    else:
        with pytest.raises(ImageError, match=words):
            read_image_url(url, None)
