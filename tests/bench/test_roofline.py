"""The roofline against bytes and FLOPs counted by hand for a tiny Qwen3-Next, and against the worked
numbers for the full Qwen3-Next-80B-A3B in performance-anchors.md §3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion.bench import roofline
from morion.layers.moe import StackedExperts
from morion.models.presets import preset_config
from morion.models.registry import build_model

H, V = 64, 256  # hidden size, vocabulary
E, K, FF = 8, 2, 32  # experts, top-k, expert intermediate size
TINY = dict(
    model_type="qwen3_next",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=128,
    num_hidden_layers=4,
    full_attention_interval=2,  # layers 1 and 3 attend, 0 and 2 are Gated DeltaNet
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=E,
    num_experts_per_tok=K,
    moe_intermediate_size=FF,
    shared_expert_intermediate_size=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,  # built, and never read by a plain decode step
)

# Parameters by hand, per module (no biases anywhere in this config).
ATTENTION_LINEAR = H * 4 * 16 * 2 + 2 * (H * 2 * 16) + 4 * 16 * H  # q (with gate), k, v, o = 16384
ATTENTION_OTHER = 16 + 16  # q_norm, k_norm
GDN_LINEAR = H * (2 * 32 + 2 * 64) + H * 2 * 4 + 64 * H  # in_proj_qkvz, in_proj_ba, out_proj = 16896
GDN_OTHER = 128 * 4 + 4 + 4 + 16  # depthwise conv over q|k|v (128 channels), A_log, dt_bias, gated norm
MOE_LINEAR = H * E + 3 * H * 32 + H  # router, shared expert (gate, up, down), shared-expert gate = 6720
LAYER_NORMS = 2 * H
LM_HEAD = V * H
DENSE_LINEAR = 2 * ATTENTION_LINEAR + 2 * GDN_LINEAR + 4 * MOE_LINEAR + LM_HEAD
DENSE_OTHER = 2 * ATTENTION_OTHER + 2 * GDN_OTHER + 4 * LAYER_NORMS + H  # + the final norm
EXPERT = 2 * FF * H + H * FF  # gate|up [2I, H] and down [H, I] of one expert = 6144
# Per request: conv window (W-1 = 3 rows of 128 channels, model dtype) and recurrent state
# (4 value heads x 16 x 16, fp32) of each of the 2 GDN layers; K/V of 2 attention layers per token.
STATE_BF16 = 2 * (3 * 128 * 2 + 4 * 16 * 16 * 4)
KV_BF16 = 2 * 2 * 2 * 16 * 2


def tiny_cost(dtype: torch.dtype = torch.bfloat16) -> roofline.ModelCost:
    return roofline.from_config(TINY, dtype)


def test_tiny_model_bytes_match_a_hand_count():
    cost = tiny_cost()
    assert DENSE_LINEAR == 109824 and DENSE_OTHER == 1712 and EXPERT == 6144
    assert cost.dense_params == DENSE_LINEAR + DENSE_OTHER
    assert cost.dense_bytes == 2 * (DENSE_LINEAR + DENSE_OTHER)
    assert cost.lm_head_params == LM_HEAD
    assert cost.moe_layers == (roofline.MoELayer(E, K, 2 * EXPERT, EXPERT, stacked_shared=True),) * 4
    assert cost.state_bytes == STATE_BF16 == 9728
    assert cost.kv_bytes_per_token == KV_BF16 == 256
    assert cost.attention_query_dims == (64, 64)  # the MTP head's attention layer is not counted
    assert cost.active_params == DENSE_LINEAR + DENSE_OTHER + 4 * K * EXPERT
    embedding, draft = sorted(cost.excluded.items(), key=lambda item: "embedding" not in item[0])
    assert embedding[1] == V * H * 2
    assert "mtp" in draft[0] and draft[1] > 2 * E * EXPERT  # the draft head's layer has its own experts


def test_a_stacked_shared_expert_counts_as_dense():
    """The tiny model stacks its shared expert (as wide as a routed expert): expert E of each layer's
    stack is read every step, so it is in the dense bytes (the hand count's MOE_LINEAR), and the routed
    experts are E, not E + 1. Under nvfp4 it is kept apart and the count is the same."""
    model = build_model(TINY, torch.bfloat16, torch.device("meta"))
    assert model.model.layers[0].mlp.experts.num_experts == E + 1
    for weights in ("auto", "nvfp4"):
        cost = roofline.from_config(TINY, torch.bfloat16, weights)
        assert all(layer.num_experts == E for layer in cost.moe_layers)
    assert tiny_cost().dense_params == DENSE_LINEAR + DENSE_OTHER


def test_the_expert_kernels_read_the_distinct_experts_and_a_stacked_shared_expert():
    """At one token the routed kernels read its k experts and, where the shared expert is stacked with
    them (the tiny model), that one too, in every MoE layer; beside them in a stack of its own (nvfp4)
    it runs in kernels of its own and is not counted. At B tokens: the distinct experts expected."""
    stacked = tiny_cost()
    assert roofline.expert_kernel_bytes(stacked, 1) == 4 * (K + 1) * 2 * EXPERT
    assert roofline.expert_kernel_bytes(stacked, 3) == pytest.approx(
        4 * (roofline.distinct_experts(3, E, K) + 1) * 2 * EXPERT
    )
    beside = roofline.from_config(TINY, torch.bfloat16, "nvfp4")
    assert not any(layer.stacked_shared for layer in beside.moe_layers)
    per_expert = beside.moe_layers[0].bytes_per_expert
    assert per_expert < 2 * EXPERT  # packed codes and block scales, not bf16
    assert roofline.expert_kernel_bytes(beside, 1) == 4 * K * per_expert


def test_distinct_experts():
    assert roofline.distinct_experts(1, E, K) == K
    assert roofline.distinct_experts(3, E, K) == pytest.approx(8 * (1 - 0.75**3))  # 4.625
    # performance-anchors.md §3 (rounded there): E=512, k=10 at B = 1, 2, 4, 8, 16, 32, 64.
    anchors = (10, 19.8, 38.8, 74.7, 139, 240, 367)
    for batch, expected in zip((1, 2, 4, 8, 16, 32, 64), anchors, strict=True):
        assert roofline.distinct_experts(batch, 512, 10) == pytest.approx(expected, abs=0.5)


def test_decode_bytes_bound_and_mbu():
    cost = tiny_cost()
    batch, context = 3, 100
    expected = (
        2 * (DENSE_LINEAR + DENSE_OTHER)
        + 4 * 4.625 * 2 * EXPERT
        + batch * (2 * STATE_BF16 + KV_BF16 * context)
    )
    assert roofline.decode_bytes(cost, batch, context) == pytest.approx(expected)
    bound = roofline.decode_bound(cost, batch, context, bandwidth_gbs=1000)
    assert bound.floor_step_s == pytest.approx(expected / 1e12)
    assert bound.per_request_tok_s == pytest.approx(1e12 / expected)
    assert bound.aggregate_tok_s == pytest.approx(3e12 / expected)
    # A step measured at twice the floor uses half the bandwidth.
    assert roofline.mbu(cost, batch, context, 2 * bound.floor_step_s, 1000) == pytest.approx(0.5)


def test_prefill_flops():
    cost = tiny_cost()
    n = 64
    linear = 2 * (DENSE_LINEAR + DENSE_OTHER + 4 * K * EXPERT - LM_HEAD)
    attention = 2 * 4 * 64 * n / 2  # two attention layers of 4 heads x 16 dims
    assert roofline.prefill_flops_per_token(cost, n) == pytest.approx(linear + attention)
    assert roofline.prefill_bound(cost, n, 1.0).tok_s == pytest.approx(1e12 / (linear + attention))


def _to_fp8(model: nn.Module) -> None:
    """What an FP8 load leaves: e4m3 linear and expert weights (scales left out here)."""
    fp8 = torch.float8_e4m3fn
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(module.weight.to(fp8), requires_grad=False)
        if isinstance(module, StackedExperts):
            module.gate_up_proj = nn.Parameter(module.gate_up_proj.to(fp8), requires_grad=False)
            module.down_proj = nn.Parameter(module.down_proj.to(fp8), requires_grad=False)


def test_fp8_weights_count_one_byte():
    model = build_model(TINY, torch.bfloat16, torch.device("meta"))
    spec = model.cache_spec(16, torch.float8_e4m3fn)
    bf16_dense = roofline.from_model(model, spec).dense_bytes
    modelled = roofline.from_model(model, spec, fp8_weights=True)  # storage modelled from a bf16 build
    _to_fp8(model)
    stored = roofline.from_model(model, spec)  # storage as it is
    for cost in (stored, modelled):
        assert cost.dense_bytes == DENSE_LINEAR + 2 * DENSE_OTHER  # norms, conv, A_log, dt_bias stay bf16
        assert cost.moe_layers[0].bytes_per_expert == EXPERT
        assert cost.kv_bytes_per_token == KV_BF16 // 2  # FP8 K/V
    assert bf16_dense == 2 * (DENSE_LINEAR + DENSE_OTHER)


def test_full_qwen3_next_matches_the_anchor_arithmetic():
    """performance-anchors.md §3: 3.56 B active parameters; bf16 floors at 4.3 TB/s of 589 / 532 / 313
    tok/s at 1K / 32K / 256K; 24 KiB of K/V per token; 6.6 GFLOP per token at 1K; FP8 near 1,050-1,150."""
    config = preset_config("preset:qwen3-next-80b-a3b")
    cost = roofline.from_config(config, torch.bfloat16)
    assert cost.active_params == pytest.approx(3.56e9, rel=5e-3)
    assert cost.kv_bytes_per_token == 24 * 1024
    assert len(cost.moe_layers) == 48 and cost.moe_layers[0][:2] == (512, 10)
    for context, tok_s in ((1024, 589), (32768, 532), (262144, 313)):
        assert roofline.decode_bound(cost, 1, context, 4300).per_request_tok_s == pytest.approx(
            tok_s, rel=5e-3
        )
    assert roofline.prefill_flops_per_token(cost, 1024) == pytest.approx(6.6e9, rel=1e-2)
    fp8 = roofline.from_config(config, torch.bfloat16, "fp8")
    assert 1000 < roofline.decode_bound(fp8, 1, 1024, 4300).per_request_tok_s < 1160


def test_nvfp4_experts_count_their_packed_bytes():
    """Codes at half a byte a weight, e4m3 block scales at a byte per 16, three fp32 global scales per
    expert (gate, up, down); dense layers FP8 as under --weight-dtype fp8."""
    fp8 = roofline.from_config(TINY, torch.bfloat16, "fp8")
    nvfp4 = roofline.from_config(TINY, torch.bfloat16, "nvfp4")
    assert nvfp4.moe_layers[0].bytes_per_expert == EXPERT // 2 + EXPERT // 16 + 3 * 4
    # The same dense bytes: the shared expert is FP8 with fp32 scales per row either way, stacked with
    # the FP8 experts or beside the NVFP4 ones in a one-expert stack of its own.
    assert nvfp4.dense_bytes == fp8.dense_bytes
    # Qwen3.8-Flash-Next: about 70 GiB of weights in all (the target; 121 GiB under fp8).
    flash = roofline.from_config(preset_config("preset:qwen3.8-flash-next"), torch.bfloat16, "nvfp4")
    experts = sum(m.num_experts * m.bytes_per_expert for m in flash.moe_layers)
    total = flash.dense_bytes + experts + sum(flash.excluded.values())
    assert 70 < total / 2**30 < 71.5 and 63 < experts / 2**30 < 63.5
