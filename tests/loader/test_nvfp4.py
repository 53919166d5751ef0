"""ModelOpt NVFP4 checkpoints: the E2M1 layout, dequantization error, and loading a tiny Qwen3-Next whose
routed experts are NVFP4 (model-architecture.md §4.10, §6.1)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from morion.engine.sampling_params import SamplingParams
from morion.errors import ModelLoadError
from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.moe import StackedExperts
from morion.loader import LoadedModel, load_model
from morion.loader.nvfp4 import is_nvfp4_checkpoint, nvfp4_weights
from morion.ops.nvfp4 import dequantize_nvfp4
from tests.conftest import TINY_QWEN3_NEXT, full_prefill_logits, with_modules_of, with_shared_expert_beside
from tests.loader.nvfp4_quantize import quantize_nvfp4

CPU = torch.device("cpu")
# The spec's table, written out here rather than imported: codes 0-7, then the same with bit 3 (sign) set.
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
POSITIVE_E4M3 = E4M3_VALUES[(E4M3_VALUES > 0) & E4M3_VALUES.isfinite()]


def test_bytes_decode_low_nibble_first():
    # Byte 0x21: low nibble code 1 (0.5) is column 0, high nibble code 2 (1.0) is column 1.
    weight = torch.full((1, 8), 0x00, dtype=torch.uint8)
    weight[0, 0] = 0x21
    weight[0, 1] = 0xF9  # low 9 = -0.5, high 15 = -6
    ones = torch.ones(1, 1).to(torch.float8_e4m3fn)
    out = dequantize_nvfp4(weight, ones, torch.tensor(1.0))
    assert out[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert out[0, 4:].eq(0).all()

    # Every byte value: rows of 16 bytes are 32 columns, two blocks with their own scales.
    every = torch.arange(256, dtype=torch.uint8).view(16, 16)
    scales = torch.tensor([[1.0, 2.0]] * 8 + [[0.375, 448.0]] * 8).to(torch.float8_e4m3fn)
    scale_2 = torch.tensor(5.99e-5)
    out = dequantize_nvfp4(every, scales, scale_2)
    for byte in range(256):
        row, column = divmod(byte, 16)
        for k, code in ((2 * column, byte & 0xF), (2 * column + 1, byte >> 4)):
            expected = torch.tensor(SPEC_E2M1[code]) * scales[row, k // 16].float() * scale_2
            assert out[row, k].item() == expected.item(), (byte, k)
    assert torch.equal(dequantize_nvfp4(every, scales, scale_2, torch.bfloat16), out.bfloat16())


def _representable_weight(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """Values exactly E2M1 code x e4m3 block scale x a non-power-of-two global scale, built so that
    ModelOpt's recipe recovers the same scales: every block holds a ±6 (so its amax is 6·scale) and
    the largest block scale is 448 (so amax(W)/(6·448) is the global scale). The global scale has 16
    significant bits, so 6·448·s and 6·block·s are exact in fp32 and divide back exactly."""
    scale_2 = torch.tensor(64311 * 2.0**-30)  # ≈ 5.99e-5, like the real checkpoint's
    codes = torch.randint(0, 16, (rows, columns), generator=generator)
    codes[:, ::16] = torch.randint(0, 2, (rows, columns // 16), generator=generator) * 8 + 7  # ±6
    blocks = POSITIVE_E4M3[torch.randint(0, len(POSITIVE_E4M3), (rows, columns // 16), generator=generator)]
    blocks[0, 0] = 448.0
    values = torch.tensor(SPEC_E2M1)[codes]
    return (values * blocks.repeat_interleave(16, 1) * scale_2).float()


def test_representable_weight_round_trips_bit_exactly():
    generator = torch.Generator().manual_seed(0)
    weight = _representable_weight(64, 96, generator)
    quantized = quantize_nvfp4(weight)
    assert quantized.weight_scale_2.item() == 64311 * 2.0**-30
    assert torch.equal(
        dequantize_nvfp4(quantized.weight, quantized.weight_scale, quantized.weight_scale_2), weight
    )
    assert torch.equal(quantized.dequantized, weight)


def test_random_weight_within_half_an_e2m1_step():
    """Per element, |W - dequant(W)| ≤ half the E2M1 step around |W|/s, times s = block scale x global
    scale, as stored: round-to-nearest on the grid 0, 0.5, ..., 4, 6 (half steps 0.25 up to 2, 0.5 up to
    4, 1 up to 6). Rounding the block scale to e4m3 (3 mantissa bits, relative error ≤ 2^-4) can push a
    block's largest |W|/s up to 6·(1 + 2^-4) = 6.375, which saturates to 6 with an error of at most
    0.375 < 1, still inside the top half step; so no element of a block is off by more than
    s ≤ amax(block)·(1 + 2^-4)/6. A 1e-6 relative slack covers fp32 rounding of the scale products."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(128, 256, generator=generator) * 0.02
    weight[3, 17] = 0.5  # one outlier: most blocks then use small, sub-448 scales
    quantized = quantize_nvfp4(weight)
    dequantized = dequantize_nvfp4(quantized.weight, quantized.weight_scale, quantized.weight_scale_2)
    assert torch.equal(dequantized, quantized.dequantized)

    scale = (quantized.weight_scale.float() * quantized.weight_scale_2).repeat_interleave(16, 1)
    ratio = weight.abs() / scale
    assert ratio.max() <= 6 * (1 + 2**-4)
    half_step = torch.where(ratio <= 2, 0.25, torch.where(ratio <= 4, 0.5, 1.0))
    error = (weight - dequantized).abs()
    assert (error <= half_step * scale * (1 + 1e-6)).all()
    block_amax = weight.abs().view(128, 16, 16).amax(-1).repeat_interleave(16, 1)
    assert (error <= block_amax * (1 + 2**-4) / 6 * (1 + 1e-6)).all()
    assert error.max() > 0  # the grid is coarse: a random weight is not representable


