"""`--model ORG/NAME`: found in a Hugging Face cache laid out on disk by the test (HF_HUB_CACHE layout:
models--ORG--NAME/snapshots/<commit>/..., refs/main), and one clear line when the id is neither cached nor
downloadable (the hub is a closed local port here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from morion.errors import ModelLoadError
from morion.loader import resolve_model_path
from morion.loader.hf_hub import hub_cache_dir
from morion.loader.resolve import is_model_name
from tests.ports import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_with(tmp_path: Path, repo_id: str, model_dir: Path) -> Path:
    """A hub cache holding `model_dir`'s files as the main revision of `repo_id`."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def test_hub_id_resolves_from_the_local_cache(tiny_llama, tmp_path, monkeypatch):
    cache = _cache_with(tmp_path, "tiny-org/tiny-llama", tiny_llama.path)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a cached snapshot needs no network at all
    path = resolve_model_path("tiny-org/tiny-llama")
    assert path == cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert (path / "config.json").is_file()
    assert is_model_name("tiny-org/tiny-llama") and not is_model_name(str(tiny_llama.path))


def test_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_a_directory_of_the_same_spelling_wins(tiny_llama, tmp_path, monkeypatch):
    local = tmp_path / "org" / "name"
    shutil.copytree(tiny_llama.path, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == Path("org/name")


def test_offline_and_not_cached_says_both(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE is set.*not in the local Hugging Face cache"):
        resolve_model_path("tiny-org/missing")


def test_a_path_that_is_no_id_is_still_a_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model path does not exist"):
        resolve_model_path(str(tmp_path / "a" / "b" / "c"))


def test_unreachable_hub_is_one_line_from_the_cli(tiny_llama, tmp_path):
    """A real process, as a user runs it: a cached id loads; an uncached one ends in one line."""
    cache = _cache_with(tmp_path, "tiny-org/tiny-llama", tiny_llama.path)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    env.pop("HF_HUB_OFFLINE", None)
    info = subprocess.run(
        [sys.executable, "-m", "morion", "info", "--model", "tiny-org/tiny-llama", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert info.returncode == 0, info.stderr
    assert f"path: {cache / 'models--tiny-org--tiny-llama' / 'snapshots' / COMMIT}" in info.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "morion", "info", "--model", "tiny-org/not-cached", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1, missing.stderr
    assert missing.stderr.startswith("morion: error: could not reach the Hugging Face hub to download ")
    assert f"not in the local Hugging Face cache ({cache})" in missing.stderr
