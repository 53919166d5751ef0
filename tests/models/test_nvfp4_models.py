"""`--weight-dtype nvfp4` on the tiny hybrids (Qwen3-Next, Qwen3.8-Flash-Next), on the CPU: the routed
experts quantized at load are exactly ops/nvfp4.py's quantization of the weights the model dtype would
hold, take ~0.28x their BF16 bytes, the engine counts their packed bytes, and the logits stay within
NVFP4's expected error of the unquantized experts'.

The bound. ModelOpt's recipe rounds each weight to the nearest point of a grid scaled per 16 weights, so
its error is zero-mean, bounded by half a grid step and uncorrelated with the activations: on a matmul it
acts as weight noise of its RMS. A matrix's relative RMS error eps is ~0.095 for Gaussian weights (3-bit
magnitudes; the e4m3 scale adds little). One expert's output then carries the errors of its two matmuls
(gate/up rows, down) and three matrices' errors meet in silu(gate) * up, whose relative error is that of
up plus the gate's times SiLU's log-derivative 1 + g (1 - sigmoid(g)) (at most 1.28 where SiLU is not near
zero): for fixed routing about sqrt(1.28^2 + 1 + 1) eps = 1.9 eps, checked on a MoE layer (below 2.2
eps: a 32-token sample). Through the model, errors
grow or shrink with its sensitivity and with router flips, as any weight noise of that size would: the
logits' relative error under NVFP4 is checked against that of the same model with Gaussian noise of each
matrix's NVFP4 RMS error added instead, within a factor 1.5 either way (measured: 0.8x-1.2x).
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.moe import StackedExperts
from morion.loader import load_model
from morion.ops.nvfp4 import dequantize_parts, quantize_nvfp4_parts
from tests.conftest import (
    TINY_QWEN3_NEXT,
    full_prefill_logits,
    make_engine,
    with_modules_of,
    with_shared_expert_beside,
)
from tests.models.conftest import QWEN4_EXP_TINY_CONFIG, one_shot_logits

CPU = torch.device("cpu")
CONFIGS = {"qwen3_next": TINY_QWEN3_NEXT, "qwen4_exp": QWEN4_EXP_TINY_CONFIG}
PROJECTIONS = (("gate_up_proj", 2), ("down_proj", 1))  # (parameter, parts quantized apart)


@pytest.fixture(scope="module", params=CONFIGS)
def loaded(request, tmp_path_factory):
    """(name, {weight_dtype: model}) with the same seeded dummy weights under auto and nvfp4, both with
    the shared expert beside the routed ones (nvfp4 keeps it out of the NVFP4 experts, in FP8)."""
    directory = tmp_path_factory.mktemp(request.param)
    (directory / "config.json").write_text(json.dumps(CONFIGS[request.param]))
    models = {
        weights: load_model(str(directory), torch.float32, CPU, "dummy", weight_dtype=weights).model
        for weights in ("auto", "nvfp4")
    }
    models["auto"] = with_shared_expert_beside(models["auto"])
    return request.param, models


def experts_of(model: torch.nn.Module) -> dict[str, StackedExperts]:
    """The routed experts' stacks (not the shared expert's own, FP8 under nvfp4), by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, StackedExperts) and not name.endswith(".shared_experts")
    }


def dequantized(experts: StackedExperts, projection: str, parts: int) -> torch.Tensor:
    scales = getattr(experts, projection + "_scale"), getattr(experts, projection + "_scale_2")
    assert scales[1].shape == (experts.num_experts, parts)
    return dequantize_parts(getattr(experts, projection), *scales, torch.float32)


def test_experts_are_the_quantized_weights_at_0_28x_bf16(loaded):
    _, models = loaded
    auto, nvfp4 = experts_of(models["auto"]), experts_of(models["nvfp4"])
    assert auto.keys() == nvfp4.keys() and auto
    nvfp4_bytes = bf16_bytes = 0
    for name, experts in nvfp4.items():
        assert experts.nvfp4 and experts.gate_up_proj.dtype == torch.uint8
        for projection, parts in PROJECTIONS:
            expected = quantize_nvfp4_parts(getattr(auto[name], projection), parts)
            assert torch.equal(getattr(experts, projection), expected.codes), (name, projection)
            block = getattr(experts, projection + "_scale")
            assert torch.equal(block.view(torch.uint8), expected.block_scales.view(torch.uint8))
            assert torch.equal(getattr(experts, projection + "_scale_2"), expected.global_scale)
        tensors = (*experts.parameters(), *experts.buffers())
        nvfp4_bytes += sum(t.numel() * t.element_size() for t in tensors)
        bf16_bytes += sum(p.numel() * 2 for p in auto[name].parameters())
    # 4 bits a weight + one e4m3 scale per 16 = 4.5 bits = 0.28125x BF16, plus 12 bytes of global scales
    # per expert.
    assert 0.28125 < nvfp4_bytes / bf16_bytes < 0.285
    assert any(isinstance(m, Fp8Linear) for m in models["nvfp4"].modules())  # dense layers: FP8


