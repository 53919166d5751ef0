"""`morion bench --workloads restore` on tiny models (TTFT of one conversation cold, then served by the
device, host and disk tiers, each output compared with the cold one), its errors, and
`Engine.evict_device_cache`, which makes the host hit."""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import statistics
import sys
import weakref
from pathlib import Path

import pytest

from morion.bench import restore
from morion.bench.offline import EngineTarget
from morion.bench.options import BenchOptions, add_bench_arguments
from morion.bench.prompts import PromptFactory
from morion.bench.report import markdown
from morion.bench.workloads import Workbench
from morion.cli import main
from morion.config import EngineConfig
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from tests.bench.conftest import run_bench

LENGTH, PAGE = 96, 16
TINY_RESTORE = [
    "--device", "cpu", "--kv-cache-tokens", "2048", "--page-size", str(PAGE), "--workloads", "restore",
    "--restore-length", str(LENGTH), "--host-cache-gb", "0.01", "--disk-cache-gb", "0.1",
]  # fmt: skip
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _bench(flags: list[str], out: Path) -> tuple[int, str]:
    """Runs `morion bench` with its disk tier under `out`: (exit status, stderr)."""
    return run_bench([*flags, "--disk-cache-dir", str(out / "disk")], out)


@pytest.fixture(scope="module")
def qwen3_next_restore(tiny_qwen3_next_config_dir, tmp_path_factory) -> tuple[dict, Path, str]:
    """The workload on the tiny Qwen3-Next (a hybrid: snapshots decide what is reusable), 2 repeats."""
    out = tmp_path_factory.mktemp("restore")
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    status, stderr = _bench([*model, *TINY_RESTORE, "--restore-repeats", "2", "--label", "tiny"], out)
    assert status == 0, stderr
    [path] = out.glob("*-tiny.json")
    return json.loads(path.read_text()), path, stderr


def test_every_hit_restores_the_whole_conversation_from_its_tier(qwen3_next_restore):
    result, _, _ = qwen3_next_restore
    section = result["restore"]
    assert result["status"] == "complete" and result["settings"]["restore_length"] == LENGTH
    assert section["conversation_tokens"] == LENGTH and section["prompt_tokens"] == LENGTH + 1
    assert section["expected_cached_tokens"] == LENGTH and section["output_tokens"] == restore.OUTPUT_TOKENS
    assert section["failures"] == [] and section["identical"] == {"device": True, "host": True, "disk": True}
    assert len(section["runs"]) == 2
    for run in section["runs"]:
        cold = run["cold"]
        assert cold["cached_tokens"] == 0 and cold["identical"] is None and cold["restore_gbs"] is None
        assert len(cold["output_token_ids"]) == restore.OUTPUT_TOKENS
        for kind in ("device", "host", "disk"):
            sample = run[kind]
            assert sample["cached_tokens"] == LENGTH  # all of the conversation, whole pages
            assert sample["prompt_tokens"] == LENGTH + 1 and sample["completion_tokens"] == 8
            assert sample["identical"] is True and sample["output_token_ids"] == cold["output_token_ids"]
            assert sample["problems"] == []
            tiers = {t: sample["stats_delta"][f"{t}_hit_tokens"] for t in ("device", "host", "disk")}
            assert tiers == {t: LENGTH if t == kind else 0 for t in tiers}
        assert run["device"]["restore_bytes"] is None and run["device"]["stats_delta"]["restores"] == 0
        host, disk = run["host"], run["disk"]
        assert host["evicted_pages"] >= LENGTH // PAGE
        for sample in (host, disk):
            delta = sample["stats_delta"]
            assert delta["restores"] == 1 and delta["restored_tokens"] == LENGTH
            assert delta["restored_snapshots"] == 1  # the state after the conversation
            assert sample["restore_s"] == delta["restore_seconds_total"] > 0
            assert sample["restore_gbs"] == pytest.approx(sample["restore_bytes"] / sample["restore_s"] / 1e9)
        assert host["restore_bytes"] == host["stats_delta"]["bytes_host_to_device"] > 0
        assert host["stats_delta"]["bytes_disk_read"] == 0
        assert disk["restore_bytes"] == disk["stats_delta"]["bytes_disk_read"] > 0
        assert disk["stats_delta"]["disk_objects_read"] == LENGTH // PAGE + 1  # the pages and the snapshot
        assert run["restart"]["build_s"] > 0 and run["restart"]["disk_objects_found"] > 0


