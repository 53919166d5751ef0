"""Where does a request's decode part between running alone and running beside others? Module by module.

`scripts/decode_invariance.py` finds prompts whose greedy answers part, alone against `--batch` together,
after tens of identical tokens. This probe reruns the first such batch eagerly (no CUDA graphs: hooks do
not fire in a replay) with a forward hook on every module, and compares the traced prompt's row of every
module's output, decode step by decode step, alone against together. Reported: for each step where any
output differs, the first module (in completion order, so the deepest first) whose row differs, and how
many do. The op that computes a row differently beside other rows is the first one named.

    python scripts/decode_divergence_trace.py --model preset:qwen3-next-80b-a3b-12l --weight-dtype fp8 \\
        --kv-cache-dtype fp8 --trace-prompt 1 --tokens 48 --batch 8 --out results
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from morion.bench.invariance_probe import probe_config, probe_parser, probe_prompts, write_probe_result
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.ops.slot_partials import SlotPartials

# Per decode step: "module#call" -> its output, [tokens, ...] on the CPU.
Trace = list[dict[str, torch.Tensor]]


class OutputRecorder:
    """Forward hooks on every module of `model`: each forward's tensor outputs, kept per engine step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.current: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = defaultdict(int)
        for name, module in model.named_modules():
            module.register_forward_hook(self._hook(name or "model"))

    def _hook(self, name: str):
        def record(module, inputs, output) -> None:
            tensor = output[0] if isinstance(output, tuple) and output else output
            if isinstance(tensor, SlotPartials):  # a MoE block's unsummed slots: record their sum
                tensor = tensor.summed()
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
                key = f"{name}#{self.calls[name]}"
                self.calls[name] += 1
                self.current[key] = tensor.detach().to("cpu", copy=True)

        return record

    def take(self) -> dict[str, torch.Tensor]:
        taken, self.current, self.calls = self.current, {}, defaultdict(int)
        return taken


def _run_traced(engine: Engine, recorder: OutputRecorder, prompts, params) -> tuple[Trace, list[list[float]]]:
    """Runs `prompts` together: the decode steps' module outputs, and each prompt's logprobs."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals, trace = {}, []
    while engine.has_unfinished():
        recorder.take()
        decode_steps = engine.step_times.decode_steps
        outputs = engine.step()
        step = recorder.take()
        if engine.step_times.decode_steps > decode_steps:  # a decode step (engine/step_timing.py)
            trace.append(step)
        for output in outputs:
            if output.final is not None:
                finals[output.request_id] = output.final
    return trace, [list(finals[request_id].logprobs) for request_id in ids]


def _row(tensor: torch.Tensor, tokens: int, index: int) -> torch.Tensor | None:
    """Row `index` of a [tokens, ...] (or [1, tokens, ...]) output; None for any other shape."""
    if tensor.shape[0] == tokens:
        return tensor[index]
    if tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == tokens:
        return tensor[0, index]
    return None


def compare(alone: Trace, together: Trace, embed_key: str) -> list[dict[str, object]]:
    """Per decode step: the traced row's modules whose output differs alone against together."""
    steps = []
    for number, (mine, theirs) in enumerate(
        zip(alone, together, strict=False)
    ):  # the same steps here; else the shorter
        batch = theirs[embed_key].shape[0]
        matches = [i for i in range(batch) if torch.equal(theirs[embed_key][i], mine[embed_key][0])]
        if len(matches) != 1:
            break  # the token itself differs now (or is ambiguous): the parting is behind us
        row = matches[0]
        differing = []
        for key, output in mine.items():
            other = theirs.get(key)
            a = _row(output, 1, 0)
            b = None if other is None else _row(other, batch, row)
            if a is not None and b is not None and a.shape == b.shape and not torch.equal(a, b):
                differing.append((key, int((a != b).sum()), float((a.float() - b.float()).abs().max())))
        if differing:
            steps.append({"step": number, "row": row, "differing": len(differing), "first": differing[:8]})
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser(__doc__.splitlines()[0], "decode-divergence-trace")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--trace-prompt", type=int, default=1, help="its index in the batch")
    parser.add_argument("--probe-seed", type=int, default=0, help="draws the prompts, as decode_invariance")
    args = parser.parse_args(argv)
    engine = Engine(probe_config(args, batch=args.batch, cuda_graph=False))  # hooks do not fire in replays
    prompts = probe_prompts(engine.model.config.vocab_size, args.batch, args.prompt_tokens, args.probe_seed)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompt in prompts:  # cold, one at a time: the hits below then take the same path
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
    recorder = OutputRecorder(engine.model)
    started = time.perf_counter()
    alone, (alone_logprobs,) = _run_traced(engine, recorder, [prompts[args.trace_prompt]], params)
    together, together_logprobs = _run_traced(engine, recorder, prompts, params)
    traced = together_logprobs[args.trace_prompt]
    parting = next((t for t, (x, y) in enumerate(zip(alone_logprobs, traced, strict=True)) if x != y), None)
    embed_key = next(key for key in alone[0] if "embed" in key)
    steps = compare(alone, together, embed_key)
    print(
        f"decode_divergence_trace: logprobs part at token {parting} ({time.perf_counter() - started:.0f} s)"
    )
    for step in steps[:6]:
        first = step["first"][:3]
        print(f"decode_divergence_trace: step {step['step']}: {step['differing']} differ, first {first}")
    write_probe_result(
        args.out,
        "decode-divergence-trace",
        {"settings": vars(args), "parting_token": parting, "steps": steps},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
