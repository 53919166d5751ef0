"""Which cache component differs after a prompt's tail replayed from a short-chunk CUDA graph, against the
same tail run eagerly? For Flash-Next, whose replayed tails left the eager tails' tokens on the H200
(session 19, tests/engine/test_short_graphs_gpu.py), so its model declares no short graphs.

Two fresh engines on one loaded model run the same prompt (a tail of 2 to 16 tokens after its last page
boundary) with max_tokens 1: one replays the tail's graph (captured although the model declares none),
the other runs it eagerly. Both allocate the same pages and slots in the same order, so every token
component of the page pool (K/V, QSA's raw and block index keys) and every state component (Gated
DeltaNet's conv and recurrent states, PLE's conv window and n-gram history) is compared whole, with the
first token's logprob; the CUDA graphs' scratch page and state slot, which padding rows of any capture
or replay write, are left out (zeroed in both). Forward hooks on every module of the model's layers keep
each call's first tensor input and its tensor output in the tail's forward (inside a capture the copies
are captured too, so the replay refills them), and the first calls whose tensors differ are named: the
first whose input is the same but whose output differs is where the two paths part. Then both generate
`--tokens` tokens, to show where the answers part.

    python scripts/short_graph_divergence.py --preset qwen3.8-flash-next-12l --prompt-tokens 322
"""

from __future__ import annotations

import argparse
import random

import torch
from torch import nn

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.loader import LoadedModel, load_model


def engine_of(preset: str, loaded: LoadedModel, device: str, replay_tails: bool) -> Engine:
    config = EngineConfig(
        model=f"preset:{preset}", device=device, kv_cache_dtype="fp8", kv_cache_tokens=16384,
        max_running_requests=2, cuda_graph_max_batch=2,
    )  # fmt: skip
    engine = Engine(config, loaded)
    if not replay_tails:
        engine.runner.short_graphs = {}
    return engine


def run(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    request_id = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for step in engine.step():
            if step.request_id == request_id and step.final is not None:
                final = step.final
    return final.token_ids, final.logprobs


def caches(engine: Engine) -> dict[str, torch.Tensor]:
    """Every token and state component of the engine's memory, on the CPU in fp32, with the graphs'
    scratch page and slot zeroed (padding rows write there, differently in any two engines)."""
    runner = engine.runner
    pool, slots = runner.pool, runner.state_slots
    found = {}
    for c in pool.spec.token_components:
        storage = pool.storage(c.name).to("cpu", torch.float32, copy=True)
        for page in runner.scratch_pages:
            storage[:, page * pool.page_size : (page + 1) * pool.page_size] = 0
        found[f"page {c.name}"] = storage
    for c in slots.spec.state_components:
        storage = slots.storage(c.name).to("cpu", torch.float32, copy=True)
        storage[:, runner.scratch_slots] = 0
        found[f"state {c.name}"] = storage
    return found


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in value if isinstance(t, torch.Tensor)), None)
    return None


Call = tuple[str, torch.Tensor | None, torch.Tensor | None]  # module name, first tensor input, output


class ModuleRecorder:
    """Forward hooks on the model's trunk and every module of its layers. For each forward of at most
    `max_tokens` tokens, the calls in order with copies of their first tensor input and tensor output,
    kept per token count for the last eager forward and for the last captured one (whose copies a graph
    replay refills: they are made inside the capture)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.eager: dict[int, list[Call]] = {}
        self.captured: dict[int, list[Call]] = {}
        self._current: list[Call] | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, trunk: nn.Module) -> None:
        self._handles.append(trunk.register_forward_pre_hook(self._begin))
        self._handles.append(trunk.register_forward_hook(self._end))
        for name, module in trunk.layers.named_modules(prefix="layers"):
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _begin(self, trunk: nn.Module, inputs: tuple) -> None:
        tokens = inputs[0].shape[0]
        if tokens > self.max_tokens:
            self._current = None
            return
        self._current = []
        capturing = inputs[0].is_cuda and torch.cuda.is_current_stream_capturing()
        (self.captured if capturing else self.eager)[tokens] = self._current

    def _end(self, trunk: nn.Module, inputs: tuple, output: object) -> None:
        self._current = None

    def _hook(self, name: str):
        def record(module: nn.Module, inputs: tuple, output: object) -> None:
            if self._current is None:
                return
            copies = [_first_tensor(x) for x in (inputs, output)]
            self._current.append((name, *(None if t is None else t.detach().clone() for t in copies)))

        return record


def _differs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Where two tensors of one shape differ, a NaN on both sides counting as the same."""
    return (x != y) & ~(torch.isnan(x) & torch.isnan(y))


