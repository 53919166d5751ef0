"""Which op computes a row differently at batch 1 than beside other rows? Many rows per op, bit for bit.

The decode path's ops of one layer of each kind (every linear, BF16 or FP8; Qwen3.8-Flash-Next's
hyper-connection mixes and grouped norms; the whole sparse-MoE block: the router's GEMM as cuBLAS runs it
(with a stacked shared expert's gate as its last row) and its product as the block runs it
(`router_logits`: the skinny kernel at decode sizes), fused experts (a stacked shared expert among them),
a separate shared expert and its gate) and the LM head, on random inputs of RMSNorm's scale.
For each trial, a block of random rows: row 0 alone (M = 1), then the first M rows for every M of
`--buckets` (default the decode graphs' buckets; prefill sizes such as `--buckets 1024,2048,4096` ask
whether a prompt's prefill rows depend on the other prompts of a long forward). Reported per op: how many
trials' row 0 differs at M = 1 against any bucket, how many trials' first rows (as many as the smallest
bucket) differ among the buckets themselves, and the elements that differ at M = 1 (per trial the most
at any bucket, summed). A rare last-bit flip
(once in thousands of elements) is what `scripts/decode_invariance.py` would see as an answer parting after
several identical tokens; one row per batch size, as the first probe compared
(`results/2026-12-01-h200-batch-invariance.md`), cannot show it.

    python scripts/row_invariance_probe.py --model preset:qwen3-next-80b-a3b-12l --weight-dtype fp8 \\
        --trials 500 --out results
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable

import torch

from morion.bench.invariance_probe import probe_config, probe_parser, write_probe_result
from morion.layers.grouped_norm import GroupedRMSNorm
from morion.layers.hyper_connection import HyperConnection
from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.moe import SparseMoE
from morion.loader import load_model

DECODE_BUCKETS = "2,4,8,16"


def _ops(model: torch.nn.Module) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (op on [M, in] rows, in features): one decoder layer of each kind (the draft head's aside):
    its linears, MoE blocks, hyper-connection mixes (as the layer runs them: its linears inside are the
    fused kernels' weights, not ops) and grouped norms; and the LM head."""
    ops: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {}
    seen_kinds: set[str] = set()
    for layer_name, layer in model.named_modules():
        kind = ",".join(type(child).__name__ for child in layer.children())  # its mixer and MLP kinds
        if not re.fullmatch(r"model\.layers\.\d+", layer_name) or kind in seen_kinds:
            continue  # model.layers.<i>: the first of each kind of decoder layer
        seen_kinds.add(kind)
        inside_a_mix: list[str] = []
        for name, module in layer.named_modules():
            full = f"{layer_name}.{name}"
            if any(full.startswith(f"{mix}.") for mix in inside_a_mix):
                continue
            if isinstance(module, HyperConnection):
                inside_a_mix.append(full)
                ops[full] = (_block_input(module), module.hc_count * module.hidden_size)
            elif isinstance(module, GroupedRMSNorm):
                ops[full] = (module, module.weight.shape[0])
            elif isinstance(module, SparseMoE):
                ops[full] = (module, module.gate.in_features)
                # The router's product as the block runs it; the gate as a cuBLAS GEMM (the nn.Linear
                # below) is measured too, as what the block no longer runs at decode sizes.
                ops[f"{full}.router_logits"] = (_joined_router_logits(module), module.gate.in_features)
            elif isinstance(module, (torch.nn.Linear, Fp8Linear)):
                ops[full] = (module, module.in_features)
    head = getattr(model, "lm_head", None)
    if isinstance(head, (torch.nn.Linear, Fp8Linear)):
        ops["lm_head"] = (head, head.in_features)
    return ops


def _block_input(mix: HyperConnection) -> Callable[[torch.Tensor], torch.Tensor]:
    def block_input(rows: torch.Tensor) -> torch.Tensor:
        return mix.mix(rows)[0]

    return block_input


def _joined_router_logits(block: SparseMoE) -> Callable[[torch.Tensor], torch.Tensor]:
    def router_logits(rows: torch.Tensor) -> torch.Tensor:
        logits, shared_logits = block.router_logits(rows)
        return logits if shared_logits is None else torch.cat((logits, shared_logits), dim=-1)

    return router_logits


@torch.inference_mode()
def probe(
    op: Callable[[torch.Tensor], torch.Tensor], features: int, trials: int, buckets: list[int], device, dtype
):
    counts = {"trials": trials, "m1_vs_batched_rows": 0, "m1_vs_batched_elements": 0, "batched_rows": 0}
    generator = torch.Generator(device=device).manual_seed(0)
    shared = min(buckets)  # the rows every bucket computes
    for _ in range(trials):
        x = torch.randn(max(buckets), features, device=device, dtype=dtype, generator=generator)
        alone = op(x[:1])[0]
        outs = [op(x[:m])[:shared] for m in buckets]
        differing = max(int((out[0] != alone).sum()) for out in outs)
        counts["m1_vs_batched_rows"] += differing > 0
        counts["m1_vs_batched_elements"] += differing
        counts["batched_rows"] += any(not torch.equal(out, outs[0]) for out in outs[1:])
    return counts


def _buckets(text: str) -> list[int]:
    """--buckets: row counts above 1, ascending."""
    try:
        buckets = sorted({int(part) for part in text.split(",")})
    except ValueError:
        buckets = []
    if not buckets or buckets[0] < 2:
        raise argparse.ArgumentTypeError(f"--buckets {text}: row counts of at least 2, comma-separated")
    return buckets


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser(__doc__.splitlines()[0], "row-invariance")
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument(
        "--buckets",
        type=_buckets,
        default=DECODE_BUCKETS,
        help="row counts to compare (default: the decode graphs')",
    )
    args = parser.parse_args(argv)
    config = probe_config(args)
    loaded = load_model(config.model, config.torch_dtype, config.torch_device, config.load_format,
                        config.seed, weight_dtype=config.weight_dtype)  # fmt: skip
    results = {}
    for name, (op, features) in _ops(loaded.model).items():
        started = time.perf_counter()
        results[name] = probe(
            op, features, args.trials, args.buckets, config.torch_device, config.torch_dtype
        )
        figures = results[name]
        print(
            f"row_invariance: {name}: {figures['m1_vs_batched_rows']} of {args.trials} trials differ at M=1 "
            f"({figures['m1_vs_batched_elements']} elements), {figures['batched_rows']} among M>1 "
            f"({time.perf_counter() - started:.1f} s)",
            file=sys.stderr,
        )
    write_probe_result(
        args.out, "row-invariance", {"settings": vars(args), "buckets": args.buckets, "ops": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
