"""FP8 weights (`--weight-dtype fp8`): quantization bounds, Fp8Linear against its references, and tiny
Llama / Qwen3-Next models loaded with FP8 weights against the same checkpoints in full precision."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

import morion.ops.fp8 as fp8_ops
from morion.engine.sampling_params import SamplingParams
from morion.layers.fp8_convert import convert_to_fp8
from morion.layers.gated_attention import GatedAttention
from morion.layers.gated_delta_net import GatedDeltaNet
from morion.layers.linear_fp8 import Fp8Linear, linears_of_one_input
from morion.layers.moe import SparseMoE, StackedExperts
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.loader import load_model
from morion.models.checkpoint import fp8_scales
from morion.models.presets import preset_config
from morion.models.registry import build_model
from morion.ops.fp8 import FP8_DTYPE, dequantize_fp8, fp8_linear, fp8_linear_reference, quantize_fp8
from morion.ops.fp8 import quantize_fp8_ as quantize_into

CPU = torch.device("cpu")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def assert_rounded(q: torch.Tensor, scale: torch.Tensor, original: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; subnormals
    (below 2^-6 * scale) are spaced 2^-9 * scale apart."""
    restored = dequantize_fp8(q, scale)
    slack = 2**-4 * original.float().abs() + 2**-10 * (scale if scale.dim() == 0 else scale[..., None])
    assert ((restored - original.float()).abs() <= slack * 1.001 + 1e-12).all()


# -- quantization ---------------------------------------------------------------------------------


@pytest.mark.parametrize("per_row", (False, True))
def test_quantize_rounds_within_e4m3_precision(per_row):
    x = torch.randn(6, 10, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 48)
    q, scale = quantize_fp8(x, per_row)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == ((6, 10) if per_row else ())
    amax = x.abs().amax(dim=-1) if per_row else x.abs().amax()
    assert torch.allclose(scale, amax / 448.0)  # the largest value maps onto e4m3's largest
    assert_rounded(q, scale, x)
    zero_q, zero_scale = quantize_fp8(torch.zeros(3, 16), per_row)
    assert (zero_scale > 0).all() and (zero_q.float() == 0).all()  # no division by zero


@pytest.mark.parametrize("per_row", (False, True))
def test_quantize_in_place_matches_quantize_in_any_chunking(monkeypatch, per_row):
    source = torch.randn(4, 24, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected_q, expected_scale = quantize_fp8(source, per_row)
    monkeypatch.setattr(fp8_ops, "_CHUNK_ELEMENTS", 100)  # 3 rows per chunk: many chunks, a ragged last
    weight = torch.empty(source.shape, dtype=FP8_DTYPE)
    scale = torch.empty(source.shape[:-1] if per_row else ())
    quantize_into(source, weight, scale)
    assert torch.equal(weight.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


# -- Fp8Linear --------------------------------------------------------------------------------------


def make_fp8_linear(in_features: int, out_features: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen) * 0.1)
    layer = Fp8Linear.like(linear)
    quantize_into(linear.weight, layer.weight, layer.weight_scale)
    if bias:
        layer.bias.data.copy_(linear.bias)
    return linear, layer


@pytest.mark.parametrize("bias", (False, True))
def test_fp8_linear_matches_scaled_mm_and_full_precision(bias):
    linear, layer = make_fp8_linear(64, 48, bias)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))  # leading dims
    out = layer(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32
    args = (layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(out, fp8_linear_reference(x.reshape(-1, 64), *args).view(2, 5, 48))
    # torch's CPU `_scaled_mm` runs the GPU path's call: the same quantized product, in fp32.
    assert torch.allclose(fp8_linear(x.reshape(-1, 64), *args).view(2, 5, 48), out, atol=1e-5, rtol=1e-5)
    # Against full precision: weight and activation rounded to e4m3 (~2.6% rms each; measured 3.8%).
    with torch.no_grad():
        assert rel_l2(out, linear(x)) < 0.06


def test_fp8_linear_of_any_shape_and_dtype():
    """K and N not multiples of 16 (no cuBLASLt FP8 kernel) and bf16 activations: the reference runs."""
    linear, layer = make_fp8_linear(40, 24, bias=True)
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (7, 24)
    with torch.no_grad():
        assert rel_l2(out, linear(x.float())) < 0.06


def test_layers_of_one_input_quantize_it_once_with_the_same_result():
    """`linears_of_one_input` (gated attention's q/k/v) equals each layer on its own, bit for bit; layers
    that are not all FP8, and empty inputs, run one by one."""
    layers = [make_fp8_linear(64, n, bias=n == 32, seed=n)[1] for n in (48, 16, 32)]
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for got, layer in zip(linears_of_one_input(x, layers), layers, strict=True):
        assert torch.equal(got, layer(x))
    mixed = [layers[0], nn.Linear(64, 8).to(torch.bfloat16)]
    for got, layer in zip(linears_of_one_input(x, mixed), mixed, strict=True):
        assert torch.equal(got, layer(x))
    assert [out.shape for out in linears_of_one_input(x[:0], layers)] == [(0, 5, 48), (0, 5, 16), (0, 5, 32)]
    # Rows quantized by whoever made x are read as they are: the same bits.
    quantized = fp8_ops.QuantizedRows(*quantize_fp8(x.reshape(-1, 64), per_row=True))
    for got, layer in zip(linears_of_one_input(x, layers, quantized), layers, strict=True):
        assert torch.equal(got, layer(x))
    with pytest.raises(ValueError, match="not all FP8"):
        linears_of_one_input(x, mixed, quantized)


# -- models loaded with FP8 weights --------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tiny_qwen3_next_config_dir, tmp_path_factory):
    """Directories of real (transformers-initialised) checkpoints, saved the way users have them.

    The Qwen3-Next weights are transformers' init, not our dummy weights: dummy weights make a chaotic
    model (bf16 rounding alone moves its logits by 2%), where FP8 rounding leaves no top-1 margins."""
    torch.manual_seed(0)
    config = json.loads((tiny_qwen3_next_config_dir / "config.json").read_text())
    qwen3_next = tmp_path_factory.mktemp("tiny_qwen3_next_checkpoint")
    transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config)).save_pretrained(qwen3_next)
    return {"llama": tiny_llama.path, "qwen3_next": qwen3_next}


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model_pair(request, checkpoints):
    """(full-precision model, FP8 model) of one checkpoint, both computing in fp32 on the CPU."""
    directory = str(checkpoints[request.param])
    full = load_model(directory, torch.float32, CPU).model
    return full, load_model(directory, torch.float32, CPU, weight_dtype="fp8").model


