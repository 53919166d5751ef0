"""Qwen3.8-Flash-Next's incremental QSA and its decode / verify steps (seeded random weights of the tiny
config, model-architecture.md §5; QSA budget 16, below every sequence here, so selection happens):

- the compressed block keys cached per block always equal what recomputing them from the cached raw keys
  gives, after prefill chunks that split blocks, decode steps, prefix hits on the device and from the
  host tier, and speculative verify forwards;
- speculative decoding (verify forwards of 1 + 3 tokens, PLE and Gated DeltaNet state kept per position)
  gives exactly the plain greedy output, and prefix hits after it equal cold runs;
- decode and verify steps of QSA and PLE make no host sync and no data-dependent shape (what a CUDA graph
  needs), checked on the CPU by making every syncing call raise inside them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode

import morion.models.qwen4_exp as qwen4_exp
from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from morion.layers import qsa_attention
from morion.layers.ple import PLELayer
from morion.layers.qsa_attention import BLOCK_KEYS, INDEX_KEYS, QSAAttention, set_qsa_prefill
from morion.spec.synthetic import SyntheticDrafter
from tests.models.conftest import QWEN4_EXP_EOS as EOS
from tests.models.conftest import QWEN4_EXP_TINY, PagedRunner, one_shot_logits, qwen4_exp_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
VOCAB = QWEN4_EXP_TINY["vocab_size"]


@pytest.fixture
def block_key_checks(monkeypatch, qwen4_exp_tiny) -> list[tuple[bool, bool]]:
    """After every QSA layer forward, each sequence's cached block keys must equal the keys recomputed
    from its cached raw keys (bit for bit: the same ops on the same values). Records (static step, the
    sequence had tokens before this step) per check."""
    checks: list[tuple[bool, bool]] = []
    forward = QSAAttention.forward
    rotary = qwen4_exp_tiny.model.model.rotary

    def checked(self, x, positions, rotation, backend):
        out = forward(self, x, positions, rotation, backend)
        static = backend.decode_only or backend.verify_slots is not None
        ratio, dim = self.compress_ratio, self.indexer.head_dim
        for n, (_, length) in enumerate(backend.query_ranges):
            raw = backend.read_sequence_tokens(INDEX_KEYS, self.attention_ordinal, n)
            cached = backend.read_sequence_tokens(BLOCK_KEYS, self.attention_ordinal, n)
            blocks = raw.shape[0] // ratio
            expected = self.indexer.block_keys(raw, ratio, rotary)
            got = cached[: blocks * ratio].reshape(blocks, -1)[:, :dim]
            assert torch.equal(got, expected), f"layer {self.attention_ordinal}, sequence {n}"
            checks.append((static, raw.shape[0] > length))
        return out

    monkeypatch.setattr(QSAAttention, "forward", checked)
    return checks


def test_block_keys_equal_recomputation_through_prefill_decode_and_hits(
    qwen4_exp_tiny, engine_factory, engine_runner, block_key_checks
):
    """A budget of 12 makes chunks of one page (8: budget-bound chunks end on page boundaries), then each
    prompt's tail ends mid-block; follow-ups hit their prefix on the device, then from host memory."""
    engine = engine_factory(qwen4_exp_tiny, page_size=8, chunk_size=12, host_cache_gb=8 / 1024)
    prompts = qwen4_exp_prompts(3, seed=4, lengths=(20, 45))
    first = engine_runner(engine, prompts, GREEDY)
    follow_ups = [p + o.token_ids + [7, 8, 9] for p, o in zip(prompts, first, strict=True)]
    on_device = engine_runner(engine, follow_ups, GREEDY)
    assert all(o.usage.cached_tokens > 0 for o in on_device)
    engine.evict_device_cache()
    from_host = engine_runner(engine, follow_ups, GREEDY)
    assert all(o.usage.cached_tokens > 0 for o in from_host) and engine.cache_stats.host_hit_tokens > 0
    assert [o.token_ids for o in from_host] == [o.token_ids for o in on_device]
    assert {(True, True), (False, True), (False, False)} <= set(block_key_checks)
    engine.check_integrity()
    engine.close()