def test_the_engine_counts_packed_experts_and_their_scales(loaded):
    """The startup summary's weights: every other tensor as stored, plus NVFP4's codes (half a byte a
    weight), block scales (a byte per 16) and global scales (three fp32 per expert), from the shapes."""
    _, models = loaded
    model = models["nvfp4"]
    experts = experts_of(model)
    inside = {id(t) for m in experts.values() for t in (*m.parameters(), *m.buffers())}
    others = sum(
        t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if id(t) not in inside
    )
    packed = 0
    for module in experts.values():
        e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
        packed += 3 * e * h * i // 2 + 3 * e * h * i // 16 + 4 * e * 3
    assert make_engine_for(model).weight_bytes == others + packed


def make_engine_for(model: torch.nn.Module):
    from morion.loader import LoadedModel

    return make_engine(LoadedModel(model, None, {}, CPU), kv_cache_tokens=64)


def logits_of(name: str, model: torch.nn.Module) -> torch.Tensor:
    """Logits of two random 16-token prompts, concatenated."""
    vocab = CONFIGS[name]["vocab_size"]
    prompts = [[random.Random(seed).randrange(vocab) for _ in range(16)] for seed in range(2)]
    if name == "qwen3_next":
        return torch.cat([full_prefill_logits(model, prompt) for prompt in prompts])
    return torch.cat([one_shot_logits(model, prompt, 16) for prompt in prompts])


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def test_logits_within_nvfp4_error(loaded):
    name, models = loaded
    # The reference: the unquantized experts with the NVFP4 build's FP8 dense layers, so that only the
    # experts differ from the NVFP4 build.
    reference = with_modules_of(models["auto"], models["nvfp4"], Fp8Linear)
    # The router and the shared expert's FP8 stack too (random weights are drawn by name, and a stacked
    # or separate block names its shared expert and its gate otherwise).
    reference = with_modules_of(reference, models["nvfp4"], torch.nn.Linear, leaf="gate")
    reference = with_modules_of(reference, models["nvfp4"], StackedExperts, leaf="shared_experts")
    nvfp4_experts = experts_of(models["nvfp4"])
    noisy = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(0)
    errors = []
    with torch.no_grad():
        for module_name, experts in experts_of(noisy).items():
            for projection, parts in PROJECTIONS:
                weight = getattr(experts, projection)
                error = dequantized(nvfp4_experts[module_name], projection, parts) - weight
                errors.append((error.norm() / weight.norm()).item())
                rms = error.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt()  # per expert matrix
                weight.add_(torch.randn(weight.shape, generator=generator) * rms)
    assert min(errors) > 0.08 and max(errors) < 0.11  # eps of Gaussian weights

    expected = logits_of(name, reference)
    nvfp4_error = rel_l2(logits_of(name, models["nvfp4"]), expected)
    noise_error = rel_l2(logits_of(name, noisy), expected)
    assert noise_error / 1.5 < nvfp4_error < 1.5 * noise_error, (nvfp4_error, noise_error)

    # One MoE layer with fixed routing: the routed experts' output within ~1.9 eps (the module docstring).
    module_name, experts = next(iter(experts_of(reference).items()))
    x = torch.randn(32, experts.hidden_size, generator=generator)
    (topk_weights, topk_ids), _ = reference.get_submodule(module_name.removesuffix(".experts")).route_apart(x)
    exact = experts(x, topk_weights, topk_ids)
    quantized = nvfp4_experts[module_name](x, topk_weights, topk_ids)
    layer_error = rel_l2(quantized, exact)
    assert max(errors) < layer_error < 2.2 * max(errors)  # measured 1.77 and 1.88 eps
