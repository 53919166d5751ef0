"""scripts/decode_invariance.py on the CPU: it runs its three phases and compares them. Alone, a device hit
(its tail recomputed, then decode at batch 1) answers as the cold run there too; beside others the CPU's
BLAS computes rows differently, so only the GPU's figure for that comparison means anything."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "decode_invariance.py"


def test_cold_and_alone_agree_and_every_comparison_is_reported(tmp_path):
    spec = importlib.util.spec_from_file_location("decode_invariance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--prompts", "3", "--prompt-tokens", "37",
            "--tokens", "4", "--batch", "2", "--kv-cache-tokens", "4096", "--out", str(tmp_path)]  # fmt: skip
    assert module.main(argv) == 0
    [path] = tmp_path.glob("*-decode-invariance.json")
    result = json.loads(path.read_text())
    assert result["steps_compared"] == 12
    assert result["cold_vs_alone"] == {"prompts_differing": 0, "first_differing_token": {}}
    assert set(result["alone_vs_together"]) == {"prompts_differing", "first_differing_token"}