def test_pages_must_hold_whole_blocks(qwen4_exp_tiny):
    spec = qwen4_exp_tiny.model.cache_spec(8, torch.float32)
    assert [c.token_shape for c in spec.token_components][1:] == [(64,), (16,)]  # raw key, 1/4 block key
    with pytest.raises(MorionError, match="page size that is a multiple of its QSA compress ratio 4"):
        qwen4_exp_tiny.model.cache_spec(2, torch.float32)


def _spec_engine(loaded, drafter=None, **options) -> Engine:
    options = {"device": "cpu", "kv_cache_tokens": 4096, "page_size": 4, "chunk_size": 64, **options}
    return Engine(EngineConfig(**options), loaded, drafter=drafter)


@pytest.fixture(scope="module")
def plain_greedy(qwen4_exp_tiny, engine_runner):
    prompts = qwen4_exp_prompts(3, seed=5, lengths=(21, 30))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = engine_runner(_spec_engine(qwen4_exp_tiny, enable_prefix_cache=False), prompts, params)
    return prompts, [o.token_ids for o in outputs], params


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_speculative_verify_gives_the_plain_greedy_output(
    qwen4_exp_tiny, engine_runner, plain_greedy, block_key_checks, acceptance
):
    prompts, expected, params = plain_greedy
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    engine = _spec_engine(qwen4_exp_tiny, SyntheticDrafter(acceptance, oracle, VOCAB, seed=1), spec_width=3)
    assert [o.token_ids for o in engine_runner(engine, prompts, params)] == expected
    stats = engine.speculative.stats
    assert stats.verify_steps > 0 and stats.drafted_tokens > 0
    if acceptance == 0.5:
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
        # Follow-ups reuse pages and states that verify steps wrote (some right before a rejection).
        follow_ups = [[*sequence, 7, 8, 9] for sequence in oracle]
        cold = engine_runner(_spec_engine(qwen4_exp_tiny, enable_prefix_cache=False), follow_ups, params)
        hit = engine_runner(engine, follow_ups, params)
        assert [o.token_ids for o in hit] == [o.token_ids for o in cold]
        assert all(o.usage.cached_tokens > len(p) for o, p in zip(hit, prompts, strict=True))
    assert any(static for static, _ in block_key_checks)
    engine.check_integrity()


# -- prefill on the static path (what CUDA runs) ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "exact_ties"),
    [("static", True), ("static", False), ("selected", False)],
    ids=["static-transformers-ties", "static-lower-block-ties", "selected-kernel"],
)
def test_prefill_paths_equal_the_reference(qwen4_exp_tiny, engine_runner, monkeypatch, path, exact_ties):
    """Prefill chunks through the static selection in tiles of 8 queries give the per-sequence reference's
    logits and greedy output: prompts of 40 to 70 tokens (selection happens: budget 16), chunks of 22
    that split blocks, three sequences per step, then follow-ups that hit the prefix cache. "selected":
    long pieces at contexts up to 4 budgets (64 tokens: the logits' one 54-token piece, the engine's
    first two chunks) on the selected-blocks kernel (the interpreter's Triton), the rest on the split-KV
    static path: both kernels run, and the answers are the reference's (the kernel breaks ties to the
    lower block, as CUDA does)."""
    monkeypatch.setattr(QSAAttention, "exact_ties_on_cpu", exact_ties)
    monkeypatch.setattr(qsa_attention, "PREFILL_TILE_ROWS", (8, 8))
    prompts = qwen4_exp_prompts(3, seed=9, lengths=(40, 70))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs, logits = {}, {}
    kernels = {"_attend_selected": 0, "_attend_static": 0}
    for name in kernels:
        monkeypatch.setattr(QSAAttention, name, _counted(kernels, name, getattr(QSAAttention, name)))
    layers = [m for m in qwen4_exp_tiny.model.modules() if isinstance(m, QSAAttention)]
    for layer in layers:  # put back after the test: the engine's assembly sets it per layer
        monkeypatch.setattr(layer, "selected_prefill", False)
    monkeypatch.setattr(qsa_attention, "SELECTED_PREFILL_MAX_BUDGETS", 4)
    for static in (False, True):
        monkeypatch.setattr(QSAAttention, "static_prefill", static)
        kernel = "selected" if static and path == "selected" else "split"
        if static:  # the reference must not run at all
            monkeypatch.setattr(QSAAttention, "_attend_reference", _refuse("the reference path"))
        set_qsa_prefill(qwen4_exp_tiny.model, kernel)
        logits[static] = one_shot_logits(qwen4_exp_tiny.model, prompts[0], page_size=4)
        engine = _spec_engine(qwen4_exp_tiny, chunk_size=22, qsa_prefill=kernel)
        first = engine_runner(engine, prompts, params)
        follow_ups = [[*p, *o.token_ids, 5, 6, 7] for p, o in zip(prompts, first, strict=True)]
        second = engine_runner(engine, follow_ups, params)
        assert all(o.usage.cached_tokens > 0 for o in second)
        outputs[static] = [o.token_ids for o in first + second]
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=0)
    assert outputs[True] == outputs[False]
    assert kernels["_attend_static"] > 0  # decode steps, short pieces (and long contexts: "selected")
    assert (kernels["_attend_selected"] > 0) == (path == "selected")