def test_fp8_weights_are_the_checkpoint_rounded(model_pair):
    """Every converted weight (stacked expert halves and slices included) dequantizes to the checkpoint's
    within e4m3 rounding; everything else is loaded exactly."""
    full, fp8 = model_pair
    reference = dict(full.named_parameters())
    scales = fp8_scales(fp8)
    assert scales, "nothing was converted"
    for name, param in fp8.named_parameters():
        if name in scales:
            assert_rounded(param, scales[name], reference[name])
        else:
            assert param.dtype == torch.float32 and torch.equal(param, reference[name]), name
    kept = {name for name, m in fp8.named_modules() if isinstance(m, nn.Linear)}
    if full.config.model_type == "qwen3_next":
        experts = fp8.model.layers[0].mlp.experts
        assert isinstance(experts, StackedExperts) and experts.fp8
        # The shared expert and its gate are stacked: expert E of the FP8 experts, row E of the router.
        assert experts.num_experts == fp8.config.num_experts + 1
        assert {name.rpartition(".")[2] for name in kept} == {"gate", "in_proj_ba"}
        assert isinstance(fp8.lm_head, Fp8Linear)
    else:
        assert not kept


# Logits of these tiny models have std ~0.16; FP8 moves them by 4-6% (rel L2) and at most 0.05.
LOGIT_REL_TOLERANCE = 0.1
# Positions whose reference top-1 leads by more than this must keep their top-1 under FP8.
MARGIN = 0.1


def test_fp8_logits_and_greedy_tokens_match_full_precision(model_pair, prefill_logits):
    full, fp8 = model_pair
    checked = 0
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, full.config.vocab_size, (32,), generator=gen).tolist()
        expected, actual = prefill_logits(full, prompt), prefill_logits(fp8, prompt)
        assert rel_l2(actual, expected) < LOGIT_REL_TOLERANCE
        top2 = expected.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > MARGIN
        assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])
        checked += int(clear.sum())
    assert checked >= 10, f"only {checked} positions had a clear top-1: the greedy check says little"