def _parts(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    quantized = quantize_nvfp4(weight)
    return {
        f"{prefix}.weight": quantized.weight,
        f"{prefix}.weight_scale": quantized.weight_scale,
        f"{prefix}.weight_scale_2": quantized.weight_scale_2,
        f"{prefix}.input_scale": quantized.input_scale,
    }


def test_stream_groups_parts_in_any_order():
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 32, generator=generator), torch.randn(4, 64, generator=generator)
    parts = {**_parts("x.a", a), **_parts("x.b", b)}
    ple_scale = torch.tensor([0.5], dtype=torch.bfloat16)  # the FP8 PLE table's scale is not NVFP4's
    stream = [
        ("x.a.weight_scale_2", parts["x.a.weight_scale_2"]),
        ("x.b.weight", parts["x.b.weight"]),
        ("x.a.input_scale", parts["x.a.input_scale"]),
        ("norm.weight", torch.ones(4)),
        ("ple.weight_scale", ple_scale),
        ("x.a.weight", parts["x.a.weight"]),
        ("x.b.weight_scale_2", parts["x.b.weight_scale_2"]),
        ("x.a.weight_scale", parts["x.a.weight_scale"]),
        ("x.b.weight_scale", parts["x.b.weight_scale"]),
        ("x.b.input_scale", parts["x.b.input_scale"]),  # after its group was emitted: dropped
    ]
    out = list(nvfp4_weights(stream, CPU, torch.bfloat16))
    assert [name for name, _ in out] == ["norm.weight", "ple.weight_scale", "x.a.weight", "x.b.weight"]
    assert out[1][1] is ple_scale
    assert torch.equal(out[2][1], quantize_nvfp4(a).dequantized.bfloat16())
    assert torch.equal(out[3][1], quantize_nvfp4(b).dequantized.bfloat16())

    with pytest.raises(ModelLoadError, match=r"x\.b\.weight_scale'.*twice"):
        list(nvfp4_weights([*stream, ("x.b.weight_scale", parts["x.b.weight_scale"])], CPU, torch.float32))
    wrong = torch.ones(4, 2).to(torch.float8_e4m3fn)  # b is [4, 64]: 4 blocks per row, not 2
    swapped = [(n, wrong if n == "x.b.weight_scale" else t) for n, t in stream]
    with pytest.raises(ModelLoadError, match=r"x\.b\.weight'.*block scales of shape \(4, 2\)"):
        list(nvfp4_weights(swapped, CPU, torch.float32))


