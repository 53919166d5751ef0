"""`morion bench --profile`: where a step's time goes, from torch.profiler, in extra runs after the measured
ones (the measured numbers are never taken under the profiler).

For each point of the profiled workloads (decode: every concurrency x context, with at most
`DECODE_TOKENS` output tokens; prefill: every length; ttft: its length; turn: `--turn-new` tokens on a
cached conversation of `--turn-prefix`, as bench/agent_turn.py runs it, each pass's conversations
primed unprofiled first, so that only the turn's own steps are profiled; spec: every concurrency x
context on its speculative engine, where drafting and acceptance have ranges of their own, profiled by
bench/speculative.py before it closes that engine), fresh prompts run twice in each pass: once
unprofiled (the pass's shapes compiled and tuned), then under the profiler, every engine step in a range
of its own (profile_trace.py reads the trace). Two passes:

- by module: the runner's ranges on (runner/profile_ranges.py), the model's parts in ranges of their
  kind, forwards eager (a CUDA graph replay runs no hooks): time by part of the step;
- as served: CUDA graphs as the engine uses them, only the forward, LM head and sampling in ranges:
  kernels per step, the top kernels and where the device waits for the host. It is its own pass only
  where decode would replay graphs; elsewhere the by-module pass is already what the engine runs (the
  ranges add a few microseconds of host time per model part).

On a CPU the "kernels" are the outermost CPU ops and there is no device timeline: idle device time is
CUDA only, and the report says so.

A plain decode point on CUDA also sets the MoE expert kernels' device time (the by-module pass's "MoE
experts" part: eager kernels, which start as they are launched, the host being far behind) against the
expert weight bytes a step of its batch reads (`roofline.expert_kernel_bytes`: the distinct experts
expected under independent routing, and a stacked shared expert): their bandwidth in TB/s (issues #23
and #25 ask it of the expert kernels, FP8 and NVFP4's packed weights alike). The part also holds the
rows' FP8 quantization where the expert stack does it itself, so the figure is a lower bound.
"""

from __future__ import annotations

import functools
import gzip
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import torch

from morion.bench import roofline
from morion.bench.agent_turn import check_prefix
from morion.bench.offline import EngineTarget, generate
from morion.bench.options import BenchOptions
from morion.bench.profile_trace import step_range, summarize
from morion.bench.workloads import Workbench
from morion.engine.engine import Engine
from morion.engine.outputs import StepOutput
from morion.runner.profile_ranges import MOE_EXPERTS

PromptMaker = Callable[[str, int], Sequence[int]]  # (key, length) -> a fresh prompt's token ids
DECODE_TOKENS = 16  # output tokens of a profiled decode run: enough steps for a mean, a trace that opens
NOTE = (
    "Profiled in extra runs after the measured ones, under torch.profiler (the numbers above were measured "
    "without it); times here include the profiler's own cost. Host times are wall time on the engine's "
    "thread; on CUDA a part's device time is that of the kernels its thread launched."
)


class ProfilePoint(NamedTuple):
    workload: str
    concurrency: int
    prompt_tokens: int  # a turn's: the tokens it appends to its cached conversation
    output_tokens: int
    step_kind: str  # the steps this point's figures are about: "decode" or "prefill"
    cached_tokens: int = 0  # a turn's conversation, cached before it is profiled (+1 token, agent_turn.py)

    @property
    def name(self) -> str:
        if self.workload in ("decode", "spec"):
            return f"{self.workload} C={self.concurrency} ctx={self.prompt_tokens:,}"
        if self.cached_tokens:
            return f"{self.workload} {self.cached_tokens:,}+{self.prompt_tokens:,}"
        return f"{self.workload} {self.prompt_tokens:,}"


def decode_point(workload: str, concurrency: int, context: int, options: BenchOptions) -> ProfilePoint:
    """A decode (or speculative decode) point's profiled run: its shape, at most DECODE_TOKENS out."""
    return ProfilePoint(workload, concurrency, context, min(options.output_tokens, DECODE_TOKENS), "decode")


