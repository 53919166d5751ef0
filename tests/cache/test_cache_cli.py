"""`morion cache ls | verify | purge` on a disk tier written by a real engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from morion.engine.sampling_params import SamplingParams


def _morion(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "morion", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def disk_dir(tmp_path, tiny_llama, engine_factory, engine_runner):
    root = tmp_path / "disk"
    engine = engine_factory(
        tiny_llama, page_size=8, host_cache_gb=0.01, disk_cache_dir=str(root), disk_cache_gb=0.1
    )
    engine_runner(engine, [list(range(40))], SamplingParams(max_tokens=4, temperature=0.0))
    engine.close()
    return root


def test_ls_verify_purge(disk_dir):
    listed = _morion("cache", "ls", "--disk-cache-dir", str(disk_dir))
    assert listed.returncode == 0 and listed.stdout.strip(), listed.stderr
    verified = _morion("cache", "verify", "--disk-cache-dir", str(disk_dir))
    assert verified.returncode == 0 and "0 bad" in verified.stdout, verified.stdout + verified.stderr
    objects = [p for p in disk_dir.rglob("*") if p.is_file() and p.name != "manifest.json"]
    objects[0].write_bytes(objects[0].read_bytes()[:-5] + b"XXXXX")
    broken = _morion("cache", "verify", "--disk-cache-dir", str(disk_dir))
    assert broken.returncode == 1 and "bad:" in broken.stdout
    refused = _morion("cache", "purge", "--disk-cache-dir", str(disk_dir))
    assert refused.returncode == 1 and "--namespace NS or --all" in refused.stderr
    purged = _morion("cache", "purge", "--disk-cache-dir", str(disk_dir), "--all")
    assert purged.returncode == 0 and "removed" in purged.stdout
    assert _morion("cache", "ls", "--disk-cache-dir", str(disk_dir)).stdout.strip() == ""
