"""scripts/gpu_chain.sh, the background chain of a GPU session's steps: started, waited on with progress,
each step's output and status kept (a failing step does not stop the chain), packed into $OUT. Run here
with plain shell steps; on the device machine the steps are GPU commands."""

from __future__ import annotations

import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _chain(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/gpu_chain.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_steps_run_in_order_in_the_background_and_come_back_packed(tmp_path):
    steps = tmp_path / "steps"
    steps.write_text(
        "# a comment, then a blank line\n\n"
        "first 10 echo from the tree copy: $(basename $(pwd)) at $MORION_SOURCE_COMMIT;"
        " echo made > $CHAIN_OUT/first.txt\n"
        "failing 10 echo about to fail; exit 3\n"
        "slow 1 sleep 5\n"
        "last 10 echo after the others\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "CHAIN_DIR": str(tmp_path / "chain"), "OUT": str(out)}
    env["MORION_SOURCE_COMMIT"] = "c0ffee"
    # The finished chain packs the machine's Triton kernels beside its logs (here: one fake kernel).
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    (tmp_path / "triton" / "HASH").mkdir(parents=True)
    (tmp_path / "triton" / "HASH" / "k.cubin").write_bytes(b"binary")
    started = _chain("start", str(steps), env=env)
    assert started.returncode == 0 and "started 4 steps" in started.stdout, started.stderr
    waited = _chain("wait", "30", env=env)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    status = [line.split()[:2] for line in waited.stdout.splitlines() if "rc=" in line]
    assert status == [["first", "rc=0"], ["failing", "rc=3"], ["slow", "rc=124"], ["last", "rc=0"]]
    assert [p.name for p in out.glob("triton-cache.tgz.part*")] == ["triton-cache.tgz.part00"]
    [packed] = out.glob("chain-*.tgz")
    with tarfile.open(packed) as archive:
        names = set(archive.getnames())
        assert {"logs/first.log", "logs/failing.log", "out/first.txt", "status"} <= names
        assert (
            archive.extractfile("logs/first.log").read().decode().strip()
            == "from the tree copy: tree at c0ffee"
        )


def test_waiting_without_a_chain_or_a_steps_file_says_so(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "CHAIN_DIR": str(tmp_path / "none")}
    assert "no chain started" in _chain("wait", "1", env=env).stderr
    missing = _chain("start", str(tmp_path / "absent"), env=env)
    assert missing.returncode == 2 and "no steps file" in missing.stderr


def test_a_chain_without_a_commit_for_provenance_does_not_start(tmp_path):
    # A copy of the script outside any git work tree, as on the device machine.
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "gpu_chain.sh"
    script.write_text((ROOT / "scripts" / "gpu_chain.sh").read_text())
    steps = tmp_path / "steps"
    steps.write_text("only 10 true\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "CHAIN_DIR": str(tmp_path / "chain"),
        "GIT_CEILING_DIRECTORIES": str(tmp_path),
    }
    started = subprocess.run(
        ["bash", str(script), "start", str(steps)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 2 and "MORION_SOURCE_COMMIT" in started.stderr
    assert not (tmp_path / "chain" / "status").exists()


def _triton_cache(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "TRITON_CACHE_DIR": str(cache)}
    return subprocess.run(
        ["bash", "scripts/triton_cache.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_triton_s_kernels_are_packed_in_parts_and_unpacked_into_an_empty_cache_only(tmp_path):
    """What a cache hit reads (binary, metadata and group JSON) goes, in parts; the IR stays behind. An
    empty cache takes the parts; one that holds kernels already is left as it is."""
    cache = tmp_path / "cache"
    kernel = cache / "HASH1"
    kernel.mkdir(parents=True)
    binary = bytes(range(256)) * 40
    files = {"k.cubin": binary, "k.json": b'{"name": "k"}', "__grp__k.json": b'{"child_paths": {}}'}
    for name, data in {**files, "k.ptx": b"ptx", "k.ttir": b"ir", "k.llir": b"llvm"}.items():
        (kernel / name).write_bytes(data)
    parts = tmp_path / "out"
    packed = _triton_cache("pack", str(parts), cache=cache)
    assert packed.returncode == 0 and "1 kernels from" in packed.stdout, packed.stdout + packed.stderr
    assert [p.name for p in parts.iterdir()] == ["triton-cache.tgz.part00"]

    fresh = tmp_path / "fresh"
    unpacked = _triton_cache("unpack", str(parts), cache=fresh)
    assert unpacked.returncode == 0 and "1 kernels into" in unpacked.stdout, unpacked.stderr
    assert {p.name: p.read_bytes() for p in (fresh / "HASH1").iterdir()} == files

    (fresh / "HASH1" / "k.cubin").write_bytes(b"recompiled")
    again = _triton_cache("unpack", str(parts), cache=fresh)
    assert "already holds kernels" in again.stdout
    assert (fresh / "HASH1" / "k.cubin").read_bytes() == b"recompiled"

    assert "nothing packed" in _triton_cache("pack", str(parts), cache=tmp_path / "absent").stdout
    assert "no parts" in _triton_cache("unpack", str(tmp_path / "none"), cache=fresh).stdout


STEP_FILES = sorted((ROOT / "scripts" / "device_steps").glob("*.steps"))


@pytest.mark.parametrize("steps", STEP_FILES, ids=[path.name for path in STEP_FILES])
def test_a_committed_steps_file_is_one_the_chain_runs(steps):
    """A session's device steps are committed (an untracked file did not outlive its session): each line
    names a step once, with a time limit a device call allows and a command; the tests and scripts it
    names exist, and each `morion bench` command parses (its flags are the CLI's)."""
    from morion.cli import _build_parser

    names = []
    for line in steps.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, limit, command = line.split(maxsplit=2)
        names.append(name)
        assert 0 < int(limit) <= 600, line
        for path in re.findall(r"\b((?:tests|scripts)/[\w/.-]+\.(?:py|sh))", command):
            assert (ROOT / path).exists(), f"{steps.name}: {path} does not exist"
        for bench in re.findall(r"morion bench ([^;&|]+)", command):
            _build_parser().parse_args(["bench", *shlex.split(bench.replace("$CHAIN_OUT", "/tmp/out"))])
    assert names and len(names) == len(set(names)), names


def test_steps_for_another_card_do_not_start(tmp_path):
    """CHAIN_REQUIRE_GPU: a call for an H200 that got an H100 refuses the H200's steps at once (exit 3),
    where each would have failed after loading; the card that matches starts them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    steps = tmp_path / "steps"
    steps.write_text("only 10 true\n")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CHAIN_DIR": str(tmp_path / "chain"),
        "MORION_SOURCE_COMMIT": "c0ffee",
        "CHAIN_REQUIRE_GPU": "H200",
    }
    refused = _chain("start", str(steps), env=env)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "need a card named like H200; this machine has NVIDIA H100 80GB HBM3" in refused.stderr
    assert not (tmp_path / "chain" / "status").exists()
    started = _chain("start", str(steps), env={**env, "CHAIN_REQUIRE_GPU": "H100"})
    assert started.returncode == 0 and "started 1 steps" in started.stdout, started.stderr
    assert _chain("wait", "30", env=env).returncode == 0
