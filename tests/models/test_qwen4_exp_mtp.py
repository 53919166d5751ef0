"""Qwen3.8-Flash-Next's MTP head as the speculative drafter (`--speculative mtp`), on seeded random weights
of the tiny config (model-architecture.md §5; QSA budget 16, below the long prompts here, so the trunk's
and the head's QSA layers both select blocks). The dummy loader draws `mtp.*` weights too (transformers'
`save_pretrained` writes none).

- the head's forward (`mtp_forward` + its mixer + the LM head) equals a per-token pure-torch computation
  of its formula written here from the module's parameters: fusion, hyper-connections, QSA with block
  selection, MoE, mixer, LM head; in one extend, and in chunks, a uniform verify-shaped step and
  single-token steps (the drafter's three shapes);
- greedy output with the head drafting equals output without speculation, token for token (batched
  requests, prompts past the QSA budget, a FR-Spec reduced draft vocabulary);
- drafts made right after a verify step (the fixed-shape path that replays as CUDA graphs) equal drafts
  made on demand, at real and at forced acceptance; its QSA layers take the static path there and make no
  host sync (what a CUDA graph needs);
- the draft-graph runner's buffers are as wide as the target's pre-mixer streams (run eagerly on the CPU);
- prefix hits on the device and from the host tier with speculation on equal cold runs: the head's K/V,
  raw index keys and block keys are further layers of the trunk's token components.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from morion.cache.page_pool import PagePool
from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.layers.qsa_attention import QSAAttention
from morion.runner.backend import PagedAttentionBackend
from morion.runner.forward_batch import build_forward_batch
from morion.spec.forced import ForcedAcceptance
from morion.spec.mtp import MtpDrafter, _UniformBackend
from morion.spec.mtp_graph import MtpDraftGraphs
from tests.conftest import PendingOnlyMtp, recorded_proposals, small_token_map
from tests.models.conftest import QWEN4_EXP_EOS as EOS
from tests.models.conftest import QWEN4_EXP_TINY, qwen4_exp_prompts
from tests.models.test_qwen4_exp_incremental import _no_host_sync

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAGE = 8
WIDTH = 3
BUDGET, RATIO = QWEN4_EXP_TINY["indexer_budget"], QWEN4_EXP_TINY["indexer_compress_ratio"]


def _engine(loaded, forced: ForcedAcceptance | None = None, **options) -> Engine:
    options = {"device": "cpu", "kv_cache_tokens": 4096, "page_size": PAGE, "chunk_size": 64, **options}
    return Engine(EngineConfig(**options), loaded, forced_acceptance=forced)


def _mtp_engine(loaded, forced: ForcedAcceptance | None = None, **options) -> Engine:
    return _engine(loaded, forced, speculative="mtp", spec_width=WIDTH, **options)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Five prompts of 5 to 60 tokens: most pass the QSA budget (select blocks), one or two do not."""
    chosen = qwen4_exp_prompts(5, seed=11, lengths=(5, 60))
    assert max(map(len, chosen)) > BUDGET + RATIO and min(map(len, chosen)) < BUDGET
    return chosen


@pytest.fixture(scope="module")
def plain(qwen4_exp_tiny, engine_runner, prompts) -> list[list[int]]:
    """Greedy outputs without speculation and without a prefix cache."""
    engine = _engine(qwen4_exp_tiny, enable_prefix_cache=False)
    return [o.token_ids for o in engine_runner(engine, prompts, GREEDY)]


# -- the head's math, written out -------------------------------------------------------------------


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm over the whole vector, or over each `group`-wide piece of it."""
    x32 = x.float() if group is None else x.float().unflatten(-1, (-1, group))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32.flatten(-2) if group is not None else x32) * (1.0 + weight.float())


def _rope(x: torch.Tensor, position: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of the first `rotary_dim` dims of x [..., D] at `position`."""
    angles = position / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    cos, sin = (
        torch.cat((angles.cos(), angles.cos())).float(),
        torch.cat((angles.sin(), angles.sin())).float(),
    )
    part = x[..., :rotary_dim]
    half = rotary_dim // 2
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    return torch.cat((part * cos + rotated * sin, x[..., rotary_dim:]), dim=-1)


