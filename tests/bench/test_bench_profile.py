"""`morion bench --profile`: a profiled bench of the tiny Qwen3-Next on the CPU (every part of the step named,
CPU ops per step, the trace), and the trace reader on a hand-made CUDA trace, where kernels are attributed
to the host part that launched them and the device's idle time is found between them."""

from __future__ import annotations

import json

import pytest

from morion.bench import roofline
from morion.bench.profile import expert_bandwidth
from morion.bench.profile_report import profile_markdown
from morion.bench.profile_trace import innermost_segments, step_range, summarize
from morion.runner.profile_ranges import FORWARD, MODULE_PREFIX, SAMPLING
from tests.bench.conftest import run_bench

SWEEP = ["--device", "cpu", "--kv-cache-tokens", "2048", "--workloads", "decode,prefill,spec",
         "--concurrency", "1", "--contexts", "32", "--output-tokens", "4", "--repeats", "1",
         "--warmup-runs", "0", "--prefill-lengths", "32", "--speculative", "mtp", "--spec-width", "2",
         "--spec-mean-accepted", "1.5"]  # fmt: skip
# The tiny model stacks its shared expert with the routed ones (layers/moe.py): no part of its own.
MODEL_PARTS = {
    "full attention",
    "Gated DeltaNet",
    "MoE block, other ops (router, route)",
    "MoE experts",
    "embedding",
}


@pytest.fixture(scope="module")
def benches(tiny_qwen3_next_config_dir, tmp_path_factory) -> tuple[dict, dict, str, str]:
    """The same sweep without and with --profile: (plain JSON, profiled JSON, its Markdown, trace path)."""
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy", *SWEEP]
    results = []
    for label in ("plain", "profiled"):
        out = tmp_path_factory.mktemp(label)
        trace = out / "trace.json"
        extra = ["--profile-trace", str(trace)] if label == "profiled" else []
        status, stderr = run_bench([*model, *extra, "--label", label], out)
        assert status == 0, stderr
        [path] = out.glob(f"*-{label}.json")
        results.append((json.loads(path.read_text()), path.with_suffix(".md").read_text(), trace))
    (plain, _, _), (profiled, markdown, trace) = results
    return plain, profiled, markdown, trace


def test_the_profile_names_every_part_of_a_step_and_they_add_up_to_the_step(benches):
    _, result, _, _ = benches
    section = result["profile"]
    assert section["device_timeline"] is False and "after the measured ones" in section["note"]
    # The spec workload profiles its speculative engine before closing it; the others follow.
    assert [(p["workload"], p["step_kind"]) for p in section["points"]] == [
        ("spec", "decode"),
        ("decode", "decode"),
        ("prefill", "prefill"),
    ]
    decode = section["points"][1]
    assert decode["output_tokens"] == 4 and decode["cuda_graphs"] is False and decode["as_served"] is None
    for point in section["points"]:
        summary = point["by_module"]
        parts = {part["part"]: part for part in summary["by_part"]}
        # A verify step's tokens come from its acceptance, after the drafts; the others' from sampling.
        speculative = {"drafting (speculative)", "acceptance (speculative)"}
        assert MODEL_PARTS | {"LM head"} | (
            speculative if point["workload"] == "spec" else {"sampling"}
        ) <= set(parts)
        assert all(part["host_ms"] > 0 and part["device_ms"] is None for part in parts.values())
        model_ms = sum(parts[name]["host_ms"] for name in MODEL_PARTS)
        assert 0 < model_ms <= sum(part["host_ms"] for part in parts.values()) <= summary["step_ms"] * 1.0001
        assert summary["ops_are"] == "CPU ops (outermost)" and summary["ops_per_step"] > 20
        assert 0 < summary["op_ms_per_step"] <= summary["step_ms"]
        assert summary["top_ops"] and summary["top_ops"][0]["ms_per_step"] > 0
        assert 0 < summary["host"]["outside_forward_ms"] < summary["step_ms"]
        assert summary["host"]["device_idle"] is None
    assert decode["by_module"]["steps"] == 3  # 4 tokens: the prefill's, then 3 decode steps
    assert all(point["experts"] is None for point in section["points"])  # no device time on a CPU


