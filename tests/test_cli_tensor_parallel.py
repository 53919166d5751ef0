"""`morion generate --tp N` as a user runs it (a real subprocess; rank 1 a process of its own over gloo):
the same text as one rank (also with `--speculative mtp`), and a size the model cannot be split by is one
error line."""

from __future__ import annotations

import pytest

from morion.engine.sampling_params import SamplingParams
from morion.llm import LLM
from tests.test_cli import _assert_one_line_error, run_morion

PROMPT = "Tensor parallel ranks"
MAX_TOKENS = 12
POOL = ["--kv-cache-tokens", "1024"]


def _flags(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu", *POOL]


@pytest.mark.parametrize("speculation", [[], ["--speculative", "mtp"]], ids=["plain", "mtp"])
def test_generate_on_two_ranks_prints_what_one_rank_does(tiny_qwen3_next_chat_dir, speculation):
    """With the MTP head drafting on both ranks too: greedy output is the target's, drafts or not."""
    flags = [*_flags(tiny_qwen3_next_chat_dir), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS)]
    result = run_morion("generate", *flags, "--tp", "2", *speculation)
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_qwen3_next_chat_dir), load_format="dummy", device="cpu", kv_cache_tokens=1024)
    prompt_ids = llm.encode_chat([{"role": "user", "content": PROMPT}])
    [one_rank] = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert len(one_rank.token_ids) == MAX_TOKENS
    assert result.stdout == one_rank.text + "\n"


def test_a_size_that_does_not_split_the_model_is_one_error_line(tiny_qwen3_next_chat_dir):
    result = run_morion("generate", *_flags(tiny_qwen3_next_chat_dir), "--prompt", "x", "--tp", "3")
    message = "morion: error: --tensor-parallel-size 3 does not divide the 4 attention heads"
    _assert_one_line_error(result, message)
    _assert_one_line_error(run_morion("generate", "--prompt", "x", "--tp", "0"), "--tensor-parallel-size")
