"""Every EngineConfig field is an engine flag (or named in NOT_FLAGS with the reason), and every flag's
value reaches EngineConfig, from the command line of each command that takes engine flags and from a
`serve --config` profile. A flag parsed and then dropped (as `--spec-token-map` once was) fails here."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from morion.cli import _build_parser, main
from morion.config import EngineConfig
from morion.engine_flags import ENGINE_FLAGS, MODEL_FLAGS, NOT_FLAGS
from morion.errors import MorionError

FLAGS = {flag.field: flag for flag in (*MODEL_FLAGS, *ENGINE_FLAGS)}
# field -> (its value on the command line or None for a switch, the value EngineConfig must get, other
# flags the value needs). Every value differs from the field's default.
EXAMPLES = {
    "model": ("preset:qwen3-next-tiny", "preset:qwen3-next-tiny", []),
    "dtype": ("bfloat16", "bfloat16", []),
    "device": ("cpu", "cpu", []),
    "page_size": ("32", 32, []),
    "kv_cache_tokens": ("4096", 4096, []),
    "kv_cache_gb": ("0.5", 0.5, []),
    "mem_fraction": ("0.5", 0.5, []),
    "max_model_len": ("1000", 1000, []),
    "chunk_size": ("128", 128, []),
    "max_running_requests": ("3", 3, []),
    "load_format": ("dummy", "dummy", []),
    "state_dtype": ("bfloat16", "bfloat16", []),
    "state_slots": ("9", 9, []),
    "host_cache_gb": ("2", 2.0, []),
    "host_cache_write_policy": ("write_back", "write_back", []),
    "host_cache_state_fraction": ("0.5", 0.5, []),
    "disk_cache_dir": ("/tmp/morion-disk", "/tmp/morion-disk", ["--host-cache-gb", "1"]),
    "disk_cache_gb": ("3", 3.0, []),
    "disk_cache_direct_io": (None, True, []),
    "weight_dtype": ("fp8", "fp8", []),
    "kv_cache_dtype": ("fp8", "fp8", []),
    "cuda_graph": (None, False, []),
    "cuda_graph_max_batch": ("8", 8, []),
    "prefill_graph_tokens": ("256,1024", (256, 1024), []),
    "activation_reserve_gb": ("1.5", 1.5, []),
    "moe_kernel": ("triton", "triton", []),
    "pdl": ("prefetch", "prefetch", []),
    "qsa_prefill": ("selected", "selected", []),
    "speculative": ("ngram", "ngram", []),
    "spec_policy": ("policy.json", "policy.json", []),
    "spec_width": ("3", 3, []),
    "spec_token_map": ("map.json", "map.json", ["--speculative", "mtp"]),
    "ple_placement": ("mmap", "mmap", []),
    "enable_prefix_cache": (None, False, []),
    "merge_projections": (None, False, []),
    "overlap_decode": (None, True, []),
    "tensor_parallel_size": ("2", 2, []),
}
FIELDS = [field.name for field in dataclasses.fields(EngineConfig)]
COMMANDS = {"serve": [], "generate": ["--prompt", "hi"], "bench": []}


def test_every_field_is_a_flag_or_says_why_not():
    assert sorted(FLAGS) == sorted(set(FIELDS) - set(NOT_FLAGS))
    assert set(NOT_FLAGS) <= set(FIELDS) and not set(NOT_FLAGS) & set(FLAGS)
    assert sorted(EXAMPLES) == sorted(FLAGS)


def test_no_engine_field_is_parsed_outside_the_table():
    """A flag added to a command's parser for an EngineConfig field, but not through the table, would be
    dropped by `engine_options`: none may exist (generate's --seed, the sampling seed, is not one)."""
    parser = _build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse lists sub-commands nowhere else
    for name in COMMANDS:
        for action in commands[name]._actions:
            if action.dest in FLAGS:
                assert action.option_strings == [FLAGS[action.dest].name, *FLAGS[action.dest].aliases], name
            else:
                assert action.dest not in FIELDS or action.dest in NOT_FLAGS, (name, action.option_strings)


class _Built(Exception):
    """Stops a command once its engine config is built."""


def _command_config(argv: list[str], monkeypatch) -> EngineConfig:
    """The EngineConfig that `morion <argv>` builds, taken where each command hands it on (the model
    load, server and benchmark are not run)."""
    built: list[EngineConfig] = []

    def engine(config, *args, **kwargs):  # generate: LLM -> Engine(config)
        built.append(config)
        raise _Built

    def serve(options):
        built.append(options.engine)

    def run_bench(args, engine_options):  # as run_bench builds it
        built.append(EngineConfig(model=args.model, **engine_options))
        return 0

    monkeypatch.setattr("morion.llm.Engine", engine)
    monkeypatch.setattr("morion.server.launch.serve", serve)
    monkeypatch.setattr("morion.bench.run.run_bench", run_bench)
    with contextlib.suppress(_Built):  # generate stops at its engine
        assert main(argv) == 0
    [config] = built
    return config


@pytest.mark.parametrize("field", sorted(EXAMPLES))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_flag_reaches_the_engine_config(field, command, monkeypatch):
    text, expected, needs = EXAMPLES[field]
    flag = FLAGS[field].name
    argv = [command, *COMMANDS[command], flag, *([text] if text is not None else []), *needs]
    config = _command_config(argv, monkeypatch)
    assert getattr(config, field) == expected != getattr(EngineConfig(), field)


@pytest.mark.parametrize("field", sorted(EXAMPLES))
def test_a_profile_setting_reaches_the_engine_config(field, tmp_path, monkeypatch):
    text, expected, needs = EXAMPLES[field]
    key = FLAGS[field].name.removeprefix("--")
    value = "true" if text is None else f'"{text}"'
    profile = tmp_path / "serve.toml"
    profile.write_text(f"{key} = {value}\n")
    config = _command_config(["serve", "--config", str(profile), *needs], monkeypatch)
    assert getattr(config, field) == expected


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flags_left_out_keep_the_defaults(command, monkeypatch):
    assert _command_config([command, *COMMANDS[command]], monkeypatch) == EngineConfig()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_weight_dtype_nvfp4_reaches_the_engine_config(command, monkeypatch):
    config = _command_config([command, *COMMANDS[command], "--weight-dtype", "nvfp4"], monkeypatch)
    assert config.weight_dtype == "nvfp4"
    with pytest.raises(MorionError, match="weight_dtype must be one of auto, fp8, nvfp4, got 'fp4'"):
        EngineConfig(weight_dtype="fp4")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_prefill_graphs_default_to_buckets_up_to_the_chunk_and_none_turns_them_off(command, monkeypatch):
    assert EngineConfig().prefill_graph_buckets == (256, 512, 1024, 2048, 4096)
    assert EngineConfig(chunk_size=8192).prefill_graph_buckets == (256, 512, 1024, 2048, 4096, 8192)
    assert EngineConfig(chunk_size=1000).prefill_graph_buckets == (256, 512, 1000)
    assert EngineConfig(tensor_parallel_size=2).prefill_graph_buckets == ()  # not yet checked on GPUs
    assert EngineConfig(tensor_parallel_size=2, prefill_graph_tokens=(512,)).prefill_graph_buckets == (512,)
    off = _command_config([command, *COMMANDS[command], "--prefill-graph-tokens", "none"], monkeypatch)
    assert off.prefill_graph_tokens == off.prefill_graph_buckets == ()
    with pytest.raises(MorionError, match="each in \\[1, chunk_size 1024\\], got 512,2048"):
        EngineConfig(chunk_size=1024, prefill_graph_tokens=(512, 2048))