def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return x.shape == y.shape and not bool(_differs(x.float(), y.float()).any())


def _difference(x: torch.Tensor, y: torch.Tensor) -> str:
    if x.shape != y.shape:
        return f"shapes {tuple(x.shape)} and {tuple(y.shape)}"
    x, y = x.float(), y.float()
    differs = _differs(x, y)
    return f"{int(differs.sum())} of {x.numel()} values, largest {float((x - y).abs()[differs].max()):.3e}"


def compare_calls(replayed: list[Call], eager: list[Call], shown: int = 8) -> None:
    """Names the first calls whose input or output differ, and the first whose input is the same but
    whose output is not (where the paths part)."""
    if [c[0] for c in replayed] != [c[0] for c in eager]:
        print(f"  modules called differently: {len(replayed)} calls against {len(eager)}")
        return
    differing = 0
    parted = None
    for (name, x_in, x_out), (_, y_in, y_out) in zip(replayed, eager, strict=True):
        same_in, same_out = _same(x_in, y_in), _same(x_out, y_out)
        if same_in and same_out:
            continue
        if parted is None and same_in:
            parted = name
        if differing < shown:
            which = "output" if same_in else "input and output" if not same_out else "input"
            tensors = (x_out, y_out) if same_in else (x_in, y_in)
            print(f"  DIFF  {name} {which}: {_difference(*tensors)}")
        differing += 1
    if not differing:
        print(f"  same  every module: {len(replayed)} calls")
        return
    print(f"  {differing} of {len(replayed)} calls differ; the paths part at {parted or 'an input'}")


def compare(replayed: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> None:
    for name, x in replayed.items():
        y = eager[name]
        differs = _differs(x, y)
        if not differs.any():
            print(f"  same  {name}")
            continue
        where = differs.nonzero()
        layers = sorted(set(where[:, 0].tolist()))
        rows = sorted(set(where[:, 1].tolist()))
        largest = float((x - y).abs()[differs].max())
        print(
            f"  DIFF  {name}: {int(differs.sum())} of {x.numel()} values, layers {layers[:12]}, rows "
            f"{rows[:16]}{' ...' if len(rows) > 16 else ''}, largest difference {largest:.3e}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3.8-flash-next-12l")
    parser.add_argument("--prompt-tokens", type=int, default=16 * 20 + 2, help="a tail of 2-16 tokens")
    parser.add_argument("--tokens", type=int, default=12, help="tokens generated in the second comparison")
    parser.add_argument("--device", default="cuda", help="cuda (a CPU has no graphs: both tails run eagerly)")
    args = parser.parse_args(argv)
    loaded = load_model(
        f"preset:{args.preset}", torch.bfloat16, torch.device(args.device), weight_dtype="fp8"
    )
    type(loaded.model).short_chunk_graphs = True  # captured whatever the model declares
    rng = random.Random(11)
    prompt = [rng.randrange(1, min(50000, loaded.model.config.vocab_size)) for _ in range(args.prompt_tokens)]
    page = EngineConfig.page_size
    tail = args.prompt_tokens - (args.prompt_tokens - 1) // page * page  # after the last page boundary
    for max_tokens in (1, args.tokens):
        results = {}
        for replay in (True, False):
            recorder = ModuleRecorder(max_tokens=tail)
            recorder.attach(loaded.model.model)
            engine = engine_of(args.preset, loaded, args.device, replay)
            tokens, logprobs = run(engine, prompt, max_tokens)
            recorder.detach()
            replays = sum(graph.replays for graph in engine.runner.short_graphs.values())
            calls = (recorder.captured if replays else recorder.eager).get(tail, [])
            calls = [(name, *(None if t is None else t.cpu() for t in pair)) for name, *pair in calls]
            results[replay] = (tokens, logprobs, caches(engine), calls)
            engine.close()
            print(f"{'replayed' if replay else 'eager   '} tail ({replays} replays): tokens {tokens}")
            print(f"  logprobs {logprobs}")
        if max_tokens == 1:
            compare(results[True][2], results[False][2])
            compare_calls(results[True][3], results[False][3])


if __name__ == "__main__":
    main()