def engine_points(options: BenchOptions) -> list[ProfilePoint]:
    """The points profiled on the bench's own engine (the spec workload profiles its speculative engine
    itself: bench/speculative.py)."""
    points = []
    if "decode" in options.workloads:
        for context in options.contexts:
            for c in options.concurrency:
                if not options.max_cell_prompt_tokens or c * context <= options.max_cell_prompt_tokens:
                    points.append(decode_point("decode", c, context, options))
    if "prefill" in options.workloads:
        points += [ProfilePoint("prefill", 1, length, 1, "prefill") for length in options.prefill_lengths]
    if "ttft" in options.workloads:
        points.append(ProfilePoint("ttft", 1, options.ttft_length, 1, "prefill"))
    if "turn" in options.workloads:
        points.append(ProfilePoint("turn", 1, options.turn_new, 1, "prefill", options.turn_prefix))
    return points


class ProfileSession:
    """The profiled points of one bench and their traces, gathered workload by workload."""

    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self.points: list[dict[str, Any]] = []
        self.trace = TraceFile(Path(options.profile_trace)) if options.profile_trace else None
        self.device: torch.device | None = None

    def profile(
        self,
        bench: Workbench,
        engine: Engine,
        point: ProfilePoint,
        prompts: PromptMaker,
        logprobs: int | None,
    ) -> None:
        """Both passes of `point` on `engine` (the by-module one, and the as-served one where its steps
        would replay CUDA graphs: decode graphs, or prefill's piecewise ones); `prompts(key, length)` makes
        a fresh prompt."""
        self.device = engine.device
        by_module, trace = _profiled_pass(engine, point, prompts, logprobs, by_module=True)
        self._keep(trace)
        replays = engine.graphs if point.step_kind == "decode" else engine.runner.prefill_graphs
        graphs = replays is not None
        as_served = None
        if graphs:
            as_served, trace = _profiled_pass(engine, point, prompts, logprobs, by_module=False)
            self._keep(trace)
        experts = None
        if point.workload == "decode" and by_module is not None:
            cost = roofline.from_model(engine.model, engine.pool.spec)
            experts = expert_bandwidth(cost, point.concurrency, by_module)
        self.points.append(
            {
                **point._asdict(),
                "cuda_graphs": graphs,
                "by_module": by_module,
                "as_served": as_served,
                "experts": experts,
            }
        )
        bench.say(f"{bench.label} profile {point.name}: {_progress(by_module, as_served or by_module)}")

    def _keep(self, trace: dict[str, Any]) -> None:
        if self.trace is not None:
            self.trace.add(trace)

    def section(self, bench: Workbench) -> dict[str, Any]:
        """The `profile` section of the results; writes the Chrome trace where --profile-trace says."""
        trace_path = self.options.profile_trace
        if self.trace is not None:
            self.trace.close()
            bench.say(f"profile: wrote the Chrome trace {trace_path}")
        device = self.device or torch.device("cpu")
        return {
            "note": NOTE,
            "device": str(device),
            "device_timeline": device.type == "cuda",
            "decode_tokens": DECODE_TOKENS,
            "trace": trace_path,
            "points": self.points,
        }


def expert_bandwidth(
    cost: roofline.ModelCost, concurrency: int, by_module: dict[str, Any]
) -> dict[str, float] | None:
    """The MoE expert kernels' bytes, device time and TB/s a decode step of `concurrency` requests, from a
    by-module summary (module docstring); None without a device timeline or a "MoE experts" part."""
    device_ms = next((p["device_ms"] for p in by_module["by_part"] if p["part"] == MOE_EXPERTS), None)
    if not device_ms:  # None on a CPU, absent without MoE layers
        return None
    weight_bytes = roofline.expert_kernel_bytes(cost, concurrency)
    return {
        "weight_bytes_per_step": weight_bytes,
        "device_ms_per_step": device_ms,
        "tb_per_s": weight_bytes / (device_ms * 1e-3) / 1e12,
    }


def profile_engine_workloads(session: ProfileSession, bench: Workbench, target: EngineTarget) -> None:
    """The decode, prefill and ttft points on the bench's engine, fresh prompts from the bench's factory."""
    for point in engine_points(session.options):
        session.profile(bench, target.engine, point, bench.prompts.make, target.logprobs)


