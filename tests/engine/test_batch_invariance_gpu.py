"""A request's decode on the GPU does not depend on what decodes beside it, at the 80B preset's layer shapes
(12 of its 48 layers, FP8 weights and K/V), bit for bit over many steps: what makes a restored answer equal
its cold one under traffic. Before `NarrowLinear` (cuBLAS's N = 1 GEMM for `shared_expert_gate`), prompts
1 and 4 of this set parted at tokens 35 and 43 (`results/2026-12-02-h200-decode-divergence-trace.md`).
With the shared expert stacked as expert 512 (layers/moe.py) its gate is column 512 of the router's GEMM
(N = 513, not a shape of the first H200 row-invariance measurement): this test checks that shape too.
The same at Flash-Next's shapes (12 layers), with prompts longer than QSA's budget of 2,048 tokens so
that every query selects its blocks: its first qualification's hits parted from cold after 3 to 15
identical tokens (`results/2026-12-02-h200-session-notes-e5d0a5d.md`)."""

from __future__ import annotations

import json

import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "model, prompt_tokens",
    [("preset:qwen3-next-80b-a3b-12l", 1000), ("preset:qwen3.8-flash-next-12l", 3000)],
    ids=["80b", "flash-next"],
)
def test_decode_alone_equals_decode_beside_others(tmp_path, model, prompt_tokens):
    module = load_script("decode_invariance")
    argv = ["--model", model, "--device", "cuda", "--weight-dtype", "fp8", "--kv-cache-dtype", "fp8",
            "--prompts", "16", "--prompt-tokens", str(prompt_tokens), "--tokens", "48", "--batch", "8",
            "--out", str(tmp_path)]  # fmt: skip
    assert module.main(argv) == 0
    [path] = tmp_path.glob("*-decode-invariance.json")
    result = json.loads(path.read_text())
    assert result["alone_vs_together"]["prompts_differing"] == 0, result["alone_vs_together"]
    assert result["cold_vs_alone"]["prompts_differing"] == 0, result["cold_vs_alone"]