def test_the_disk_tier_keeps_each_qsa_prefill_kernel_s_conversations_apart(
    qwen4_exp_tiny, monkeypatch, tmp_path
):
    """The two prefill kernels sum a row's keys in different orders: a conversation cached under one is
    never restored under the other (each its own disk namespace; the same one for the same kernel)."""
    for layer in (m for m in qwen4_exp_tiny.model.modules() if isinstance(m, QSAAttention)):
        monkeypatch.setattr(layer, "selected_prefill", False)  # the engines below set it
    directories = []
    for kernel in ("split", "selected", "split"):
        engine = _spec_engine(
            qwen4_exp_tiny,
            host_cache_gb=0.01,
            disk_cache_dir=str(tmp_path),
            disk_cache_gb=0.1,
            qsa_prefill=kernel,
        )
        try:
            assert engine.tiers.disk.enabled
            directories.append(engine.tiers.disk.dir)
        finally:
            engine.close()
    assert directories[0] == directories[2] != directories[1]


def _counted(calls: dict[str, int], name: str, method):
    def counted(self, *args):
        calls[name] += 1
        return method(self, *args)

    return counted


# -- no host sync in decode and verify steps ---------------------------------------------------------


def _refuse(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} in a decode / verify step: a host sync or a data-dependent shape")

    return refuse


