"""The resolved configuration, said once: the startup summary and the /v1/server_info body.

Both come from the same facts (the server options and the engine's `EngineInfo`), and every automatic
decision is spelled out with what it was decided from. They only format what the engine reported, never
derive or search it again, so neither can fail on numbers the engine computed its own way (a summary
that searched for the bound of max model len failed the ready path when the pool lost its CUDA-graph
scratch page).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from morion import __version__
from morion.config import EngineConfig
from morion.server.engine_messages import EngineInfo, EngineStats
from morion.server.options import MAX_GRAMMAR_SOURCE_BYTES, ServeOptions
from morion.server.protocol import MAX_N


def automatic_decisions(config: EngineConfig, info: EngineInfo) -> list[str]:
    decisions = []
    if config.device == "auto":
        decisions.append(f"device: {info.device} (auto: CUDA when available)")
    if config.dtype == "auto":
        decisions.append(f"dtype: {info.dtype} (auto: bfloat16 on CUDA, float32 on CPU)")
    if config.kv_cache_tokens is None and config.kv_cache_gb is None:
        rule = (
            f"{config.mem_fraction:g} of free device memory"
            if info.device.startswith("cuda")
            else "1 GiB on CPU; set --kv-cache-tokens or --kv-cache-gb to change it"
        )
        decisions.append(f"KV pool: {info.pool_tokens} tokens (auto: {rule})")
    if info.max_model_len_limit != "max_model_len":
        bound = _LIMITS.get(info.max_model_len_limit, info.max_model_len_limit)
        decisions.append(f"max model len: {info.max_model_len} (auto: limited by {bound})")
    return decisions


_LIMITS = {"context": "the model's context", "kv_pool": "the KV pool"}


def speculative_feature(config: EngineConfig) -> dict[str, Any]:
    """The drafter (`method`: off, ngram or mtp) and how the draft width is chosen: `policy` "fixed" with
    its `width` (--spec-width, which the engine prefers over a policy file), or the policy file
    ("default": the built-in policy). Live acceptance is in the load stats and /metrics."""
    if config.speculative == "off":
        return {"method": "off", "policy": None, "width": None}
    if config.spec_width is not None:
        return {"method": config.speculative, "policy": "fixed", "width": config.spec_width}
    return {"method": config.speculative, "policy": config.spec_policy or "default", "width": None}


def startup_summary(
    options: ServeOptions, served_names: list[str], info: EngineInfo, has_tokenizer: bool = True
) -> str:
    config = options.engine
    auth = "API key required" if options.api_key else "no API key"
    lines = [
        f"morion serve: ready on http://{options.host}:{options.port} ({auth})",
        f"  model          {served_names[0]} = {info.model_path} ({info.model_type})",
        f"  profile        {options.profile or '(none)'}",
        f"  engine         device {info.device}, dtype {info.dtype}, page size {config.page_size}, "
        f"chunk {config.chunk_size}, max running {config.max_running_requests}, "
        f"prefix cache {'on' if config.enable_prefix_cache else 'off'}",
        f"  KV pool        {info.num_pages} pages x {config.page_size} tokens x {info.bytes_per_token} B "
        f"= {info.pool_bytes / 2**30:.2f} GiB; {info.pool_tokens} tokens for requests",
        f"  max model len  {info.max_model_len} (model context {info.context_length})",
        f"  requests       body <= {options.max_request_bytes} B, n <= {MAX_N}, "
        f"headers and body within {options.read_timeout:g} s each, "
        f"SIGTERM drains for up to {options.shutdown_timeout:g} s",
        f"  grammars       <= {MAX_GRAMMAR_SOURCE_BYTES} B of schema or regex, compiled within "
        f"{options.grammar_timeout:g} s and {options.grammar_memory_gb:g} GiB",
        f"  browsers       {_origins_line(options.allowed_origins)}",
    ]
    if not has_tokenizer:
        lines.append(
            "  tokenizer      none: /v1/completions takes token-id prompts and returns token_ids; "
            "text prompts and chat are refused (400)"
        )
    speculative = speculative_feature(config)
    if speculative["method"] != "off":
        width = f"width {speculative['width']}" if speculative["width"] else f"policy {speculative['policy']}"
        lines.append(f"  speculative    {speculative['method']} drafts, {width}")
    lines += [f"  auto           {decision}" for decision in automatic_decisions(config, info)]
    return "\n".join(lines)


def _origins_line(allowed_origins: tuple[str, ...]) -> str:
    if not allowed_origins:
        return "no origin allowed (--allowed-origins)"
    return "any origin (CORS)" if "*" in allowed_origins else f"CORS for {', '.join(allowed_origins)}"


def server_info(
    options: ServeOptions,
    served_names: list[str],
    state: str,
    info: EngineInfo | None,
    stats: EngineStats | None,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    config = dataclasses.asdict(options.engine)
    body: dict[str, Any] = {
        "version": __version__,
        "state": state,
        "model": {"id": served_names[0], "aliases": served_names[1:]},
        "config": config,
        "server": {
            "host": options.host,
            "port": options.port,
            "api_key_required": options.api_key is not None,
            "max_request_bytes": options.max_request_bytes,
            "max_n": MAX_N,
            "shutdown_timeout": options.shutdown_timeout,
            "read_timeout": options.read_timeout,
            "allowed_origins": list(options.allowed_origins),
            "grammar_timeout": options.grammar_timeout,
            "grammar_memory_gb": options.grammar_memory_gb,
            "max_grammar_source_bytes": MAX_GRAMMAR_SOURCE_BYTES,
            "profile": options.profile,
        },
        "features": {**(features or {}), "speculative": speculative_feature(options.engine)},
        "capacity": None,
        "decisions": [],
        "load": stats._asdict() if stats is not None else None,
    }
    if info is not None:
        config.update(device=info.device, dtype=info.dtype, device_name=info.device_name)  # never "auto"
        body["model"].update(
            path=info.model_path,
            model_type=info.model_type,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
        )
        body["capacity"] = {
            "max_model_len": info.max_model_len,
            "page_size": options.engine.page_size,
            "num_pages": info.num_pages,
            "kv_cache_tokens": info.pool_tokens,
            "bytes_per_token": info.bytes_per_token,
            "kv_cache_bytes": info.pool_bytes,
        }
        body["decisions"] = automatic_decisions(options.engine, info)
    return body