def test_profiling_leaves_the_measured_sections_as_they_were(benches):
    plain, profiled, _, _ = benches
    assert plain["profile"] is None
    for workload in ("decode", "prefill"):
        [without], [with_profile] = plain[workload], profiled[workload]
        assert with_profile.keys() == without.keys()
        assert with_profile["runs"][0].keys() == without["runs"][0].keys()
        assert with_profile["median"].keys() == without["median"].keys()
    assert profiled["spec"].keys() == plain["spec"].keys()
    assert profiled["spec"]["points"][0].keys() == plain["spec"]["points"][0].keys()


def test_the_report_has_a_profile_section_and_the_trace_opens(benches):
    _, result, markdown, trace = benches
    assert "## Profile: where a step's time goes" in markdown
    assert "| Gated DeltaNet |" in markdown and "CUDA only" in markdown
    assert result["profile"]["trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {step_range(0), FORWARD, SAMPLING, f"{MODULE_PREFIX}Gated DeltaNet"} <= names


def test_profile_needs_the_offline_engine(tmp_path):
    status, stderr = run_bench(["--url", "http://127.0.0.1:9", "--profile"], tmp_path)
    assert status == 1 and "--profile needs the offline engine" in stderr


def test_nested_ranges_become_segments_of_the_innermost():
    ranges = [
        (0, 100, "step"),
        (10, 60, "forward"),
        (20, 30, "moe"),
        (22, 25, "shared"),
        (70, 80, "sampling"),
    ]
    assert innermost_segments(ranges) == [
        (0, 10, "step"), (10, 20, "forward"), (20, 22, "moe"), (22, 25, "shared"), (25, 30, "moe"),
        (30, 60, "forward"), (60, 70, "step"), (70, 80, "sampling"), (80, 100, "step"),
    ]  # fmt: skip


def _event(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def test_kernels_count_for_the_part_that_launched_them_and_idle_time_is_found_between_them():
    """One decode step of 100 us on a CUDA timeline: the forward launches two kernels inside a Gated
    DeltaNet range and one graph outside any module; sampling launches one more. A prefill step beside it
    is left out of the decode figures."""
    gdn = f"{MODULE_PREFIX}Gated DeltaNet"
    events = [
        _event("user_annotation", step_range(0), 0, 100),
        _event("user_annotation", FORWARD, 5, 60),
        _event("user_annotation", gdn, 10, 20),
        _event("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=1),
        _event("cuda_runtime", "cudaLaunchKernel", 15, 2, correlation=2),
        _event("cuda_runtime", "cudaGraphLaunch", 40, 5, correlation=3),
        _event("user_annotation", SAMPLING, 70, 20),
        _event("cuda_runtime", "cudaLaunchKernel", 72, 2, correlation=4),
        # On the device: 20-30, 30-35 (GDN), 50-60 (graph), 75-80 (sampling).
        _event("kernel", "gdn_fwd", 20, 10, correlation=1),
        _event("kernel", "conv_step", 30, 5, correlation=2),
        _event("kernel", "moe_fused", 50, 10, correlation=3),
        _event("kernel", "argmax", 75, 5, correlation=4),
        # A prefill step after it, with a kernel of its own.
        _event("user_annotation", step_range(1), 200, 50),
        _event("cuda_runtime", "cudaLaunchKernel", 210, 2, correlation=5),
        _event("kernel", "prefill_gemm", 215, 30, correlation=5),
    ]
    summary = summarize({"traceEvents": events}, ["decode", "prefill"], "decode")
    assert summary["steps"] == 1 and summary["step_ms"] == pytest.approx(0.1)
    assert summary["ops_are"] == "CUDA kernels and copies" and summary["ops_per_step"] == 4
    assert summary["op_ms_per_step"] == pytest.approx(0.030)
    parts = {part["part"]: part for part in summary["by_part"]}
    assert (
        parts["Gated DeltaNet"]["device_ms"] == pytest.approx(0.015) and parts["Gated DeltaNet"]["ops"] == 2
    )
    assert parts["Gated DeltaNet"]["host_ms"] == pytest.approx(0.020)
    assert parts["sampling"]["device_ms"] == pytest.approx(0.005)
    assert sum(part["host_ms"] for part in parts.values()) == pytest.approx(0.1)
    assert summary["host"]["outside_forward_ms"] == pytest.approx(0.040)
    idle = summary["host"]["device_idle"]
    assert idle["busy_ms"] == pytest.approx(0.030) and idle["idle_ms"] == pytest.approx(0.070)
    assert idle["before_first_ms"] == pytest.approx(0.020) and idle["after_last_ms"] == pytest.approx(0.020)
    assert idle["between_ms"] == pytest.approx(0.030)
    assert summarize({"traceEvents": events}, ["decode", "prefill"], "prefill")["ops_per_step"] == 1
    # The report's CUDA lines, from that summary as a profiled point's by-module and as-served passes.
    point = {"workload": "decode", "concurrency": 1, "prompt_tokens": 1024, "step_kind": "decode",
             "cuda_graphs": True, "by_module": summary, "as_served": summary}  # fmt: skip
    section = {"note": "note", "device": "cuda:0", "device_timeline": True, "trace": None, "points": [point]}
    text = "\n".join(profile_markdown(section))
    assert "| Gated DeltaNet | 0.020 | 0.015 | 2 |" in text and "CUDA only" not in text
    assert "As served (CUDA graphs as the engine replays them, 0.10 ms per step): 4 CUDA kernels" in text
    assert "Device idle 0.070 ms per step (busy 0.030): 0.020 before its first kernel" in text
    assert "| `moe_fused` | 1.0 | 0.010 | 0.010 |" in text


def test_the_expert_kernels_time_is_set_against_the_bytes_they_read():
    """Two MoE layers of 8 experts, top-2, 1 MB an expert, the shared expert stacked: one token's step
    reads 2 x 3 MB; in 0.004 ms of the "MoE experts" part that is 1.5 TB/s, which the report states."""
    layer = roofline.MoELayer(8, 2, 10**6, 10**6, stacked_shared=True)
    cost = roofline.ModelCost(0, 0, 0, (layer, layer), 0, 0, (), {}, "model")
    parts = [{"part": "MoE experts", "host_ms": 0.1, "device_ms": 0.004, "ops": 2}]
    experts = expert_bandwidth(cost, 1, {"by_part": parts})
    assert experts == pytest.approx(
        {"weight_bytes_per_step": 6e6, "device_ms_per_step": 0.004, "tb_per_s": 1.5}
    )
    assert expert_bandwidth(cost, 1, {"by_part": [{**parts[0], "device_ms": None}]}) is None
    assert expert_bandwidth(cost, 1, {"by_part": []}) is None
    summary = {"step_kind": "decode", "steps": 1, "step_ms": 0.1, "by_part": parts}
    point = {"workload": "decode", "concurrency": 1, "prompt_tokens": 1024, "step_kind": "decode",
             "cuda_graphs": False, "by_module": summary, "as_served": None, "experts": experts}  # fmt: skip
    summary.update(ops_are="CUDA kernels and copies", ops_per_step=2, op_ms_per_step=0.004, top_ops=[],
                   host={"outside_forward_ms": 0.01, "device_idle": None})  # fmt: skip
    section = {"note": "note", "device": "cuda:0", "device_timeline": True, "trace": None, "points": [point]}
    text = "\n".join(profile_markdown(section))
    assert "0.006 GB of expert weights a step" in text and "**1.50 TB/s**" in text


def test_a_kernel_that_starts_while_the_one_before_it_runs_owns_only_the_time_after_it():
    """Programmatic dependent launch: `norm` starts at 30 while `down` runs to 40 and waits for it; it owns
    40-45, `down` 20-40 and the nested `tiny` (25-28, inside `down`) nothing. Own times add up to the busy
    time (25 us) where the spans add up to 43; the ranking follows own time."""
    events = [
        _event("user_annotation", step_range(0), 0, 100),
        _event("user_annotation", FORWARD, 5, 60),
        *(_event("cuda_runtime", "cudaLaunchKernel", 10 + i, 1, correlation=i) for i in range(3)),
        _event("kernel", "down", 20, 20, correlation=0),
        _event("kernel", "tiny", 25, 3, correlation=1),
        _event("kernel", "norm", 30, 15, correlation=2),
    ]
    summary = summarize({"traceEvents": events}, ["decode"], "decode")
    top = {op["name"]: op for op in summary["top_ops"]}
    assert [op["name"] for op in summary["top_ops"]] == ["down", "norm", "tiny"]
    assert top["norm"]["own_ms_per_step"] == pytest.approx(0.005) and top["norm"][
        "ms_per_step"
    ] == pytest.approx(0.015)
    assert top["down"]["own_ms_per_step"] == pytest.approx(0.020) and top["tiny"]["own_ms_per_step"] == 0
    busy = summary["host"]["device_idle"]["busy_ms"]
    assert (
        sum(op["own_ms_per_step"] for op in summary["top_ops"]) == pytest.approx(busy) == pytest.approx(0.025)
    )


def test_a_prefill_point_is_also_profiled_as_its_piecewise_graphs_replay(tiny_qwen3_next, engine_factory):
    """With prefill graphs (here the CPU stand-in for them, tests/engine/test_prefill_graph.py), a prefill
    point gets its as-served pass too: the by-module pass runs eagerly (no replay), the as-served one
    replays the graphs, and the report says which graphs it timed."""
    from types import SimpleNamespace

    from morion.bench.profile import ProfilePoint, ProfileSession
    from tests.engine.test_prefill_graph import PAGE, graph_runner

    engine = engine_factory(tiny_qwen3_next, page_size=PAGE, chunk_size=64, enable_prefix_cache=False)
    engine.runner.prefill_graphs = graphs = graph_runner(engine).prefill_graphs
    session = ProfileSession(SimpleNamespace(profile_trace=None))
    bench = SimpleNamespace(label="t", say=lambda line: None)
    prompts = [[(7 * i + n) % 500 for i in range(40)] for n in range(4)]  # 2 a pass: a warm-up, a profiled
    session.profile(
        bench, engine, ProfilePoint("prefill", 1, 40, 1, "prefill"), lambda *_: prompts.pop(), None
    )
    assert graphs.replays == 2  # the as-served pass's prompts only
    [served] = session.points
    assert served["cuda_graphs"] is True and served["as_served"]["step_kind"] == "prefill"
    assert served["by_module"]["steps"] == served["as_served"]["steps"] >= 1
    markdown = "\n".join(profile_markdown(session.section(bench)))
    assert "As served (piecewise prefill CUDA graphs as the engine replays them" in markdown


def test_a_turn_point_profiles_only_the_turn_on_its_primed_conversation(tiny_qwen3_next, engine_factory):
    """A turn point primes each pass's conversations unprofiled, then profiles the turn alone: its steps
    compute only the appended tokens (and the one after the conversation) on the cached pages; an engine
    that cached nothing fails the point rather than profile a cold prefill as a turn."""
    from types import SimpleNamespace

    from morion.bench.profile import ProfilePoint, ProfileSession

    engine = engine_factory(tiny_qwen3_next, page_size=16, chunk_size=64)
    session = ProfileSession(SimpleNamespace(profile_trace=None))
    bench = SimpleNamespace(label="t", say=lambda line: None)
    made: list[tuple[str, int]] = []

    def prompts(key: str, length: int) -> list[int]:
        made.append((key, length))
        return [(13 * i + len(made)) % 500 for i in range(length)]

    point = ProfilePoint("turn", 1, 24, 1, "prefill", cached_tokens=32)
    assert point.name == "turn 32+24"
    session.profile(bench, engine, point, prompts, None)
    # One pass on the CPU (no graphs): a conversation of 33 tokens and 24 new ones, warm and profiled.
    assert sorted(length for _, length in made) == [24, 24, 33, 33]
    [served] = session.points
    assert served["cached_tokens"] == 32 and served["by_module"]["steps"] >= 1
    markdown = "\n".join(profile_markdown(session.section(bench)))
    assert "### turn: 24 new tokens on 32 cached: " in markdown

    cold = engine_factory(tiny_qwen3_next, page_size=16, chunk_size=64, enable_prefix_cache=False)
    with pytest.raises(RuntimeError, match="found 0 of its conversation's 32 tokens cached"):
        session.profile(bench, cold, point, prompts, None)