def _hyper_mix(hc, streams: torch.Tensor, n: int, hidden: int, eps: float):
    """A hyper-connection over one token's streams [n * H]: (the block input [H], inject weights [n])."""
    normed = _norm(streams, hc.hc_norm.weight, eps, group=hidden)
    down = hc.input_mix_weight_down.weight @ normed
    gate = torch.sigmoid(hc.input_mix_weight_up.weight @ F.silu(down / n))
    mixed = (gate * normed).view(n, hidden).mean(dim=0)
    if hc.block_inject_weight is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(hc.block_inject_weight.weight @ normed / n)


def _moe(mlp, x: torch.Tensor, top_k: int, renormalise: bool) -> torch.Tensor:
    """Softmax router, top-k (renormalised), SwiGLU experts, plus the sigmoid-gated shared expert (stacked
    as the last expert and the router's last row, or its own modules)."""
    slot = mlp.shared_slot
    logits = mlp.gate.weight @ x
    probs = torch.softmax(logits if slot is None else logits[:slot], dim=-1)
    weights, ids = probs.topk(top_k)
    if renormalise:
        weights = weights / weights.sum()
    if slot is not None:
        weights = torch.cat((weights, torch.sigmoid(logits[slot:])))
        ids = torch.cat((ids, torch.tensor([slot])))
    out = torch.zeros_like(x)
    for weight, expert in zip(weights, ids.tolist(), strict=True):
        gate_up = mlp.experts.gate_up_proj[expert] @ x
        gate, up = gate_up.chunk(2)
        out += weight * (mlp.experts.down_proj[expert] @ (F.silu(gate) * up))
    if slot is not None:
        return out
    shared = mlp.shared_expert
    shared_out = shared.down_proj.weight @ (F.silu(shared.gate_proj.weight @ x) * (shared.up_proj.weight @ x))
    return out + torch.sigmoid(mlp.shared_expert_gate.weight @ x) * shared_out


