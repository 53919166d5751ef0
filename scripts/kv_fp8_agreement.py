"""FP8 K/V against BF16 K/V: top-1 agreement of the next token under teacher forcing.

For each prompt, the BF16-KV engine generates `--steps` greedy tokens s_1..s_n. The FP8-KV engine then
predicts every position of that same sequence (prompt + s_<t, greedy, one token), and agreement is the
share of positions where its top-1 equals s_t, the BF16-KV top-1 there. Both engines share one loaded
model (same weights, same weight dtype), so only the K/V dtype differs. Prefix caching makes each
prediction cost about one page of prefill.

The same teacher-forced prediction by the BF16-KV engine itself is the control: it differs from s_t only
through the path (extend over cached pages vs a decode step). Random weights give nearly flat logits, so
tiny numeric differences flip the top-1; the control's agreement is that noise floor, and the top-1
margin (top-1 minus top-2 logprob of the reference, in nats) is reported beside it.

    python scripts/kv_fp8_agreement.py --model preset:qwen3-next-80b-a3b-12l --weight-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model


def _greedy(engine: Engine, prompt: list[int], max_tokens: int, logprobs: int | None = None):
    request_id = engine.add_request(
        prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    )
    while engine.has_unfinished():
        for step in engine.step():
            if step.request_id == request_id and step.final is not None:
                return step.final
    raise RuntimeError("the request never finished")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:qwen3-next-80b-a3b-12l")
    parser.add_argument("--weight-dtype", default="fp8")
    parser.add_argument("--load-format", default="dummy", help="dummy: random weights of the real shapes")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--out", help="write the result JSON here")
    args = parser.parse_args(argv)
    base = EngineConfig(
        model=args.model, load_format=args.load_format,
        weight_dtype=args.weight_dtype, device=args.device, dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens, max_running_requests=4,
    )  # fmt: skip
    loaded = load_model(base.model, base.torch_dtype, base.torch_device, base.load_format, base.seed,
                        weight_dtype=base.weight_dtype)  # fmt: skip
    reference = Engine(base, loaded)
    fp8 = Engine(EngineConfig(**{**base.__dict__, "kv_cache_dtype": "fp8"}), loaded)
    vocab = min(loaded.model.config.vocab_size, 32000)
    rng = random.Random(0)
    agree = control = total = 0
    per_prompt, control_per_prompt, margins = [], [], []
    started = time.perf_counter()
    for index in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        final = _greedy(reference, prompt, args.steps, logprobs=2)
        sequence = final.token_ids
        margins += [top[0][1] - top[1][1] for top in final.top_logprobs]
        hits = sum(_greedy(fp8, prompt + sequence[:t], 1).token_ids[0] == sequence[t]
                   for t in range(len(sequence)))  # fmt: skip
        same = sum(_greedy(reference, prompt + sequence[:t], 1).token_ids[0] == sequence[t]
                   for t in range(len(sequence)))  # fmt: skip
        per_prompt.append(hits / len(sequence))
        control_per_prompt.append(same / len(sequence))
        agree, control, total = agree + hits, control + same, total + len(sequence)
        print(f"prompt {index + 1}/{args.prompts}: FP8 K/V {hits}/{len(sequence)} agree, control (BF16 K/V) "
              f"{same}/{len(sequence)} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)  # fmt: skip
    margins.sort()
    result = {
        "model": args.model, "weight_dtype": args.weight_dtype, "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens, "steps": args.steps, "top1_agreement": agree / total,
        "per_prompt": per_prompt, "control_top1_agreement": control / total,
        "control_per_prompt": control_per_prompt, "median_top1_margin_nats": margins[len(margins) // 2],
        "device": str(reference.device),
    }  # fmt: skip
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