def test_qwen3_next_norms_quantize_for_fp8_blocks_with_the_same_logits(
    checkpoints, prefill_logits, monkeypatch
):
    """The tiny Qwen3-Next with FP8 weights: its norms quantize the rows for the FP8 mixers and experts
    (`add_and_norm(quantize=True)`, handed to them) and the logits are bit for bit those of each block
    quantizing its own input (the blocks told they read no FP8 rows); the full-precision model's norms
    quantize nothing."""
    directory = str(checkpoints["qwen3_next"])
    fp8 = load_model(directory, torch.float32, CPU, weight_dtype="fp8").model
    asked = []
    add_and_norm = ZeroCentredRMSNorm.add_and_norm

    def spy(self, x, residual, quantize=False):
        asked.append(quantize)
        return add_and_norm(self, x, residual, quantize)

    monkeypatch.setattr(ZeroCentredRMSNorm, "add_and_norm", spy)
    prompt = torch.randint(
        0, fp8.config.vocab_size, (16,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    fused = prefill_logits(fp8, prompt)
    layers = len(fp8.model.layers)
    # Every add + norm quantizes (the first layer's input norm has no add), the final norm does not.
    assert asked == [True] * (2 * layers - 1) + [False]
    asked.clear()
    for block in (GatedAttention, GatedDeltaNet, SparseMoE):
        monkeypatch.setattr(block, "reads_fp8_rows", property(lambda self: False))
    assert torch.equal(prefill_logits(fp8, prompt), fused)
    assert not any(asked)
    monkeypatch.undo()
    full = load_model(directory, torch.float32, CPU).model
    assert not any(
        m.reads_fp8_rows for m in full.modules() if isinstance(m, GatedAttention | GatedDeltaNet | SparseMoE)
    )


def test_block_fp8_checkpoint_is_requantized(tiny_llama, tmp_path):
    """Qwen's block-FP8 format (one scale per 128x128 block) dequantizes per tensor, then requantizes."""
    tensors = load_file(tiny_llama.path / "model.safetensors")
    block_fp8 = {}
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):  # every tiny matrix is a single (partial) block
            block_fp8[name], scale = quantize_fp8(tensor)
            block_fp8[name + "_scale_inv"] = scale.reshape(1, 1)
        else:
            block_fp8[name] = tensor
    save_file(block_fp8, tmp_path / "model.safetensors")
    config = json.loads((tiny_llama.path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    dequantized = dict(load_model(str(tmp_path), torch.float32, CPU).model.named_parameters())
    fp8 = load_model(str(tmp_path), torch.float32, CPU, weight_dtype="fp8").model
    scales = fp8_scales(fp8)
    assert "model.layers.0.mlp.up_proj.weight" in scales and "lm_head.weight" in scales
    for name, param in fp8.named_parameters():
        if name in scales:
            assert_rounded(param, scales[name], dequantized[name])


def test_dummy_fp8_weights_are_the_dummy_weights_rounded(
    tiny_qwen3_next_config_dir, engine_factory, engine_runner
):
    directory = str(tiny_qwen3_next_config_dir)
    full = load_model(directory, torch.float32, CPU, "dummy", seed=5).model
    fp8 = load_model(directory, torch.float32, CPU, "dummy", seed=5, weight_dtype="fp8")
    # Drawn one expert at a time from the same generator: on the CPU the same numbers as one draw of the
    # stacked tensor, so the same seed gives the same model, rounded.
    reference = dict(full.named_parameters())
    scales = fp8_scales(fp8.model)
    for name, param in fp8.model.named_parameters():
        if name in scales:
            assert_rounded(param, scales[name], reference[name])
    [out] = engine_runner(engine_factory(fp8), [[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4


def _weight_bytes(module: nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_fp8_halves_the_converted_bytes(tiny_qwen3_next_config_dir, caplog):
    directory = str(tiny_qwen3_next_config_dir)
    with caplog.at_level(logging.INFO, logger="morion.models.registry"):
        fp8 = load_model(directory, torch.bfloat16, CPU, "dummy", weight_dtype="fp8").model
    bf16 = load_model(directory, torch.bfloat16, CPU, "dummy").model
    converted = [
        name
        for name, m in fp8.named_modules()
        if isinstance(m, Fp8Linear) or (isinstance(m, StackedExperts) and m.fp8)
    ]
    before = sum(_weight_bytes(bf16.get_submodule(name)) for name in converted)
    after = sum(_weight_bytes(fp8.get_submodule(name)) for name in converted)
    # One byte per weight instead of two, plus fp32 scales (one per expert row: 4 bytes per 64 weights).
    assert 0.5 < after / before < 0.55
    assert _weight_bytes(bf16) - _weight_bytes(fp8) == before - after
    tensors = len(fp8_scales(fp8))
    summary = f"fp8 weights: {tensors} tensors in {len(converted)} modules, "
    assert any(record.getMessage().startswith(summary) for record in caplog.records)


def test_full_size_preset_fits_one_h200_in_fp8():
    hf_config = preset_config("preset:qwen3-next-80b-a3b")
    with torch.device("meta"):
        model = build_model(hf_config, torch.bfloat16, torch.device("meta"))
    conversion = convert_to_fp8(model, type(model).fp8_keep)
    total = _weight_bytes(model)
    assert conversion.bytes_before > 140 * 2**30 and conversion.bytes_after < 0.51 * conversion.bytes_before
    assert total < 78 * 2**30  # of the H200's ~139 GiB: the rest is KV pages, states and activations
