"""The cache tiers on a CUDA device: pinned host memory, the copy stream, per-layer events (skipped where
there is no GPU). A hit restored from the host or disk answers bit for bit as the same hit served from the
device, and as a cold run wherever the scheduler's identity covers it; the copy rules hold with the copy
stream deliberately held back, and the same runs with the rule's safeguard switched off go wrong (so the
tests can see the bugs).

What is compared exactly, and what through the reference's logit gaps: a prompt's first run equals a cold
run at the same chunk size (the same cut points, nothing cached); a *follow-up* (the prompt, its answer and
a new message) hits up to where the answer's pages ended, which is not where its cold run cuts its chunks
(`Scheduler._chunk`: identity covers a prompt sent again, which recomputes exactly its tail), so the
follow-up's hit is compared with cold through the logits' near-ties only, and exactly with the same hit
served from the device tier, and with the same follow-up sent again."""

from __future__ import annotations

import copy
import gc
import random
import time
import weakref

import pytest
import torch

from morion.cache import CacheSpec, PagePool, TokenComponent
from morion.cache.copy_engine import CudaCopyEngine, CudaTransfer, SyncCopyEngine
from morion.cache.host_store import HostObjectStore, ObjectLayout
from morion.cache.testing import flood
from morion.cache.tiers import CacheTiers
from morion.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# Logprobs too: where answers must be the same bits, their logprobs are compared as well as their tokens.
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
PAGE = 8
CHUNK = 32
HOST_GB = 8 / 1024
TIE_GAP = 1e-3  # fp32 on both devices: only summation order and chunk cut points differ