def _qsa(attn, xs: list[torch.Tensor], rotary_dim: int, theta: float, eps: float) -> list[torch.Tensor]:
    """The QSA layer over one sequence's inputs xs[p] [H] at positions p = 0, 1, ..., token by token: gated
    attention whose query at p sees the tokens of its best min(budget / r, complete) blocks (scored by the
    indexer over the blocks' pooled, normed, rotated raw keys) and the unfinished block's tail."""
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    indexer = attn.indexer
    ihead, idim = indexer.num_heads, indexer.head_dim
    ratio, topk = RATIO, BUDGET // RATIO  # from the config, not the module
    keys, values, raw, queries, gates, index_queries = [], [], [], [], [], []
    for position, x in enumerate(xs):
        q_gate = (attn.q_proj.weight @ x).view(heads, 2 * dim)
        q = _rope(_norm(q_gate[:, :dim], attn.q_norm.weight, eps), position, rotary_dim, theta)
        k = (attn.k_proj.weight @ x).view(kv_heads, dim)
        keys.append(_rope(_norm(k, attn.k_norm.weight, eps), position, rotary_dim, theta))
        values.append((attn.v_proj.weight @ x).view(kv_heads, dim))
        queries.append(q)
        gates.append(q_gate[:, dim:])
        index = (indexer.index_qk_proj.weight @ x).view(ihead + 1, idim)
        index_queries.append(
            _rope(_norm(index[:ihead], indexer.q_layernorm.weight, eps), position, rotary_dim, theta)
        )
        raw.append(index[ihead])
    outs = []
    for position in range(len(xs)):
        complete = (position + 1) // ratio
        pooled = [torch.stack(raw[b * ratio : (b + 1) * ratio]).mean(0) for b in range(complete)]
        block_keys = [
            _rope(_norm(key, indexer.k_layernorm.weight, eps), b * ratio, rotary_dim, theta)
            for b, key in enumerate(pooled)
        ]
        if complete > topk:
            scores = torch.stack(
                [torch.relu(index_queries[position] @ key).sum() / math.sqrt(idim) for key in block_keys]
            )
            blocks = scores[None].topk(topk, dim=-1).indices[0].tolist()
        else:
            blocks = list(range(complete))
        seen = [b * ratio + i for b in blocks for i in range(ratio)] + list(
            range(complete * ratio, position + 1)
        )
        k = torch.stack([keys[p] for p in seen]).repeat_interleave(heads // kv_heads, dim=1)  # [N, Hq, D]
        v = torch.stack([values[p] for p in seen]).repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", queries[position], k) * dim**-0.5, dim=-1)
        attended = torch.einsum("hn,nhd->hd", weights, v)
        outs.append(attn.o_proj.weight @ (attended * torch.sigmoid(gates[position])).flatten())
    return outs


def _mtp_reference(model, inputs: list[int], target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(streams [L, n * H] before the head's mixer, logits [L, V]) of the MTP head at positions 0 .. L - 1
    with input tokens `inputs` (the token after each position) and target pre-mixer streams `target`."""
    config, mtp = model.config, model.mtp
    n, hidden, eps = config.hc_count, config.hidden_size, config.rms_norm_eps
    theta = QWEN4_EXP_TINY["rope_parameters"]["rope_theta"]
    rotary_dim = int(QWEN4_EXP_TINY["head_dim"] * QWEN4_EXP_TINY["rope_parameters"]["partial_rotary_factor"])
    streams = []
    for token, r in zip(inputs, target, strict=True):
        e = mtp.fc_embedding.weight @ _norm(
            model.model.embed_tokens.weight[token], mtp.pre_fc_norm_embedding.weight, eps
        )
        normed = _norm(r, mtp.pre_fc_norm_hidden.weight, eps)  # one RMS over all n * H values
        streams.append(torch.cat([mtp.fc_hidden.weight @ s + e for s in normed.view(n, hidden)]))
    for layer in mtp.layers:
        mixes = [_hyper_mix(layer.attn_hyper_connection, s, n, hidden, eps) for s in streams]
        attended = _qsa(layer.self_attn, [m for m, _ in mixes], rotary_dim, theta, eps)
        streams = [
            s + (a[None, :] * w[:, None]).flatten()
            for s, a, (_, w) in zip(streams, attended, mixes, strict=True)
        ]
        after = []
        for s in streams:
            mixed, w = _hyper_mix(layer.mlp_hyper_connection, s, n, hidden, eps)
            routed = _moe(layer.mlp, mixed, config.num_experts_per_tok, config.norm_topk_prob)
            after.append(s + (routed[None, :] * w[:, None]).flatten())
        streams = after
    # The head's own mixer, then the shared LM head (the target has no norm after its mixer either).
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    logits = torch.stack(
        [head @ _hyper_mix(mtp.hyper_connection_mixer, s, n, hidden, eps)[0] for s in streams]
    )
    return torch.stack(streams), logits


def _mtp_run(model, inputs: list[int], target: torch.Tensor, pieces: list[tuple[int, str]]):
    """The head through the engine's paged backend over one sequence, in `pieces` (count, kind): kind
    "extend" (the on-demand path: QSA's per-sequence reference), "uniform" (one sequence of n tokens as
    the after-verify draft runs it: QSA's static path) or "decode" (one token at a time, as the chained
    steps). Returns (streams, logits) of every position."""
    spec = model.cache_spec(PAGE, torch.float32, draft_layers=True)
    pages = -(-len(inputs) // PAGE)
    pool = PagePool(spec, pages)
    streams, logits, start = [], [], 0
    for count, kind in pieces:
        for first in range(start, start + count, 1 if kind == "decode" else count):
            size = 1 if kind == "decode" else count
            batch = build_forward_batch(
                [(inputs, list(range(pages)), first, size)], [None], PAGE, torch.device("cpu")
            )
            backend = (_UniformBackend if kind == "uniform" else PagedAttentionBackend)(pool, batch)
            with torch.inference_mode():
                out = model.mtp_forward(
                    batch.input_ids, batch.positions, target[first : first + size], backend
                )
                streams.append(out)
                logits.append(model.lm_logits(model.mtp_head_input(out)))
        start += count
    assert start == len(inputs)
    return torch.cat(streams), torch.cat(logits)


def test_mtp_forward_equals_its_formula_token_by_token(qwen4_exp_tiny):
    """Known inputs: random tokens, and target streams of different scales per stream (so one RMS over all
    n * H values differs from one per stream). 30 positions: from position 19 on, a query has more complete
    blocks than the budget's 4, so the head's QSA selects."""
    model = qwen4_exp_tiny.model
    config = model.config
    length = 30
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()
    scales = torch.arange(1, config.hc_count + 1, dtype=torch.float32).repeat_interleave(config.hidden_size)
    target = torch.randn(length, config.hc_count * config.hidden_size, generator=generator) * scales
    with torch.no_grad():
        want_streams, want_logits = _mtp_reference(model, inputs, target)
    assert (length - 1 + 1) // RATIO > BUDGET // RATIO  # the last queries select
    for pieces in ([(length, "extend")], [(13, "extend"), (4, "uniform"), (13, "decode")]):
        streams, logits = _mtp_run(model, inputs, target, pieces)
        assert streams.shape == (length, model.hidden_width)
        torch.testing.assert_close(streams, want_streams, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))


def test_cache_spec_pages_the_head_as_draft_layers(qwen4_exp_tiny):
    model = qwen4_exp_tiny.model
    plain = model.cache_spec(PAGE, torch.float32)
    drafted = model.cache_spec(PAGE, torch.float32, draft_layers=True)
    assert [c.name for c in drafted.token_components] == ["kv", "qsa_index_keys", "qsa_block_keys"]
    for before, after in zip(plain.token_components, drafted.token_components, strict=True):
        assert (
            after.num_layers == before.num_layers + len(model.mtp.layers)
            and after.token_shape == before.token_shape
        )
    assert drafted.state_components == plain.state_components  # the head keeps no per-request state
    assert _mtp_engine(qwen4_exp_tiny).pool.spec == drafted


def test_mtp_drafts_leave_greedy_output_unchanged(qwen4_exp_tiny, engine_runner, prompts, plain, tmp_path):
    """Batched requests, most prompts past the QSA budget; random weights draft badly, but the extend,
    the after-verify drafts, the chained steps and their caches all run. Then with a FR-Spec reduced
    draft vocabulary."""
    engine = _mtp_engine(qwen4_exp_tiny)
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == plain
    stats = engine.speculative.stats
    assert stats.verify_steps > 0 and stats.drafted_tokens == WIDTH * (
        stats.emitted_tokens - stats.accepted_tokens
    )
    engine.check_integrity()
    token_map = small_token_map(tmp_path, eos_id=EOS)
    reduced = _engine(qwen4_exp_tiny, speculative="mtp", spec_width=2, spec_token_map=str(token_map))
    assert [o.token_ids for o in engine_runner(reduced, prompts, GREEDY)] == plain
    assert reduced.speculative.stats.drafted_tokens > 0
    reduced.check_integrity()


@pytest.mark.parametrize("acceptance", [None, 0.6])
def test_mtp_drafts_made_after_verify_equal_those_made_on_demand(
    qwen4_exp_tiny, engine_runner, prompts, plain, acceptance
):
    """The fixed-shape draft right after a verify step (the head over all verify rows through QSA's static
    path, the accepted row's output, chained steps) proposes exactly what extending the accepted positions
    on demand does. Real acceptance is ~0 on random weights, so also with a forced one (the same draws in
    both engines), where the draft starts from later verify rows."""
    forced = [None if acceptance is None else ForcedAcceptance(acceptance, seed=2) for _ in range(2)]
    fixed, on_demand = (_mtp_engine(qwen4_exp_tiny, f) for f in forced)
    on_demand.speculative.drafter = PendingOnlyMtp(on_demand.speculative.drafter)
    records = [recorded_proposals(fixed), recorded_proposals(on_demand)]
    calls = []
    original = fixed.speculative.drafter.after_verify
    fixed.speculative.drafter.after_verify = lambda verified: (
        calls.append(verified.accepted.tolist()),
        original(verified),
    )[1]
    outputs = [[o.token_ids for o in engine_runner(engine, prompts, GREEDY)] for engine in (fixed, on_demand)]
    assert calls and records[0] == records[1] and outputs[0] == outputs[1]
    if acceptance is None:
        assert outputs[0] == plain
    else:
        assert any(a > 0 for accepted in calls for a in accepted)
        assert fixed.speculative.stats.accepted_tokens > 0


def test_after_verify_draft_makes_no_host_sync_in_qsa(qwen4_exp_tiny, engine_runner, prompts, monkeypatch):
    """The head's QSA layers in the after-verify draft (n tokens per sequence, `uniform_queries`) run with
    every syncing call refused (ties to the lower block, as on CUDA), as a captured draft graph needs."""
    monkeypatch.setattr(QSAAttention, "exact_ties_on_cpu", False)
    forward, widths = QSAAttention.forward, []

    def strict(self, x, positions, rotation, backend):
        if not getattr(backend, "uniform_queries", False):
            return forward(self, x, positions, rotation, backend)
        widths.append(backend.query_ranges[0][1])
        with _no_host_sync():
            return forward(self, x, positions, rotation, backend)

    monkeypatch.setattr(QSAAttention, "forward", strict)
    want = [
        o.token_ids
        for o in engine_runner(_engine(qwen4_exp_tiny, enable_prefix_cache=False), prompts, GREEDY)
    ]
    assert [o.token_ids for o in engine_runner(_mtp_engine(qwen4_exp_tiny), prompts, GREEDY)] == want
    assert widths and set(widths) == {WIDTH + 1}


def test_draft_graph_buffers_hold_the_pre_mixer_streams(
    qwen4_exp_tiny, engine_runner, prompts, plain, monkeypatch
):
    """The draft-graph setup (`MtpDrafter.capture_graphs`) with the runner prepared eagerly instead of
    captured (no CUDA here): its hidden buffer is n * H wide, and its static buffers, bucket padding and
    slicing give the plain after-verify drafts."""
    monkeypatch.setattr(MtpDraftGraphs, "capture", lambda self, pool: (self.prepare_eager(), pool)[1])
    reference = _mtp_engine(qwen4_exp_tiny)
    staged = _mtp_engine(qwen4_exp_tiny, max_running_requests=8)
    staged.runner.scratch_pages = staged.pool.alloc(1)  # padding rows write here, as on CUDA
    drafter = staged.speculative.drafter
    assert isinstance(drafter, MtpDrafter)
    decode = SimpleNamespace(max_batch=8, max_pages=64, memory_pool=None)
    drafter.capture_graphs(WIDTH, decode, staged.runner.scratch_pages[0])
    graphs = drafter.graphs[WIDTH]
    config = qwen4_exp_tiny.model.config
    assert (
        graphs._hidden.shape[-1] == config.hc_count * config.hidden_size == qwen4_exp_tiny.model.hidden_width
    )
    records = [recorded_proposals(reference), recorded_proposals(staged)]
    for engine in (reference, staged):
        assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == plain
    assert graphs.replays > 0 and records[0] == records[1]
    staged.check_integrity()


def _head_layers(engine, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The head's layer (the last of each token component) at the device cache's pages for `tokens`'
    longest cached prefix."""
    match = engine.prefix_cache.match_prefix(tokens)
    slots = engine.pool.token_slots(match.pages, match.num_tokens)
    return {c.name: engine.pool.storage(c.name)[-1][slots].clone() for c in engine.pool.spec.token_components}


def test_prefix_hits_with_mtp_equal_cold(qwen4_exp_tiny, engine_runner):
    """A follow-up hits the device cache, then (the device cache evicted) the host tier, with the head
    drafting, and equals a cold run. The pages carry the head's K/V, raw index keys and block keys with the
    trunk's: the host hit brings back exactly what the head had written."""
    (prompt,) = qwen4_exp_prompts(1, seed=3, lengths=(45, 45))
    engine = _mtp_engine(qwen4_exp_tiny, chunk_size=16, host_cache_gb=8 / 1024)
    cold = _engine(qwen4_exp_tiny, enable_prefix_cache=False)
    first = engine_runner(engine, [prompt], GREEDY)[0]
    assert first.token_ids == engine_runner(cold, [prompt], GREEDY)[0].token_ids
    follow_up = prompt + first.token_ids + [7, 8, EOS, 9, 10]
    want = engine_runner(cold, [follow_up], GREEDY)[0].token_ids
    device = engine_runner(engine, [follow_up], GREEDY)[0]
    assert device.usage.cached_tokens >= len(prompt) and device.token_ids == want
    again = follow_up + device.token_ids + [11, 12]
    want = engine_runner(cold, [again], GREEDY)[0].token_ids
    written = _head_layers(engine, again)
    assert written["kv"].shape[0] > len(follow_up) and all(v.abs().sum() > 0 for v in written.values())
    assert engine.evict_device_cache() > 0 and engine.prefix_cache.cached_snapshots == 0
    host = engine_runner(engine, [again], GREEDY)[0]
    stats = engine.cache_stats
    assert host.usage.cached_tokens == written["kv"].shape[0] == stats.host_hit_tokens
    assert host.token_ids == want and engine.speculative.stats.verify_steps > 0
    restored = _head_layers(engine, again)
    for name, values in written.items():
        assert torch.equal(restored[name][: values.shape[0]], values), name
    engine.check_integrity()
    engine.close()