def test_the_disk_hit_reads_objects_evicted_from_the_page_cache(qwen3_next_restore):
    """The default --restore-page-cache evict: after the restart, before the disk hit, every file of the
    disk directory (the objects and the manifest) left the page cache; the output is still the cold one."""
    result, _, stderr = qwen3_next_restore
    section = result["restore"]
    assert result["settings"]["restore_page_cache"] == "evict" and section["page_cache"] == "evict"
    tmpfs = section["disk"]["filesystem"]["fstype"] == "tmpfs"
    for run in section["runs"]:
        record = run["page_cache"]
        assert record["mode"] == "evict" and record["evicted"] is True and record["reason"] is None
        assert record["errors"] == 0 and record["seconds"] >= 0
        assert record["files"] == record["files_in_dir"] >= run["restart"]["disk_objects_found"] + 1
        assert record["bytes"] == record["bytes_in_dir"] > 0
        if sys.platform.startswith("linux"):  # residency from mincore
            # The old engine's buffered writes were in the page cache; after the eviction none (a tmpfs,
            # being the page cache, keeps them).
            assert 0 < record["resident_bytes_before"] <= record["bytes"]
            assert record["resident_bytes_after"] == (record["resident_bytes_before"] if tmpfs else 0)
        assert run["disk"]["identical"] is True and run["disk"]["problems"] == []
        assert run["disk"]["output_token_ids"] == run["cold"]["output_token_ids"]
    median = section["page_cache_median"]
    assert median["files"] == statistics.median(run["page_cache"]["files"] for run in section["runs"])
    assert median["bytes"] == statistics.median(run["page_cache"]["bytes"] for run in section["runs"])
    assert f"run 2/2: page cache: evicted {section['runs'][1]['page_cache']['files']} files" in stderr


def test_medians_ratios_and_targets(qwen3_next_restore):
    section = qwen3_next_restore[0]["restore"]
    runs = section["runs"]
    for kind in restore.KINDS:
        assert section["median"][kind]["ttft_s"] == statistics.median(run[kind]["ttft_s"] for run in runs)
    cold = section["median"]["cold"]["ttft_s"]
    for kind in ("device", "host", "disk"):
        assert section["ratio_to_cold"][kind] == section["median"][kind]["ttft_s"] / cold
    assert section["median"]["host"]["restore_gbs"] == statistics.median(
        r["host"]["restore_gbs"] for r in runs
    )
    for kind, limit in (("host", 0.1), ("disk", 1.0)):
        target = section["targets"][kind]
        assert target["limit"] == limit and target["met"] == (section["ratio_to_cold"][kind] < limit)
    assert section["disk"]["filesystem"]["fstype"] and isinstance(section["disk"]["direct_io"], bool)


def test_markdown_table_and_progress_lines(qwen3_next_restore):
    result, path, stderr = qwen3_next_restore
    text = path.with_suffix(".md").read_text()
    assert text == markdown(result)
    assert f"## Restore: a {LENGTH}-token conversation + 1 new token, 8 greedy tokens (median of 2" in text
    assert (
        "| kind | TTFT ms | cached tokens | restore GB/s [8] | ratio to cold | target | met? | output |"
        in text
    )
    rows = [line for line in text.splitlines() if line.startswith(("| cold |", "| device hit", "| host hit"))]
    rows += [line for line in text.splitlines() if line.startswith("| disk hit after restart |")]
    assert len(rows) == 4 and "**FAILED**" not in text
    assert all(f"| {LENGTH} |" in row for row in rows[1:]) and rows[0].endswith("| reference |")
    assert "| < 0.1 |" in rows[2] and "| < 1 |" in rows[3]
    assert "[7] restore: per repeat one fresh conversation" in text
    assert "then evicting that directory's files from the OS page cache where the text under" in text
    median = result["restore"]["page_cache_median"]
    files = f"{median['files']:.0f}" if median["files"] == int(median["files"]) else f"{median['files']:.1f}"
    assert (
        "Disk objects evicted from the page cache before the disk hit (`--restore-page-cache evict`; "
        "written back and dropped with posix_fadvise DONTNEED after the restart, not in the TTFT): "
        f"{files} files, {median['bytes'] / 2**20:.2f} MiB (median per repeat)"
    ) in text
    assert "buffered writes;" in text and "reads may come from the page cache" not in text
    assert f"restore {LENGTH}: run 2/2: disk hit after restart: TTFT" in stderr
    assert "run 1/2: restart: close" in stderr and "output identical to cold" in stderr
    assert f"restore {LENGTH}: median TTFT cold" in stderr