MODELOPT_IGNORE = [
    "lm_head",
    "model.embed_tokens",
    "mtp.*",
    "*.self_attn.*",
    "*.linear_attn.*",
    "*.mlp.gate*",
    "*.mlp.shared_expert.*",
    "*.mlp.shared_expert_gate*",
]
MODELOPT_CONFIG = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "producer": {"name": "modelopt", "version": "0.46.0"},
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "group_size": 16, "type": "float", "dynamic": False},
            "input_activations": {"num_bits": 4, "group_size": 16, "type": "float", "dynamic": False},
        }
    },
    "ignore": MODELOPT_IGNORE,
}
ROUTED_EXPERT = (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


@pytest.fixture(scope="module")
def nvfp4_checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(NVFP4 directory, plain directory holding the same experts already dequantized): a tiny Qwen3-Next
    whose routed experts are rewritten the way ModelOpt exports them, in two shuffled shards."""
    torch.manual_seed(0)
    tiny = {k: v for k, v in TINY_QWEN3_NEXT.items() if k != "model_type"}
    config = transformers.Qwen3NextConfig(**{**tiny, "num_hidden_layers": 2, "tie_word_embeddings": False})
    root = tmp_path_factory.mktemp("nvfp4")
    transformers.Qwen3NextForCausalLM(config).save_pretrained(root / "source")
    hf_config = json.loads((root / "source" / "config.json").read_text())
    nvfp4, plain = {}, {}
    for name, tensor in load_file(root / "source" / "model.safetensors").items():
        if ".mlp.experts." in name and name.endswith(ROUTED_EXPERT):
            prefix = name.removesuffix(".weight")
            nvfp4.update(_parts(prefix, tensor))
            plain[name] = quantize_nvfp4(tensor).dequantized
        else:
            nvfp4[name] = plain[name] = tensor
    for kind, tensors, extra in [
        ("nvfp4", nvfp4, {"quantization_config": MODELOPT_CONFIG}),
        ("plain", plain, {}),
    ]:
        (root / kind).mkdir()
        names = sorted(tensors)
        random.Random(3).shuffle(names)  # a Linear's parts land in different shards, in no fixed order
        for shard, chosen in (("a", names[::2]), ("b", names[1::2])):
            save_file(
                {n: tensors[n].contiguous() for n in chosen}, root / kind / f"model-{shard}.safetensors"
            )
        (root / kind / "config.json").write_text(json.dumps({**hf_config, **extra}))
    return root / "nvfp4", root / "plain"


def test_nvfp4_experts_load_as_their_dequantization(nvfp4_checkpoints, engine_factory, engine_runner):
    nvfp4_dir, plain_dir = nvfp4_checkpoints
    hf_config = json.loads((nvfp4_dir / "config.json").read_text())
    assert is_nvfp4_checkpoint(hf_config, nvfp4_dir) and not is_nvfp4_checkpoint({}, plain_dir)
    loaded = load_model(str(nvfp4_dir), torch.float32, CPU)
    reference = dict(load_model(str(plain_dir), torch.float32, CPU).model.named_parameters())
    experts = 0
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, reference[name]), name
        experts += ".mlp.experts." in name
    assert experts == 2 * 2  # gate_up_proj and down_proj in both layers: the NVFP4 tensors were all used
    prompts = [[1, 2, 3, 4], [5, 6]]
    outputs = engine_runner(engine_factory(loaded), prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(out.token_ids) for out in outputs] == [4, 4]


def test_nvfp4_requantized_to_fp8_like_a_plain_checkpoint(nvfp4_checkpoints):
    """The dequantized experts take the ordinary path: FP8 parameters and their scales come out exactly
    as from a checkpoint that stored the dequantized weights (emitted in the model dtype, fp32 here)."""
    nvfp4_dir, plain_dir = nvfp4_checkpoints
    fp8 = load_model(str(nvfp4_dir), torch.float32, CPU, weight_dtype="fp8").model
    reference = load_model(str(plain_dir), torch.float32, CPU, weight_dtype="fp8").model
    expected = dict(reference.state_dict())
    for name, tensor in fp8.state_dict().items():
        assert tensor.dtype == expected[name].dtype, name
        bits = (
            (tensor, expected[name])
            if tensor.dtype != torch.float8_e4m3fn
            else (tensor.view(torch.uint8), expected[name].view(torch.uint8))
        )
        assert torch.equal(*bits), name
    assert fp8.model.layers[0].mlp.experts.down_proj.dtype == torch.float8_e4m3fn


def test_incomplete_group_names_the_missing_tensor(nvfp4_checkpoints, tmp_path):
    nvfp4_dir, _ = nvfp4_checkpoints
    missing = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    for shard in nvfp4_dir.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors.pop(missing, None)
        save_file(tensors, tmp_path / shard.name)
    (tmp_path / "config.json").write_text((nvfp4_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=f"lacks {re.escape(missing)} "):
        load_model(str(tmp_path), torch.float32, CPU)


def test_other_modelopt_algorithms_are_rejected_by_name(tmp_path):
    assert is_nvfp4_checkpoint(
        {"quantization_config": {**MODELOPT_CONFIG, "quant_algo": "MIXED_PRECISION"}}, tmp_path
    )
    with pytest.raises(ModelLoadError, match="'FP8'"):
        is_nvfp4_checkpoint({"quantization_config": {**MODELOPT_CONFIG, "quant_algo": "FP8"}}, tmp_path)
    # hf_quant_config.json speaks for the exporter, and lists a mixed checkpoint's layers.
    layers = {"a.experts.0.up_proj": {"quant_algo": "NVFP4"}, "a.o_proj": {"quant_algo": "FP8"}}
    quantization = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quantization})
    )
    with pytest.raises(ModelLoadError, match="MIXED_PRECISION checkpoint has FP8 layers"):
        is_nvfp4_checkpoint({}, tmp_path)
    layers["a.o_proj"]["quant_algo"] = "NVFP4"
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quantization})
    )
    assert is_nvfp4_checkpoint({}, tmp_path)


def test_nvfp4_checkpoint_served_as_nvfp4_keeps_its_codes(nvfp4_checkpoints, engine_factory, engine_runner):
    """Under --weight-dtype nvfp4 the experts' codes and scales are the checkpoint's tensors, unchanged
    (nothing is dequantized and requantized), and the model computes what the dequantized-at-load path
    computes: the same logits once both have the same (FP8) dense layers."""
    nvfp4_dir, _ = nvfp4_checkpoints
    served = load_model(str(nvfp4_dir), torch.float32, CPU, weight_dtype="nvfp4").model
    stored = {name: t for shard in nvfp4_dir.glob("*.safetensors") for name, t in load_file(shard).items()}
    size = TINY_QWEN3_NEXT["moe_intermediate_size"]
    for layer in range(2):
        experts = served.model.layers[layer].mlp.experts
        assert experts.nvfp4
        for expert in range(TINY_QWEN3_NEXT["num_experts"]):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}."
            places = [("gate_proj", "gate_up_proj", slice(0, size), 0)]
            places += [
                ("up_proj", "gate_up_proj", slice(size, 2 * size), 1),
                ("down_proj", "down_proj", slice(None), 0),
            ]
            for projection, stacked, rows, part in places:
                codes = getattr(experts, stacked)[expert, rows]
                assert torch.equal(codes, stored[prefix + projection + ".weight"])
                scales = getattr(experts, stacked + "_scale")[expert, rows].view(torch.uint8)
                assert torch.equal(scales, stored[prefix + projection + ".weight_scale"].view(torch.uint8))
                global_scale = getattr(experts, stacked + "_scale_2")[expert, part]
                assert global_scale == stored[prefix + projection + ".weight_scale_2"]

    dequantized = load_model(str(nvfp4_dir), torch.float32, CPU).model
    # The served model's FP8 layers: its dense ones and the shared expert's stack beside the experts.
    reference = with_modules_of(with_shared_expert_beside(dequantized), served, Fp8Linear)
    reference = with_modules_of(reference, served, StackedExperts, leaf="shared_experts")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = full_prefill_logits(reference, prompt)
    assert torch.allclose(full_prefill_logits(served, prompt), expected, rtol=1e-5, atol=1e-5)
    outputs = engine_runner(
        engine_factory(LoadedModel(served, None, {}, nvfp4_dir)),
        [[1, 2, 3, 4]],
        SamplingParams(max_tokens=4, temperature=0.0),
    )
    assert len(outputs[0].token_ids) == 4
