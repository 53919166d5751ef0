"""Which cache component differs after a prompt's tail replayed from a short-chunk CUDA graph, against the
same tail run eagerly? For Flash-Next, whose replayed tails left the eager tails' tokens on the H200
(session 19, tests/engine/test_short_graphs_gpu.py), so its model declares no short graphs.

Two fresh engines on one loaded model run the same prompt (a tail of 2 to 16 tokens after its last page
boundary) with max_tokens 1: one replays the tail's graph (captured although the model declares none),
the other runs it eagerly. Both allocate the same pages and slots in the same order, so every token
component of the page pool (K/V, QSA's raw and block index keys) and every state component (Gated
DeltaNet's conv and recurrent states, PLE's conv window and n-gram history) is compared whole, with the
first token's logprob. Then both generate `--tokens` tokens, to show where the answers part.

    python scripts/short_graph_divergence.py --preset qwen3.8-flash-next-12l --prompt-tokens 322
"""

from __future__ import annotations

import argparse
import random

import torch

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
    """Every token and state component of the engine's memory, on the CPU in fp32."""
    pool, slots = engine.runner.pool, engine.runner.state_slots
    found = {f"page {c.name}": pool.storage(c.name).float().cpu() for c in pool.spec.token_components}
    found.update(
        {f"state {c.name}": slots.storage(c.name).float().cpu() for c in slots.spec.state_components}
    )
    return found


def compare(replayed: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> None:
    for name, x in replayed.items():
        y = eager[name]
        differs = (x != y) & ~(torch.isnan(x) & torch.isnan(y))
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
    for max_tokens in (1, args.tokens):
        results = {}
        for replay in (True, False):
            engine = engine_of(args.preset, loaded, args.device, replay)
            tokens, logprobs = run(engine, prompt, max_tokens)
            replays = sum(graph.replays for graph in engine.runner.short_graphs.values())
            results[replay] = (tokens, logprobs, caches(engine))
            engine.close()
            print(f"{'replayed' if replay else 'eager   '} tail ({replays} replays): tokens {tokens}")
            print(f"  logprobs {logprobs}")
        if max_tokens == 1:
            compare(results[True][2], results[False][2])


if __name__ == "__main__":
    main()