def test_a_hybrid_free_model_restores_the_same(tiny_llama, tmp_path):
    status, stderr = _bench(
        ["--model", str(tiny_llama.path), *TINY_RESTORE, "--restore-repeats", "1"], tmp_path
    )
    assert status == 0, stderr
    [path] = tmp_path.glob("*.json")
    [run] = json.loads(path.read_text())["restore"]["runs"]
    assert [run[kind]["cached_tokens"] for kind in restore.KINDS] == [0, LENGTH, LENGTH, LENGTH]
    assert all(run[kind]["identical"] for kind in ("device", "host", "disk"))
    assert run["host"]["stats_delta"]["restored_snapshots"] == 0  # no state to restore


def test_an_output_that_differs_from_cold_fails(tiny_qwen3_next_config_dir, tmp_path, monkeypatch):
    """A hit that answers differently is FAILED whatever its speed: the row, the target, the exit status."""
    original = EngineTarget.run_request

    def corrupted(self, prompt, max_tokens):
        timing, token_ids = original(self, prompt, max_tokens)
        if timing.cached_tokens:
            token_ids[-1] += 1
        return timing, token_ids

    monkeypatch.setattr(EngineTarget, "run_request", corrupted)
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    status, stderr = _bench([*model, *TINY_RESTORE, "--restore-repeats", "1"], tmp_path)
    assert status == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        "morion: error: restore FAILED: device hit, run 1: output differs from cold at token 7"
    )
    [path] = tmp_path.glob("*.json")
    section = json.loads(path.read_text())["restore"]
    assert section["identical"] == {"device": False, "host": False, "disk": False}
    assert section["targets"]["host"]["met"] is False and section["targets"]["disk"]["met"] is False
    text = path.with_suffix(".md").read_text()
    assert text.count("**FAILED** (run 1)") == 3 and "- FAILED: host hit, run 1: output differs" in text


def _direct_restore(config_dir: Path, disk: Path, page_cache: str) -> tuple[dict, str]:
    """`run_restore` called directly (one repeat) with `page_cache`: its section and progress lines."""
    config = EngineConfig(
        model=str(config_dir),
        load_format="dummy",
        device="cpu",
        kv_cache_tokens=2048,
        page_size=PAGE,
        host_cache_gb=0.01,
        disk_cache_dir=str(disk),
        disk_cache_gb=0.1,
    )
    target = EngineTarget(config)
    stream = io.StringIO()
    try:
        restore.check_capacity(target.engine, LENGTH)
        bench = Workbench(target, PromptFactory(target.vocab_size), "morion", stream=stream)
        section = restore.run_restore(bench, target, LENGTH, 1, page_cache=page_cache)
    finally:
        target.close()
    return section, stream.getvalue()


def _with_restore(result: dict, section: dict) -> str:
    """The Markdown of the fixture's results with its restore section replaced by `section`."""
    return markdown({**copy.deepcopy(result), "restore": section})


def test_keep_leaves_the_page_cache_alone(qwen3_next_restore, tiny_qwen3_next_config_dir, tmp_path):
    """Through the CLI flag: the setting and the workload's own record agree."""
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    flags = [
        *model,
        *TINY_RESTORE,
        "--restore-repeats",
        "1",
        "--restore-page-cache",
        "keep",
        "--label",
        "keep",
    ]
    status, progress = _bench(flags, tmp_path)
    assert status == 0, progress
    [path] = tmp_path.glob("*-keep.json")
    result = json.loads(path.read_text())
    section = result["restore"]
    assert result["settings"]["restore_page_cache"] == "keep"
    assert section["page_cache"] == "keep" and section["failures"] == []
    [run] = section["runs"]
    record = run["page_cache"]
    assert record["mode"] == "keep" and record["evicted"] is False and record["reason"] is None
    assert record["files"] == 0 and record["bytes"] == 0  # nothing evicted
    assert record["files_in_dir"] >= run["restart"]["disk_objects_found"] + 1 and record["bytes_in_dir"] > 0
    if sys.platform.startswith("linux"):  # the old engine's buffered writes are still in memory
        assert record["resident_bytes_after"] == record["resident_bytes_before"] > 0
    assert run["disk"]["identical"] is True and run["disk"]["cached_tokens"] == LENGTH
    assert run["disk"]["output_token_ids"] == run["cold"]["output_token_ids"]
    assert run["disk"]["stats_delta"]["disk_hit_tokens"] == LENGTH
    assert f"run 1/1: page cache: kept ({record['files_in_dir']} files" in progress
    text = _with_restore(qwen3_next_restore[0], section)
    assert (
        "Page cache kept (`--restore-page-cache keep`): the disk directory's files were not evicted before "
        "the disk hit, so it may read them from memory, not the disk"
    ) in text
    assert "Disk objects evicted from the page cache" not in text


