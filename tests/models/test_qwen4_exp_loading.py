"""Qwen3.8-Flash-Next (qwen4_exp) construction, config checks, presets and weight loading: the n-gram table
in its checkpoint forms (row shards or whole, FP8 with a scale, multimodal names), placed in RAM or
memory-mapped, MTP weights, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from morion.config import EngineConfig
from morion.errors import ModelLoadError, MorionError
from morion.loader import load_model
from morion.models.presets import preset_config
from morion.models.qwen4_exp import Qwen4ExpForCausalLM
from morion.models.qwen4_exp_config import Qwen4ExpConfig
from morion.models.registry import build_model
from tests.models.conftest import one_shot_logits

TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding"
SMALL = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    "hc_count": 2,
    "hc_lowrank": 8,
    "ple_layer_ids": [2],
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 100,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 3,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
    "output_gate_type": "sigmoid",
    "eos_token_id": 3,
}
PROMPT = [7, 3, 9, 100, 200, 3, 3, 45, 46, 47, 300, 301, 302, 303, 20, 21, 22, 23, 24, 25]


def _directory(tmp_path: Path, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    return directory


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """One sequence, one forward, through the engine's backend."""
    return one_shot_logits(model, tokens, page_size=4)


@pytest.fixture(scope="module")
def dummy(tmp_path_factory):
    """(random model, its state dict in checkpoint form): the table's shards under their checkpoint names,
    experts stacked (as transformers' in-memory names), MTP included."""
    directory = tmp_path_factory.mktemp("qwen4_exp_small_config")
    (directory / "config.json").write_text(json.dumps(SMALL))
    model = load_model(str(directory), torch.float32, torch.device("cpu"), "dummy", seed=3).model
    return model, {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_full_size_presets_have_the_released_shapes():
    for name, layers in (("preset:qwen3.8-flash-next", 48), ("preset:qwen3.8-flash-next-12l", 12)):
        model = build_model(preset_config(name), torch.bfloat16, torch.device("meta"))
        assert model.visual is not None and model.config.vision.depth == 27
        config = model.config
        assert config.attention_layers == tuple(range(3, layers, 4)) and config.ple_layers == (1,)
        assert config.rotary_dim == 64 and config.conv_dim == 10240
        assert list(model.buffers()) == []  # nothing that to_empty would leave uninitialised
        spec = model.cache_spec(64, torch.bfloat16)
        attention = len(config.attention_layers)
        # model-architecture.md §4.11: 2 KiB of bf16 K/V per token and QSA layer, plus its raw index key
        # and its share of a compressed block key (128 / 4 values, 64 B).
        assert spec.bytes_per_token == attention * (2048 + 256 + 64)
        linear = layers - attention
        assert spec.bytes_per_slot == linear * (3 * 10240 * 2 + 48 * 128 * 128 * 4) + 9 * 10240 * 2 + 2 * 8
    full = build_model(preset_config("preset:qwen3.8-flash-next"), torch.bfloat16, torch.device("meta"))
    tower = sum(p.numel() for p in full.visual.parameters())
    trunk = sum(p.numel() for p in full.parameters()) - sum(p.numel() for p in full.mtp.parameters()) - tower
    assert round(trunk / 1e9, 2) == 125.74  # "125B" without the 51.2B table
    assert round(tower / 1e6) == 449  # the vision tower: "about 445M parameters" (issue #26)
    (table,) = full.host_tables()
    assert (table.num_rows, table.dim, table.num_shards, table.shard_rows) == (320001536, 160, 128, 2500012)
    assert table.dummy_dtype == torch.float8_e4m3fn
    constants = full.model.layers[1].ple.ple_embedding.hash.constants
    # The hash constants third parties transcribed from the released checkpoint.
    assert constants["layer_multipliers"].tolist() == [23703573157769, 20109073645365, 8052911324071]
    assert constants["ngram_heads_vocab_sizes"][:3].tolist() == [20000003, 20000023, 20000033]
    assert constants["ngram_heads_offsets"][-1].item() == 300001275


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"indexer_kv_heads": 2}, "exactly one key head"),
        ({"eos_token_id": None}, "eos_token_id"),
        ({"indexer_budget": 9}, "not a multiple of 2"),
        ({"indexer_head_dim": 8}, "larger than indexer_head_dim"),
        ({"indexer_budget": None}, "indexer_budget"),
        ({"ple_layer_ids": [4]}, "are attention layers"),
        ({"ple_layer_ids": [0]}, "one-indexed"),
        ({"heads_per_ngram": 3}, "does not split"),
        ({"hc_count": 1}, "hc_count"),
        ({"output_gate_type": "tanh"}, "output_gate_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["linear_attention"] * 3 + ["mamba"]}, "mamba"),
        ({"full_attention_interval": 8}, "no attention layer"),
        ({"ple_embedding_dtype": "int4"}, "ple_embedding_dtype"),
    ],
)
def test_config_rejects_what_it_cannot_run(change, message):
    with pytest.raises(ModelLoadError, match=message):
        Qwen4ExpConfig.from_hf({**SMALL, **change})


def test_multimodal_config_and_layer_type_names():
    config = Qwen4ExpConfig.from_hf(
        {
            "model_type": "qwen4_exp",
            "eos_token_id": 3,
            "text_config": {
                **SMALL,
                "eos_token_id": None,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            },
        }
    )
    assert config.model_type == "qwen4_exp" and config.attention_layers == (3,) and config.eos_token_id == 3
    with pytest.raises(MorionError, match="ple_placement"):
        EngineConfig(ple_placement="disk")