@pytest.fixture(scope="module", params=["small_llama", "tiny_qwen3_next"])
def on_cpu(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def on_cuda(on_cpu):
    return on_cpu._replace(model=copy.deepcopy(on_cpu.model).to("cuda"))


@pytest.fixture(scope="module")
def cold(on_cuda, engine_factory, engine_runner):
    """Cold runs at the tiered engines' chunk size: a prompt's first run cuts where its cold run does."""
    engine = engine_factory(
        on_cuda, page_size=PAGE, chunk_size=CHUNK, device="cuda", enable_prefix_cache=False
    )
    return lambda prompt: engine_runner(engine, [prompt], GREEDY)[0]


@pytest.fixture(scope="module")
def agrees_with_cold(on_cpu, cold, outputs_agree):
    """Asserts a follow-up's outputs equal its cold run's, token for token, except after a near-tie of the
    reference's logits (the CPU model's full prefill)."""

    def check(prompt, outputs) -> None:
        reference = cold(prompt)
        outputs_agree(on_cpu.model, [prompt] * len(outputs), outputs, [reference] * len(outputs), TIE_GAP)

    return check


def _tiered(engine_factory, loaded, tmp_path, **options):
    options = {
        "page_size": PAGE,
        "device": "cuda",
        "chunk_size": CHUNK,
        "host_cache_gb": HOST_GB,
        "disk_cache_dir": str(tmp_path / "disk"),
        "disk_cache_gb": 1.0,
        **options,
    }
    return engine_factory(loaded, **options)


def _prompt(seed: int, length: int = 75) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def _evict_and_scribble(engine) -> None:
    """Empty the device cache and fill the pool and the state slots with garbage, so a read of a restored
    page or state before its copy lands sees garbage (not the old, equal content of a reused page)."""
    engine.prefix_cache.evict(engine.pool.num_pages)
    torch.cuda.synchronize()
    for component in engine.pool.spec.token_components:
        storage = engine.pool.storage(component.name)
        if storage.element_size() == 1:  # FP8 K/V: 1e4 does not fit e4m3; byte 0x77 is 240
            storage.view(torch.uint8).fill_(0x77)
        else:
            storage.fill_(1e4)
    if engine.state_slots is not None:
        for component in engine.pool.spec.state_components:
            engine.state_slots.storage(component.name).fill_(1e4)


def _answers(outputs) -> list[tuple[list[int], list[float]]]:
    """Tokens and their logprobs: what outputs that must be the same bits are compared by."""
    return [(output.token_ids, output.logprobs) for output in outputs]


def _follow_up_from(engine, engine_runner, prompt: list[int], evict: bool):
    """Runs `prompt`, then (the device cache emptied and scribbled over when `evict`) its follow-up: 75
    prompt tokens + 11 computed answer tokens leave 10 whole pages, so the follow-up reuses 80 tokens,
    from the device or (evicted) the host tier. Returns (first output, follow-up prompt, its output)."""
    first = engine_runner(engine, [prompt], GREEDY)[0]
    follow_up = prompt + first.token_ids + [1, 2, 3]
    if evict:
        _evict_and_scribble(engine)
    output = engine_runner(engine, [follow_up], GREEDY)[0]
    assert output.usage.cached_tokens == 80
    return first, follow_up, output


def test_host_and_disk_hits_on_cuda_equal_cold(
    on_cuda, cold, agrees_with_cold, engine_factory, engine_runner, tmp_path
):
    prompt = _prompt(0)
    on_device = _tiered(engine_factory, on_cuda, tmp_path / "device", disk_cache_dir=None, disk_cache_gb=None)
    _, _, device_hit = _follow_up_from(on_device, engine_runner, prompt, evict=False)
    engine = _tiered(engine_factory, on_cuda, tmp_path)
    assert isinstance(engine.tiers.copy_engine, CudaCopyEngine) and engine.tiers.host.arena.is_pinned()
    first, follow_up, host = _follow_up_from(engine, engine_runner, prompt, evict=True)
    assert first.token_ids == cold(prompt).token_ids
    assert _answers([host]) == _answers([device_hit])
    agrees_with_cold(follow_up, [host])
    # The follow-up itself was written through: sent again, 88 of its 90 tokens (11 pages) come back, and
    # its 2-token tail is recomputed as its first run computed it.
    _evict_and_scribble(engine)
    again = engine_runner(engine, [follow_up], GREEDY)[0]
    assert again.usage.cached_tokens == 88 and _answers([again]) == _answers([host])
    engine.check_integrity()
    engine.close()
    restarted = _tiered(engine_factory, on_cuda, tmp_path)
    disk = engine_runner(restarted, [follow_up], GREEDY)[0]
    assert disk.usage.cached_tokens == 88 and _answers([disk]) == _answers([host])
    assert restarted.cache_stats.disk_hit_tokens == 88
    restarted.close()
    on_device.close()


def test_fp8_kv_host_hit_equals_a_device_hit(on_cuda, engine_factory, engine_runner, tmp_path):
    """An FP8 K/V pool restores too (float8 has no index_copy_ kernels: the copy goes as bytes): the host
    hit answers as the same hit served from the device, bit for bit."""
    prompt = _prompt(1)
    fp8_tiered = {"disk_cache_dir": None, "disk_cache_gb": None, "kv_cache_dtype": "fp8"}
    on_device = _tiered(engine_factory, on_cuda, tmp_path, **fp8_tiered)
    _, _, device_hit = _follow_up_from(on_device, engine_runner, prompt, evict=False)
    engine = _tiered(engine_factory, on_cuda, tmp_path, **fp8_tiered)
    _, _, host = _follow_up_from(engine, engine_runner, prompt, evict=True)
    assert _answers([host]) == _answers([device_hit])
    engine.check_integrity()
    on_device.close()
    engine.close()


def _held_back_restores(monkeypatch, flood_host: bool) -> None:
    """Hold the copy stream back ~50 ms before each restore; optionally flood the host tier right after
    the restore is issued, while its copies certainly wait."""
    original = CacheTiers.restore

    def restore(self, hit, pages, dst_slots):
        with torch.cuda.stream(self.copy_engine.stream):
            torch.cuda._sleep(100_000_000)
        original(self, hit, pages, dst_slots)
        if flood_host:
            flood(self.host, b"junk")
            if self.snapshots is not None:
                flood(self.snapshots, b"junk")

    monkeypatch.setattr(CacheTiers, "restore", restore)


def _restored_run(engine_factory, engine_runner, on_cuda, tmp_path, prompt, before_restore=lambda: None):
    """Run `prompt`, empty the device, then run a follow-up twice in one batch: the first restores 80
    tokens from the host, the second hits them on the device in the same step (it reads the restored
    pages and, for the hybrid model, copies the restored snapshot)."""
    engine = _tiered(engine_factory, on_cuda, tmp_path, disk_cache_dir=None, disk_cache_gb=None)
    first = engine_runner(engine, [prompt], GREEDY)[0]
    _evict_and_scribble(engine)
    before_restore()
    follow_up = prompt + first.token_ids + [1]  # 88 tokens: both may reuse 80
    outputs = engine_runner(engine, [follow_up, follow_up], GREEDY)
    engine.close()
    return follow_up, outputs


@pytest.fixture(scope="module")
def undisturbed(on_cuda, engine_factory, engine_runner, tmp_path_factory):
    """The restored run with nothing held back or flooded: what every copy-rule run must answer, bit for bit
    (the same engine settings, cut points, batch and restored bytes)."""
    directory = tmp_path_factory.mktemp("undisturbed")
    return _answers(_restored_run(engine_factory, engine_runner, on_cuda, directory, _prompt(1))[1])


def test_copy_rules_hold_with_the_copy_stream_held_back(
    on_cuda, undisturbed, agrees_with_cold, engine_factory, engine_runner, tmp_path, monkeypatch
):
    _held_back_restores(monkeypatch, flood_host=True)
    follow_up, outputs = _restored_run(engine_factory, engine_runner, on_cuda, tmp_path, _prompt(1))
    assert [o.usage.cached_tokens for o in outputs] == [80, 80]
    assert _answers(outputs) == undisturbed
    agrees_with_cold(follow_up, outputs)


def test_without_pins_the_flood_corrupts_the_restore(
    on_cuda, agrees_with_cold, engine_factory, engine_runner, tmp_path, monkeypatch
):
    """Rule 1's control: the host rows of an in-flight restore are no longer pinned."""
    _held_back_restores(monkeypatch, flood_host=True)

    def unpinned() -> None:
        monkeypatch.setattr(HostObjectStore, "pin", lambda self, key: self.get(key))
        monkeypatch.setattr(HostObjectStore, "unpin", lambda self, key: None)

    follow_up, outputs = _restored_run(engine_factory, engine_runner, on_cuda, tmp_path, _prompt(1), unpinned)
    with pytest.raises(AssertionError, match="clear gap"):
        agrees_with_cold(follow_up, outputs[:1])


def test_without_layer_waits_the_forward_reads_too_early(
    on_cuda, agrees_with_cold, engine_factory, engine_runner, tmp_path, monkeypatch
):
    """Rule 4's control: the forward no longer waits for the copy events."""
    _held_back_restores(monkeypatch, flood_host=False)
    monkeypatch.setattr(CudaTransfer, "wait", lambda self, component, layer: None)
    monkeypatch.setattr(CudaTransfer, "wait_all", lambda self: None)
    follow_up, outputs = _restored_run(engine_factory, engine_runner, on_cuda, tmp_path, _prompt(1))
    with pytest.raises(AssertionError, match="clear gap"):
        agrees_with_cold(follow_up, outputs[:1])


def test_a_backup_is_waited_for_asleep_not_spinning():
    """The disk writer's sender thread waits on the CPU for a backup's copy (cache/tiers.py, the write's
    `before`): the wait sleeps (a blocking event), so it costs the engine thread no CPU. With the copy
    stream held back ~0.3 s, the waiting thread's CPU time stays a small part of the wait."""
    spec = CacheSpec(4, (TokenComponent("kv", 2, (8,), torch.float32),), ())
    pool = PagePool(spec, 8, "cuda")
    host = HostObjectStore(ObjectLayout.for_pages(spec), 4, pin_memory=True)
    engine = CudaCopyEngine(torch.device("cuda"))
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(500_000_000)  # ~0.3 s at the H200's clock
    transfer = engine.backup(pool, pool.alloc(2), host, [0, 1])
    wall, cpu = time.perf_counter(), time.thread_time()
    transfer.completion_waiter()()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall > 0.05, "the copy stream was not held back: nothing to measure"
    assert cpu < 0.25 * wall, f"the wait spun: {cpu:.3f} s on the CPU in {wall:.3f} s"


def test_a_queued_disk_write_holds_none_of_the_backup_s_buffers():
    """What a disk write waits on (`completion_waiter`) keeps the backup's event, not the buffers the
    transfer holds (its pinned index sources): once the engine drops a finished transfer they go back
    though writes still queue the waiter (on the H200 such writes held GiBs of device staging through a
    burst of prompts, and a prefill ran out)."""
    spec = CacheSpec(4, (TokenComponent("kv", 2, (8,), torch.float32),), ())
    pool = PagePool(spec, 8, "cuda")
    host = HostObjectStore(ObjectLayout.for_pages(spec), 4, pin_memory=True)
    transfer = CudaCopyEngine(torch.device("cuda")).backup(pool, pool.alloc(2), host, [0, 1])
    held = [weakref.ref(tensor) for tensor in transfer._keepalive]
    assert held, "the backup held nothing: nothing to check"
    waiter = transfer.completion_waiter()
    waiter()
    del transfer
    gc.collect()
    assert all(ref() is None for ref in held), "the waiter keeps the backup's buffers alive"
    waiter()  # still waits (on a finished event) after the transfer is gone


def test_a_backup_s_device_staging_goes_back_while_its_copies_wait():
    """Copy rule 1 for device buffers: a backup's staging and token slot indices are the copy stream's own
    allocations and go back when the copies are queued, not when the engine next polls. With the copy
    stream held back, nothing the backup allocated on the device stays allocated; the copy stream's next
    allocation of the staging's size (the block it freed) is overwritten there, and the host rows still
    hold the pages, as a synchronous backup writes them: the stream orders the reuse after the copies."""
    spec = CacheSpec(4, (TokenComponent("kv", 2, (8,), torch.float32),), ())
    pool, cpu_pool = PagePool(spec, 8, "cuda"), PagePool(spec, 8, "cpu")
    storage = cpu_pool.storage("kv")
    storage.copy_(torch.arange(storage.numel(), dtype=torch.float32).view(storage.shape))
    pool.storage("kv").copy_(storage)
    pages = pool.alloc(2)
    assert cpu_pool.alloc(2) == pages
    layout = ObjectLayout.for_pages(spec)
    expected = HostObjectStore(layout, 4)
    SyncCopyEngine().backup(cpu_pool, pages, expected, [0, 1])
    host = HostObjectStore(layout, 4, pin_memory=True)
    engine = CudaCopyEngine(torch.device("cuda"))
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(500_000_000)  # ~0.3 s at the H200's clock
    transfer = engine.backup(pool, pages, host, [0, 1])
    assert not transfer.done(), "the copy stream was not held back: nothing to check"
    assert torch.cuda.memory_allocated() == allocated, "the backup holds device memory past its return"
    with torch.cuda.stream(engine.stream):
        reuse = torch.empty((2, layout.row_bytes), dtype=torch.uint8, device="cuda")
        reuse.fill_(255)
    transfer.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(host.arena[:2], expected.arena[:2])
