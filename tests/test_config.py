"""MLAConfig.from_hf_config reads YaRN settings in both spellings."""

import math

import pytest

from pagedmla import MLAConfig

BASE = dict(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            num_hidden_layers=2, max_position_embeddings=16384)
YARN = {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1}
EXPECTED = 192 ** -0.5 * (0.1 * 0.707 * math.log(4.0) + 1) ** 2


@pytest.mark.parametrize("key,kind_key", [("rope_scaling", "type"), ("rope_parameters", "rope_type")])
def test_yarn_mscale_from_either_spelling(key, kind_key):
    cfg = MLAConfig.from_hf_config({**BASE, key: {kind_key: "yarn", **YARN}})
    assert cfg.softmax_scale == pytest.approx(EXPECTED, rel=1e-12)


def test_null_factor_falls_back_to_context_ratio():
    cfg = MLAConfig.from_hf_config({**BASE, "rope_parameters": {"rope_type": "yarn", **YARN, "factor": None}})
    assert cfg.softmax_scale == pytest.approx(EXPECTED, rel=1e-12)


def test_plain_rope_has_no_mscale():
    cfg = MLAConfig.from_hf_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-12)
