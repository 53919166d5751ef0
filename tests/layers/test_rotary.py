"""RoPE frequency scaling against transformers (fp32, CPU): YaRN's cos/sin equal transformers' rotary
embeddings (its `rope_init_fn` frequencies times its attention factor) at positions on both sides of
`original_max_position_embeddings`, for Qwen3.8-Flash-Next's interleaved mRoPE with text positions and
for Qwen3-Next; the config rules transformers applies around them; unknown types are refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

from morion.errors import ModelLoadError
from morion.layers.rotary import (
    RotaryEmbedding,
    rope_frequencies,
    scaled_context_length,
    standardize_rope,
)
from morion.models.qwen3_next import Qwen3NextConfig
from morion.models.qwen4_exp_config import Qwen4ExpConfig
from tests.models.conftest import CONFIGS, QWEN4_EXP_TINY

ORIGINAL = 64  # a small pretraining context, so positions 0..300 cover both regimes
POSITIONS = torch.arange(0, 301)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e4}
# transformers' optional YaRN keys, each changing the frequencies or the attention factor
VARIANTS = {
    "defaults": {},
    "factor 2": {"factor": 2.0},
    "no truncate": {"truncate": False},
    "betas": {"beta_fast": 16, "beta_slow": 2},
    "mscale equal": {"mscale": 0.707, "mscale_all_dim": 0.707},
    "mscale ratio": {"mscale": 1.0, "mscale_all_dim": 0.8},
    "mscale alone": {"mscale": 1.0},
    "attention_factor": {"attention_factor": 0.9},
}


def _ours(rotary_dim: int, rope: dict, max_position_embeddings: int = 4096) -> RotaryEmbedding:
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    return RotaryEmbedding(rotary_dim, standardize_rope(rope, max_position_embeddings))


@pytest.mark.parametrize("variant", VARIANTS)
def test_yarn_matches_qwen4_exp_text_rotary(variant):
    """Interleaved three-axis mRoPE with text positions (t = h = w) is ordinary partial RoPE."""
    rope = {**YARN, **VARIANTS[variant], "partial_rotary_factor": 0.25}
    rope |= {"mrope_section": [2, 3, 3], "mrope_interleaved": True}
    config = transformers.Qwen4ExpTextConfig(**{**QWEN4_EXP_TINY, "rope_parameters": dict(rope)})
    reference = Qwen4ExpTextRotaryEmbedding(config)
    expected_cos, expected_sin = reference(torch.zeros(1), POSITIONS[None, None].expand(3, 1, -1))
    ours = _ours(16, rope)  # head_dim 64 x 0.25
    cos, sin = ours(POSITIONS)
    assert ours.attention_factor == reference.attention_scaling
    assert torch.equal(ours._inv_freq, reference.inv_freq)
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_yarn_matches_transformers_rope_init(variant):
    """Against transformers' YaRN init function itself: cos/sin = its frequencies times its factor."""
    rope = {**YARN, **VARIANTS[variant], "partial_rotary_factor": 0.5}
    config = transformers.Qwen3NextConfig(**{**CONFIGS["tiny"], "rope_parameters": dict(rope)})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    angles = POSITIONS[:, None].float() * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    ours = _ours(32, rope)  # head_dim 64 x 0.5
    cos, sin = ours(POSITIONS)
    torch.testing.assert_close(cos, angles.cos() * attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin() * attention_factor, rtol=0, atol=1e-6)
    reference = Qwen3NextRotaryEmbedding(config)
    expected_cos, expected_sin = reference(torch.zeros(1), POSITIONS[None])
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=1e-6)


def test_yarn_blends_three_bands():
    """The tiny setting is not vacuous: some pairs keep their frequency, some are divided by the
    factor, some are blended, and the attention factor is not 1."""
    default, _ = rope_frequencies(16, {"rope_theta": 1e4})
    scaled, attention_factor = rope_frequencies(16, YARN)
    ratio = default / scaled
    assert ratio[0] == 1.0 and torch.allclose(ratio[-1], torch.tensor(4.0))
    assert ((ratio > 1.01) & (ratio < 3.99)).any()
    assert attention_factor == pytest.approx(1 + 0.1 * torch.log(torch.tensor(4.0)).item())


@pytest.mark.parametrize("rope_type", ("default", "linear", "llama3"))
def test_other_types_keep_a_unit_factor(rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    ours = _ours(32, rope)
    config = transformers.Qwen3NextConfig(
        **{**CONFIGS["tiny"], "rope_parameters": {**rope, "partial_rotary_factor": 0.5}}
    )
    expected_cos, expected_sin = Qwen3NextRotaryEmbedding(config)(torch.zeros(1), POSITIONS[None])
    cos, sin = ours(POSITIONS)
    assert ours.attention_factor == 1.0
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=1e-6)