@contextlib.contextmanager
def _no_host_sync() -> Iterator[None]:
    """Every call that reads a tensor's values on the host (a sync on CUDA) or makes a shape from them
    raises while inside: item, tolist, numpy, cpu, bool / int / float / index conversions, nonzero,
    unique, masked_select and indexing with a boolean mask."""
    patches = {
        (torch.Tensor, name): _refuse(f"Tensor.{name}")
        for name in (
            "item", "tolist", "numpy", "cpu", "nonzero", "unique", "masked_select",
            "__bool__", "__int__", "__float__", "__index__",
        )
    }  # fmt: skip
    patches.update(
        {(torch, name): _refuse(f"torch.{name}") for name in ("nonzero", "unique", "masked_select")}
    )
    # Only what the owner defines itself is put back; an inherited method (most of Tensor's come from
    # torch._C.TensorBase) is deleted again rather than copied into Tensor.
    saved = {(owner, name): vars(owner).get(name) for owner, name in patches}
    try:
        for (owner, name), replacement in patches.items():
            setattr(owner, name, replacement)
        with _RefuseBooleanMasks():
            yield
    finally:
        for (owner, name), original in saved.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class _RefuseBooleanMasks(TorchFunctionMode):
    """Tensor indexing with a boolean mask (a data-dependent shape) raises. A mode, not a patch of
    Tensor.__getitem__: CPython cannot take such a patch back (setting __getitem__ on Tensor fills its
    sequence slot too, and deleting it leaves that slot, so torch.tensor() of a list of 0-d tensors then
    calls len() on them, and a later test failed)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1]
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                raise AssertionError("boolean-mask indexing in a decode / verify step")
        return func(*args, **(kwargs or {}))


def test_decode_and_verify_steps_make_no_host_sync(qwen4_exp_tiny, monkeypatch):
    """QSA's and PLE's decode and verify steps run with every syncing call refused (the fixed-size top-k:
    ties to the lower block, as on CUDA), and give the logits a one-shot prefill of the same tokens
    gives (the per-sequence reference path, told to break ties the same way)."""
    monkeypatch.setattr(QSAAttention, "exact_ties_on_cpu", False)
    strict_calls = []

    def strict(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            backend = next(a for a in (*args, *kwargs.values()) if hasattr(a, "query_ranges"))
            # (A PLE layer inside a verify forward sees one token column, a backend without these.)
            verify = getattr(backend, "verify_slots", None) is not None
            if not (getattr(backend, "decode_only", True) or verify):
                return function(*args, **kwargs)
            strict_calls.append(function.__name__)
            with _no_host_sync():
                return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(QSAAttention, "forward", strict(QSAAttention.forward))
    monkeypatch.setattr(PLELayer, "forward", strict(PLELayer.forward))
    monkeypatch.setattr(qwen4_exp, "fetch_static", strict(qwen4_exp.fetch_static))
    monkeypatch.setattr(qwen4_exp, "forward_verify", strict(qwen4_exp.forward_verify))

    model = qwen4_exp_tiny.model
    prompts = {
        0: qwen4_exp_prompts(1, seed=6, lengths=(30, 30))[0],
        1: qwen4_exp_prompts(1, seed=7, lengths=(19, 19))[0],
    }
    runner = PagedRunner(model, 2, drafts=2, pages_per_sequence=16)
    logits = {seq: [rows] for seq, rows in runner.run(prompts).items()}
    steps = [
        ({0: [11], 1: [EOS]}, False),
        ({0: [12], 1: [13]}, False),
        ({0: [14, 15, 16], 1: [17, 18, 19]}, True),
    ]
    for new_tokens, verify in steps:
        for seq, rows in runner.run(new_tokens, verify).items():
            logits[seq].append(rows)
    assert {"forward", "fetch_static", "forward_verify"} <= set(strict_calls)
    for seq in prompts:
        whole = PagedRunner(model, pages_per_sequence=16).run({0: runner.tokens[seq]})[0]
        assert (torch.cat(logits[seq]) - whole).abs().max() < 1e-4, f"sequence {seq}"


def test_every_forward_fetches_ple_rows_with_no_host_sync(qwen4_exp_tiny, monkeypatch):
    """PLE's rows are hashed and gathered on the device with every syncing call refused in every forward:
    prompt tails of one length (the shape of a short-chunk CUDA graph) take the static path; prefill
    chunks and tails of mixed lengths the ragged one (positions from the batch's layout). Both give the
    logits of a one-shot prefill of the same tokens (whose prefill parity with transformers is
    test_qwen4_exp_parity's)."""
    paths: list[tuple[str, int]] = []

    def no_sync_fetch(function):
        @functools.wraps(function)
        def wrapper(ple, input_ids, backend):
            paths.append((function.__name__, len(backend.query_ranges)))
            with _no_host_sync():
                return function(ple, input_ids, backend)

        return wrapper

    for name in ("fetch_static", "fetch_prefill"):
        monkeypatch.setattr(qwen4_exp, name, no_sync_fetch(getattr(qwen4_exp, name)))
    model = qwen4_exp_tiny.model
    ple_layers = sum(layer.ple is not None for layer in model.model.layers)
    prompts = {
        0: qwen4_exp_prompts(1, seed=8, lengths=(27, 27))[0],
        1: qwen4_exp_prompts(1, seed=9, lengths=(21, 21))[0],
    }
    runner = PagedRunner(model, 2, pages_per_sequence=16)
    logits = {seq: [rows] for seq, rows in runner.run(prompts).items()}
    assert paths == [("fetch_prefill", 2)] * ple_layers
    steps = [
        ({0: [11, EOS, 12, 13, 14], 1: [15, 16, 17, 18, 19]}, ("fetch_static", 2)),  # one length
        ({0: [20, 21], 1: [22, EOS, 24]}, ("fetch_prefill", 2)),  # mixed lengths
        ({0: [25] * 16}, ("fetch_static", 1)),  # a whole page's tail alone
        ({0: [EOS, 26, 27] * 7, 1: [28]}, ("fetch_prefill", 2)),  # a chunk beside a decode token
    ]
    for new_tokens, expected in steps:
        paths.clear()
        for seq, rows in runner.run(new_tokens).items():
            logits[seq].append(rows)
        assert paths == [expected] * ple_layers
    for seq in prompts:
        whole = PagedRunner(model, pages_per_sequence=16).run({0: runner.tokens[seq]})[0]
        assert (torch.cat(logits[seq]) - whole).abs().max() < 1e-4, f"sequence {seq}"
