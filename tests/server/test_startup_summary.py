"""The startup summary and /v1/server_info describe what the engine reported, as it reported it.

The case seen on the H200: a 262,144-token model with `--kv-cache-tokens 131072` and CUDA graphs, whose
pool has one more page (the graphs' scratch page) than requests can use. The summary used to search for
the bound of max model len among `num_pages * page_size` and failed the ready path with StopIteration."""

from __future__ import annotations

import pytest

from morion.config import EngineConfig
from morion.engine.assembly import max_model_len
from morion.server.describe import automatic_decisions, server_info, startup_summary
from morion.server.engine_messages import EngineInfo
from morion.server.options import ServeOptions

PAGE = 16


def _info(config: EngineConfig, context: int, num_pages: int, scratch_pages: int) -> EngineInfo:
    pool_tokens = (num_pages - scratch_pages) * PAGE  # as the engine counts it
    limit_value, limit = max_model_len(context, pool_tokens, config.max_model_len)
    return EngineInfo(
        config=config,
        model_path="preset:qwen3-next-80b-a3b",
        model_type="qwen3_next",
        device="cuda:0",
        dtype="bfloat16",
        context_length=context,
        vocab_size=151936,
        max_model_len=limit_value,
        max_model_len_limit=limit,
        num_pages=num_pages,
        pool_tokens=pool_tokens,
        bytes_per_token=12288,
        pool_bytes=num_pages * PAGE * 12288,
    )


@pytest.mark.parametrize(
    ("requested", "context", "num_pages", "expected"),
    [
        (None, 262144, 8193, "max model len: 131072 (auto: limited by the KV pool)"),  # the H200 case
        (None, 4096, 8193, "max model len: 4096 (auto: limited by the model's context)"),
        (200000, 262144, 8193, "max model len: 131072 (auto: limited by the KV pool)"),
        (1024, 262144, 8193, None),  # asked for and granted: no automatic decision
    ],
)
def test_the_summary_states_the_bound_the_engine_reported(requested, context, num_pages, expected):
    config = EngineConfig(model="preset:qwen3-next-80b-a3b", kv_cache_tokens=131072, max_model_len=requested)
    info = _info(config, context, num_pages, scratch_pages=1)
    decisions = [d for d in automatic_decisions(config, info) if d.startswith("max model len")]
    assert decisions == ([expected] if expected else [])
    options = ServeOptions(config)
    summary = startup_summary(options, ["m"], info)
    assert f"{info.pool_tokens} tokens for requests" in summary
    body = server_info(options, ["m"], "ready", info, None)
    assert body["capacity"]["kv_cache_tokens"] == info.pool_tokens == 131072
    assert body["capacity"]["max_model_len"] == info.max_model_len