def _profiled_pass(
    engine: Engine, point: ProfilePoint, prompts: PromptMaker, logprobs: int | None, by_module: bool
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """One unprofiled run of the point's shape, then one profiled: its summary and its trace. A turn's
    conversations are primed (unprofiled) before each run, so its run computes only the turn."""
    key = f"profile:{point.workload}:{point.concurrency}:{point.prompt_tokens}:{by_module}"
    profiled = [prompts(f"{key}:{i}", point.prompt_tokens) for i in range(point.concurrency)]
    warm = [prompts(f"{key}:warm:{i}", point.prompt_tokens) for i in range(point.concurrency)]
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    kinds: list[str] = []
    with engine.profiled(by_module):
        if point.cached_tokens:  # a turn: each run's conversations primed first
            warm = _turns(engine, prompts, f"{key}:warm", warm, point, logprobs)
            profiled = _turns(engine, prompts, key, profiled, point, logprobs)
        generate(engine, warm, point.output_tokens, logprobs)
        if cuda:
            torch.cuda.synchronize(engine.device)
        with torch.profiler.profile(activities=activities) as profiler:
            step = functools.partial(_marked_step, engine, kinds)
            timings, _ = generate(engine, profiled, point.output_tokens, logprobs, step=step)
            if cuda:
                torch.cuda.synchronize(engine.device)
    missed = [t.cached_tokens for t in timings if t.cached_tokens != point.cached_tokens]
    if point.cached_tokens and missed:
        raise RuntimeError(
            f"a profiled turn found {missed[0]} of its conversation's {point.cached_tokens} tokens cached"
        )
    trace = _exported(profiler)
    return summarize(trace, kinds, point.step_kind), trace


def _turns(
    engine: Engine,
    prompts: PromptMaker,
    key: str,
    appended: list[Sequence[int]],
    point: ProfilePoint,
    logprobs: int | None,
) -> list[list[int]]:
    """Primes a fresh conversation of the point's cached tokens (+1) for each of `appended` (their cold
    prefill, leaving them in the prefix cache) and returns the turns' prompts: each conversation with its
    appended tokens."""
    check_prefix(point.cached_tokens, engine.runner.pool.page_size)
    length = point.cached_tokens + 1
    conversations = [prompts(f"{key}:conversation:{i}", length) for i in range(len(appended))]
    generate(engine, conversations, 1, logprobs)
    return [[*conversation, *new] for conversation, new in zip(conversations, appended, strict=True)]


def _marked_step(engine: Engine, kinds: list[str]) -> list[StepOutput]:
    """One engine step inside its own profiler range; `kinds` gets whether it was a decode step."""
    decode_steps = engine.step_times.decode_steps
    with torch.profiler.record_function(step_range(len(kinds))):
        outputs = engine.step()
    kinds.append("decode" if engine.step_times.decode_steps > decode_steps else "prefill")
    return outputs


def _exported(profiler: torch.profiler.profile) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.json"
        profiler.export_chrome_trace(str(path))
        return json.loads(path.read_text())


class TraceFile:
    """One Chrome trace (ui.perfetto.dev, chrome://tracing) of every profiled run, one after the other on
    the trace's clock, written as the runs come: a run of a full-size model is ~100 MB of JSON, so they
    are never all held at once. gzip-compressed when the name ends in .gz; complete once `close`d."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._metadata: dict[str, Any] = {}

    def add(self, trace: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            opener = gzip.open if self.path.suffix == ".gz" else open
            self._file = opener(self.path, "wt")  # open across the runs: `close` ends it
            self._file.write('{"traceEvents": [')
            self._metadata = {key: value for key, value in trace.items() if key != "traceEvents"}
            separator = "\n"
        else:
            separator = ",\n"
        for event in trace.get("traceEvents", []):
            self._file.write(separator + json.dumps(event))
            separator = ",\n"

    def close(self) -> None:
        if self._file is None:
            return
        self._file.write(
            "\n]" + "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in self._metadata.items())
        )
        self._file.write("}\n")
        self._file.close()
        self._file = None


def _progress(by_module: dict[str, Any] | None, as_served: dict[str, Any] | None) -> str:
    if by_module is None or as_served is None:
        return "no step of its kind ran"
    kind = by_module["step_kind"]
    line = (
        f"{by_module['steps']} {kind} steps, {by_module['step_ms']:.2f} ms per step by module (eager), "
        f"{as_served['step_ms']:.2f} ms as served; {as_served['ops_per_step']:.0f} {as_served['ops_are']} "
        f"per step"
    )
    idle = as_served["host"]["device_idle"]
    return line + (f", device idle {idle['idle_ms']:.2f} ms per step" if idle else "")