def test_checkpoint_round_trip_in_ram_and_memory_mapped(dummy, tmp_path):
    model, tensors = dummy
    expected = _logits(model, PROMPT)
    directory = _directory(tmp_path, "round_trip", SMALL, tensors)
    in_ram = load_model(str(directory), torch.float32, torch.device("cpu")).model
    assert torch.equal(_logits(in_ram, PROMPT), expected)
    assert in_ram.mtp is not None and torch.equal(in_ram.mtp.fc_hidden.weight, model.mtp.fc_hidden.weight)

    mapped = load_model(str(directory), torch.float32, torch.device("cpu"), host_table_placement="mmap").model
    assert torch.equal(_logits(mapped, PROMPT), expected)
    (table,) = mapped.host_tables()
    maps = [line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith(str(directory / "model.safetensors"))]  # fmt: skip
    for shard in table.shards:  # every shard lives in a map of the checkpoint file, not on the heap
        assert any(int(low, 16) <= shard.data_ptr() < int(high, 16) for low, high in maps)


def test_fp8_table_with_its_scale_equals_the_dequantized_table(dummy, tmp_path):
    model, tensors = dummy
    scale = 2.0**-6
    fp8, dequantized = dict(tensors), dict(tensors)
    for name, tensor in tensors.items():
        if name.startswith(TABLE + ".shard_"):
            fp8[name] = (tensor / scale).to(torch.float8_e4m3fn)
            dequantized[name] = fp8[name].float() * scale
    fp8[TABLE + ".weight_scale"] = torch.tensor([scale], dtype=torch.bfloat16)  # exactly representable
    from_fp8 = load_model(
        str(_directory(tmp_path, "fp8", SMALL, fp8)), torch.float32, torch.device("cpu")
    ).model
    assert from_fp8.host_tables()[0].dtype == torch.float8_e4m3fn  # kept FP8 in host RAM
    plain = load_model(
        str(_directory(tmp_path, "plain", SMALL, dequantized)), torch.float32, torch.device("cpu")
    )
    assert torch.equal(_logits(from_fp8, PROMPT), _logits(plain.model, PROMPT))
    assert not torch.equal(_logits(from_fp8, PROMPT), _logits(model, PROMPT))  # the table matters


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("fp8 without scale", "weight_scale"),
        ("scale without fp8", "only FP8 shards are scaled"),
        ("missing shard", "shard_2.weight"),
        ("short shard", "has shape"),
        ("unknown table part", "not part of the n-gram embedding"),
        ("partial mtp", "mtp.fc_embedding.weight"),
    ],
)
def test_bad_checkpoints_are_refused(dummy, tmp_path, edit, message):
    _, tensors = dummy
    tensors = dict(tensors)
    if edit == "fp8 without scale":
        tensors.update({k: v.to(torch.float8_e4m3fn) for k, v in tensors.items() if k.startswith(TABLE)})
    elif edit == "scale without fp8":
        tensors[TABLE + ".weight_scale"] = torch.tensor([0.5])
    elif edit == "missing shard":
        del tensors[TABLE + ".shard_2.weight"]
    elif edit == "short shard":
        tensors[TABLE + ".shard_0.weight"] = tensors[TABLE + ".shard_0.weight"][:-1]
    elif edit == "unknown table part":
        tensors["model.layers.1.ple.ple_embedding.extra"] = torch.zeros(1)
    else:
        del tensors["mtp.fc_embedding.weight"]
    directory = _directory(tmp_path, "bad", SMALL, tensors)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(directory), torch.float32, torch.device("cpu"))


def test_multimodal_checkpoint_with_an_unsharded_table(dummy, tmp_path):
    """model_type qwen4_exp: the text model under `model.language_model.`, the vision tower skipped, the
    table as one `ngram_embedding.weight`, no hash constants (derived from the config)."""
    model, tensors = dummy
    renamed = {"model.visual.patch_embed.proj.weight": torch.zeros(2, 2)}
    shards = []
    for name, tensor in tensors.items():
        if name.startswith(TABLE + ".shard_"):
            shards.append((int(name.split("shard_")[1].split(".")[0]), tensor))
        elif not name.startswith("model.layers.1.ple.ple_embedding."):
            renamed[name.replace("model.", "model.language_model.", 1)] = tensor
    renamed["model.language_model.layers.1.ple.ple_embedding.ngram_embedding.weight"] = torch.cat(
        [tensor for _, tensor in sorted(shards, key=lambda item: item[0])]
    )
    config = {"model_type": "qwen4_exp", "text_config": SMALL, "tie_word_embeddings": False}
    loaded = load_model(
        str(_directory(tmp_path, "multimodal", config, renamed)), torch.float32, torch.device("cpu")
    )
    assert isinstance(loaded.model, Qwen4ExpForCausalLM)
    assert torch.equal(_logits(loaded.model, PROMPT), _logits(model, PROMPT))


def test_random_tables_are_seeded_and_drawn_in_their_declared_dtype(tmp_path):
    directory = tmp_path / "fp8_config"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**SMALL, "ple_embedding_dtype": "float8_e4m3fn"}))

    def table(seed: int):
        model = load_model(str(directory), torch.float32, torch.device("cpu"), "dummy", seed=seed).model
        return model.host_tables()[0]

    first, again, other = table(0), table(0), table(1)
    assert first.dtype == torch.float8_e4m3fn and first.scale == first.dim**-0.5
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(first.shards, again.shards, strict=True)
    )
    assert not torch.equal(first.shards[0].view(torch.uint8), other.shards[0].view(torch.uint8))
    assert not first.shards[0].float().isnan().any()
