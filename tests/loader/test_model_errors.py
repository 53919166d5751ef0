"""Bad model inputs fail with one clear message (ModelLoadError) naming the problem."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from morion.errors import ModelLoadError
from morion.loader import load_model

CPU = torch.device("cpu")


def _load(path):
    return load_model(str(path), torch.float32, CPU)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        _load(tmp_path / "nowhere")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        _load(tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        _load(tmp_path)


def test_unsupported_model_type(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'"):
        _load(tmp_path)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00truncated"])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        _load(path)


def test_truncated_real_gguf(tmp_path, smollm2_gguf):
    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2_gguf.read_bytes()[: 5 << 20])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        _load(path)


def test_checkpoint_missing_a_tensor(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    state = transformers.LlamaForCausalLM(config).state_dict()
    del state["model.layers.0.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(config.to_json_string())
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors.*up_proj"):
        _load(tmp_path)