def test_without_posix_fadvise_nothing_is_evicted_and_the_report_says_so(
    qwen3_next_restore, tiny_qwen3_next_config_dir, tmp_path, monkeypatch
):
    monkeypatch.delattr(os, "posix_fadvise")
    section, progress = _direct_restore(tiny_qwen3_next_config_dir, tmp_path / "disk", "evict")
    [run] = section["runs"]
    record = run["page_cache"]
    assert record["mode"] == "evict" and record["evicted"] is False
    assert record["reason"] == "os.posix_fadvise is unavailable on this platform"
    assert record["files"] == 0 and record["bytes"] == 0 and record["files_in_dir"] > 0
    assert run["disk"]["identical"] is True and section["failures"] == []
    assert "page cache NOT evicted: os.posix_fadvise is unavailable on this platform" in progress
    text = _with_restore(qwen3_next_restore[0], section)
    assert (
        "Page cache **not evicted** (`--restore-page-cache evict`, but os.posix_fadvise is unavailable on "
        "this platform): the disk hit may read from memory."
    ) in text


def test_results_from_before_the_option_render_as_before(qwen3_next_restore):
    section = copy.deepcopy(qwen3_next_restore[0]["restore"])
    del section["page_cache"], section["page_cache_median"]
    for run in section["runs"]:
        del run["page_cache"]
    text = _with_restore(qwen3_next_restore[0], section)
    assert "buffered (reads may come from the page cache)" in text and "Page cache" not in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="residency comes from Linux mincore")
def test_prepare_page_cache_drops_a_file_and_measures_it(tmp_path):
    if restore.filesystem_of(tmp_path)["fstype"] == "tmpfs":
        pytest.skip("a tmpfs file is the page cache: it cannot be dropped")
    folder = tmp_path / "objects" / "ab"
    folder.mkdir(parents=True)
    data = os.urandom(3 * 2**20 + 5)
    (folder / "x.page").write_bytes(data)
    size = len(data)
    kept = restore.prepare_page_cache(tmp_path, "keep")  # just written: all of it in the page cache
    assert (kept["files"], kept["files_in_dir"], kept["bytes_in_dir"]) == (0, 1, size)
    assert kept["resident_bytes_before"] == kept["resident_bytes_after"] == size
    evicted = restore.prepare_page_cache(tmp_path, "evict")
    assert (evicted["files"], evicted["bytes"]) == (1, size)
    assert evicted["resident_bytes_before"] == size and evicted["resident_bytes_after"] == 0
    assert restore.prepare_page_cache(tmp_path, "keep")["resident_bytes_after"] == 0
    assert (folder / "x.page").read_bytes() == data  # dropped from memory, not from the disk
    assert restore.prepare_page_cache(tmp_path, "keep")["resident_bytes_after"] == size


