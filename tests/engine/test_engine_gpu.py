"""The engine on a CUDA device against the same engine on the CPU (skipped where there is no GPU)."""

from __future__ import annotations

import copy
import random
import sys

import pytest
import torch

from morion.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-3  # fp32 on both devices: only summation order differs


@pytest.mark.parametrize("model", ["small_llama", "tiny_qwen3_next"])
def test_cuda_equals_cpu(model, request, engine_factory, engine_runner, outputs_agree):
    on_cpu = request.getfixturevalue(model)
    # The same weights on the GPU (dummy weights drawn on each device would differ).
    on_cuda = on_cpu._replace(model=copy.deepcopy(on_cpu.model).to("cuda"))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 80))] for _ in range(6)]
    cpu_out = engine_runner(engine_factory(on_cpu, page_size=8), prompts, GREEDY)
    cuda_engine = engine_factory(on_cuda, page_size=8, device="cuda", chunk_size=32)
    cuda_out = engine_runner(cuda_engine, prompts, GREEDY)
    outputs_agree(on_cpu.model, prompts, cuda_out, cpu_out, TIE_GAP)
    again = engine_runner(cuda_engine, prompts, GREEDY)  # prefix-cache hits on the GPU
    assert [o.token_ids for o in again] == [o.token_ids for o in cuda_out]
    assert sum(o.usage.cached_tokens for o in again) > 0
    cuda_engine.check_integrity()


def test_bf16_on_cuda_runs(small_llama, engine_factory, engine_runner):
    loaded = small_llama._replace(model=copy.deepcopy(small_llama.model).to("cuda", torch.bfloat16))
    engine = engine_factory(loaded, device="cuda")
    assert engine.pool.storage("kv").dtype == torch.bfloat16
    outputs = engine_runner(engine, [[1, 2, 3], list(range(40))], GREEDY)
    assert all(len(o.token_ids) == 16 for o in outputs)


@pytest.mark.parametrize("model", ["small_llama", "tiny_qwen3_next"])
def test_cuda_graph_decode_equals_eager(model, request, engine_factory, engine_runner, outputs_agree):
    on_cpu = request.getfixturevalue(model)
    loaded = on_cpu._replace(model=copy.deepcopy(on_cpu.model).to("cuda"))
    rng = random.Random(1)
    # 5 requests: batches of 5, 4, ... decode through the 8- and 4-row buckets with padding rows.
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = engine_factory(loaded, page_size=8, device="cuda", cuda_graph=False)
    eager_out = engine_runner(eager, prompts, params)
    assert eager.graphs is None
    del eager
    graphed = engine_factory(loaded, page_size=8, device="cuda", cuda_graph_max_batch=8)
    graphed_out = engine_runner(graphed, prompts, params)
    assert graphed.graphs is not None and graphed.graphs.replays > 0
    outputs_agree(on_cpu.model, prompts, graphed_out, eager_out, TIE_GAP)
    # Padding rows wrote only to the scratch page and slot: nothing leaked, the cache is consistent.
    graphed.check_integrity()


def test_fp8_kv_cache_stays_close_to_bf16(small_llama, engine_factory, engine_runner, greedy_checker):
    loaded = small_llama._replace(model=copy.deepcopy(small_llama.model).to("cuda", torch.bfloat16))
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 90))] for _ in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    bf16 = engine_runner(engine_factory(loaded, device="cuda"), prompts, params)
    fp8_engine = engine_factory(loaded, device="cuda", kv_cache_dtype="fp8")
    assert fp8_engine.pool.storage("kv").dtype == torch.float8_e4m3fn
    fp8 = engine_runner(fp8_engine, prompts, params)
    for a, b in zip(fp8, bf16, strict=True):
        # The first token's log-probability moves by FP8 rounding of K/V only (3 mantissa bits).
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.15
    fp8_engine.check_integrity()


def test_pool_is_sized_from_free_memory(small_llama, engine_factory, capfd):
    loaded = small_llama._replace(model=copy.deepcopy(small_llama.model).to("cuda", torch.bfloat16))
    torch.cuda.empty_cache()
    engine = engine_factory(loaded, device="cuda", kv_cache_tokens=None, mem_fraction=0.5, cuda_graph=False)
    log = capfd.readouterr().err
    assert "activation reserve" in log and "warm-up forward" in log
    in_effect = "prefetch" if torch.cuda.get_device_capability()[0] >= 9 else "off"  # the default, auto
    assert f"programmatic dependent launch {in_effect} (--pdl auto)" in log
    free, _ = torch.cuda.mem_get_info()
    pool_bytes = engine.pool.num_bytes
    # Half of what was free after the reserve went to the pool, so about as much is still free.
    assert 0.8 < free / pool_bytes < 1.3, (free, pool_bytes)
    del engine
    torch.cuda.empty_cache()


def _compiled_variants() -> dict[str, list[str]]:
    """The specialization keys compiled so far of each of morion's Triton kernels, on the current device."""
    from triton.runtime.jit import JITFunction

    device = torch.cuda.current_device()
    keys: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("morion.ops."):
            continue
        for attribute, kernel in vars(module).items():
            if isinstance(kernel, JITFunction) and device in kernel.device_caches:
                keys[f"{name}.{attribute}"] = [str(key) for key in kernel.device_caches[device][0]]
    return keys


def test_serving_compiles_no_kernel_after_the_warm_up(tiny_qwen3_next, engine_factory, engine_runner):
    """After the engine's warm-up, requests of any shape run on kernels compiled already: a compile while
    serving stalls every running request for seconds (runner/warmup.py)."""
    loaded = tiny_qwen3_next._replace(model=copy.deepcopy(tiny_qwen3_next.model).to("cuda", torch.bfloat16))
    engine = engine_factory(
        loaded, device="cuda", page_size=16, chunk_size=256, max_running_requests=8, cuda_graph_max_batch=4
    )
    before = _compiled_variants()
    assert before, "the warm-up compiled no morion kernel"
    rng = random.Random(3)
    # Prompts of 1 to 300 tokens (chunked at 256), 1 to 8 running at once (graphs up to 4, eager above),
    # then prefix hits whose tails are short and long, at no page boundary.
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 7, 19, 33, 64, 100, 257, 300)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine_runner(engine, prompts, params)
    engine_runner(engine, prompts[:3], params)
    engine_runner(engine, [p + [5] * (3 + 11 * i) for i, p in enumerate(prompts)], params)
    after = _compiled_variants()
    # Each kernel's variants compiled while serving, and one it had before (Triton's key: what differs).
    grown = {
        name: (sorted(set(keys) - set(before.get(name, []))), before.get(name, [None])[0])
        for name, keys in after.items()
        if set(keys) - set(before.get(name, []))
    }
    assert not grown, f"kernels compiled while serving (new keys, one earlier key): {grown}"