def test_original_context_and_factor_follow_transformers():
    # no original context: max_position_embeddings; a top-level one wins over the rope dict's
    assert (
        standardize_rope({"rope_type": "yarn", "factor": 2.0}, 4096)["original_max_position_embeddings"]
        == 4096
    )
    rope = standardize_rope(YARN, 4096, top_level_original=128)
    assert rope["original_max_position_embeddings"] == 128
    # a null factor is the ratio of the two contexts
    assert standardize_rope({**YARN, "factor": None}, 4096)["factor"] == 4096 / ORIGINAL
    # the legacy `type` key
    assert standardize_rope({"type": "yarn", "factor": 2.0}, 4096)["rope_type"] == "yarn"


def test_scaled_context_length():
    assert scaled_context_length(standardize_rope(YARN, 4096), 4096) == 4096  # 64 x 4 is shorter
    flash = {**YARN, "factor": 4.0, "original_max_position_embeddings": 262144, "rope_theta": 1e7}
    assert scaled_context_length(standardize_rope(flash, 262144), 262144) == 1048576
    assert scaled_context_length({"rope_type": "default"}, 262144) == 262144


@pytest.mark.parametrize("rope_type", ("dynamic", "longrope", "ntk-by-parts"))
def test_unknown_rope_type_is_refused_by_name(rope_type):
    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ModelLoadError, match=f"unsupported rope_type '{rope_type}'") as error:
        standardize_rope(rope, 4096)
    assert "\n" not in str(error.value)
    with pytest.raises(ModelLoadError, match=rope_type):
        RotaryEmbedding(16, rope)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "'yarn' needs a factor"),
        ({"rope_type": "yarn", "factor": 0.0}, "factor must be positive"),
        ({"rope_type": "llama3", "factor": 8.0}, "'llama3' needs low_freq_factor"),
        ({"rope_type": "linear"}, "'linear' needs factor"),
    ],
)
def test_incomplete_scaling_is_refused(rope, message):
    with pytest.raises(ModelLoadError, match=message):
        standardize_rope(rope, 4096)


def _qwen4_exp_config(rope_parameters: dict) -> dict:
    return {"model_type": "qwen4_exp", "text_config": {**QWEN4_EXP_TINY, "rope_parameters": rope_parameters}}


def test_configs_read_yarn():
    """The release's long-context setting, in the nested qwen4_exp config and Qwen3-Next's model-card
    form (`rope_scaling` beside top-level `rope_theta` / `partial_rotary_factor`)."""
    flash = {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 262144,
        "rope_theta": 1e7,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    }
    text = {**QWEN4_EXP_TINY, "max_position_embeddings": 262144}
    config = Qwen4ExpConfig.from_hf(
        {"model_type": "qwen4_exp", "text_config": {**text, "rope_parameters": flash}}
    )
    assert config.rope["rope_type"] == "yarn" and config.rope["factor"] == 2.0 and config.rotary_dim == 16
    assert config.max_position_embeddings == 524288
    assert RotaryEmbedding(config.rotary_dim, config.rope).attention_factor > 1

    released = {**CONFIGS["tiny"], "model_type": "qwen3_next", "max_position_embeddings": 262144}
    released.pop("rope_parameters")
    released |= {"rope_theta": 5e6, "partial_rotary_factor": 0.25, "rope_parameters": None}
    released["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 262144,
    }
    config = Qwen3NextConfig.from_hf(released)
    assert config.rope == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 262144,
        "rope_theta": 5e6,
    }
    assert config.rotary_dim == 16 and config.max_position_embeddings == 1048576


def test_config_refuses_unknown_rope_type_in_one_line():
    with pytest.raises(ModelLoadError, match="qwen4_exp config: unsupported rope_type 'dynamic'") as error:
        Qwen4ExpConfig.from_hf(_qwen4_exp_config({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    assert "\n" not in str(error.value)


def test_frequencies_stay_fp32_on_the_cpu_when_built_on_meta():
    """Models are built on the meta device; the frequencies are computed for real all the same."""
    with torch.device("meta"):
        rotary = RotaryEmbedding(16, standardize_rope(YARN, 4096))
    assert rotary._inv_freq.device.type == "cpu" and rotary._inv_freq.dtype == torch.float32
    torch.testing.assert_close(rotary._inv_freq, rope_frequencies(16, YARN)[0], rtol=0, atol=0)