def test_the_page_cache_flag_is_parsed_and_checked():
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert BenchOptions.from_args(parser.parse_args([])).restore_page_cache == "evict"
    assert (
        BenchOptions.from_args(parser.parse_args(["--restore-page-cache", "keep"])).restore_page_cache
        == "keep"
    )
    with pytest.raises(MorionError, match="--restore-page-cache must be one of evict, keep, got 'drop'"):
        BenchOptions.from_args(parser.parse_args(["--restore-page-cache", "drop"]))


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "--workloads restore needs --host-cache-gb and --disk-cache-dir: e.g. --host-cache-gb 8"),
        (["--host-cache-gb", "1"], "--workloads restore needs --disk-cache-dir: e.g."),
        (["--url", "http://127.0.0.1:9"], "--workloads restore needs the offline engine"),
        (
            ["--host-cache-gb", "1", "--disk-cache-dir", "d", "--restore-length", "100"],
            "--restore-length 100 must be a multiple of the page size 16",
        ),
        (
            ["--host-cache-gb", "1", "--disk-cache-dir", "d", "--no-prefix-cache"],
            "leave out --no-prefix-cache",
        ),
    ],
)
def test_flag_errors_are_one_line(flags, message, tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--workloads", "restore", *flags, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("morion: error: ") and err.count("\n") == 1
    assert message in err
    assert not list(tmp_path.iterdir())


def test_a_host_tier_too_small_for_the_conversation_is_an_error(tiny_qwen3_next_config_dir, tmp_path, capsys):
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    flags = [*model, *TINY_RESTORE, "--host-cache-gb", "0.0002", "--restore-length", "480"]
    assert main(["bench", *flags, "--disk-cache-dir", str(tmp_path / "disk"), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("morion: error: --host-cache-gb 0.0002 holds ")
    assert "a 480-token conversation needs 30 and 1: use --host-cache-gb" in err


# -- Engine.evict_device_cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evict_device_cache_frees_every_page_and_the_next_request_is_a_host_hit(
    tiny_qwen3_next, engine_factory, engine_runner, policy
):
    engine = engine_factory(
        tiny_qwen3_next, page_size=PAGE, host_cache_gb=0.01, host_cache_write_policy=policy
    )
    prompt = [(7 * i + 3) % 500 + 3 for i in range(LENGTH + 1)]
    [cold] = engine_runner(engine, [prompt], GREEDY)
    cache = engine.prefix_cache
    assert cache.cached_pages >= LENGTH // PAGE and cache.cached_snapshots > 0
    assert engine.pool.num_free < engine.pool.num_pages
    backed_up = engine.cache_stats.backed_up_pages
    assert backed_up == (LENGTH // PAGE if policy == "write_through" else 0)
    assert engine.evict_device_cache() == LENGTH // PAGE  # all the tree held
    # Through the normal eviction path: under write-back the listener copied the pages to the host now.
    assert engine.cache_stats.backed_up_pages == LENGTH // PAGE
    assert cache.cached_pages == 0 and cache.cached_snapshots == 0
    assert engine.pool.num_free == engine.pool.num_pages  # every page back on the free list
    assert engine.state_slots.num_free == engine.state_slots.num_slots
    engine.check_integrity()
    before = engine.cache_stats.snapshot()
    [host] = engine_runner(engine, [prompt], GREEDY)
    stats = engine.cache_stats
    assert host.usage.cached_tokens == LENGTH and host.token_ids == cold.token_ids
    assert stats.host_hits == before.host_hits + 1 and stats.device_hits == before.device_hits
    assert stats.host_hit_tokens - before.host_hit_tokens == LENGTH
    engine.check_integrity()
    engine.close()


def test_evict_device_cache_without_tiers_keeps_what_running_requests_hold(
    tiny_qwen3_next, engine_factory, engine_runner
):
    engine = engine_factory(tiny_qwen3_next, page_size=PAGE)
    prompt = [(5 * i + 1) % 500 + 3 for i in range(LENGTH + 1)]
    other = [(3 * i + 2) % 500 + 3 for i in range(LENGTH + 1)]
    engine_runner(engine, [prompt, other], GREEDY)
    engine.add_request(prompt, GREEDY)
    engine.step()  # running, its prefix locked (a device hit)
    assert engine.evict_device_cache() == LENGTH // PAGE  # the other conversation's pages
    assert engine.prefix_cache.cached_pages >= LENGTH // PAGE
    while engine.has_unfinished():
        engine.step()
    assert engine.evict_device_cache() > 0 and engine.prefix_cache.cached_pages == 0
    engine.check_integrity()
    [again] = engine_runner(engine, [prompt], GREEDY)
    assert again.usage.cached_tokens == 0  # nothing behind the device cache: computed again


def test_restart_frees_the_old_engine_and_finds_the_disk_cache(tiny_qwen3_next_config_dir, tmp_path):
    """Nothing may keep the old engine alive: on a GPU its pool and weights must be gone before the new
    engine loads its own and sizes its pool from the free memory."""
    config = EngineConfig(
        model=str(tiny_qwen3_next_config_dir),
        load_format="dummy",
        device="cpu",
        kv_cache_tokens=2048,
        host_cache_gb=0.01,
        disk_cache_dir=str(tmp_path),
        disk_cache_gb=0.1,
    )
    target = EngineTarget(config)
    prompt = [(3 * i + 2) % 500 + 3 for i in range(LENGTH + 1)]
    timing, tokens = target.run_request(prompt, 8)
    old = weakref.ref(target.engine)
    close_s, build_s = target.restart()
    assert old() is None and close_s >= 0 and build_s > 0
    assert target.engine.cache_stats.disk_objects == LENGTH // PAGE + 1  # the pages and the snapshot
    again, same = target.run_request(prompt, 8)
    assert again.cached_tokens == LENGTH and same == tokens and timing.cached_tokens == 0
    target.close()
