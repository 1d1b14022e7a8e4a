"""Model pieces against transformers' functions: YaRN frequencies, rope layouts, softmax scale; the tiny model."""

from __future__ import annotations

import pytest
import torch
from hf_deepseek import HF_VARIANTS, hf_config

from pagedmla.model import DeepseekConfig, load_model, tiny_config
from pagedmla.model.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

YARN_CASES = [
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    {"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 512,
     "truncate": False},
]


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_and_scale_match_transformers(case):
    raw = dict(hf_config("v3_yarn_qlora").to_dict())
    raw["qk_rope_head_dim"] = 64
    raw["max_position_embeddings"] = 163840
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, **case}
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("qk_head_dim", "head_dim")})
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = DeepseekConfig.from_dict(raw)
    rotary = RotaryEmbedding(ours.rope, 64)
    assert torch.equal(rotary.inv_freq, ref_inv)
    assert rotary.attention_factor == pytest.approx(ref_factor, rel=1e-12)
    attn = hf_v3.DeepseekV3Attention(hf_cfg, 0)
    assert ours.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert ours.mla_config().softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_rope_application_matches_transformers(variant):
    hf_cfg = hf_config(variant)
    ours = DeepseekConfig.from_dict(hf_cfg.to_dict())
    rotary = RotaryEmbedding(ours.rope, ours.qk_rope_head_dim)
    gen = torch.Generator().manual_seed(0)
    T, H, R = 11, 4, ours.qk_rope_head_dim
    q = torch.randn(T, H, R, generator=gen)
    k = torch.randn(T, R, generator=gen)
    positions = torch.arange(3, 3 + T)
    cos, sin = rotary.cos_sin(positions)
    got_q, got_k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
    # transformers' layout: [batch, heads, seq, dim]
    q4, k4 = q.transpose(0, 1)[None], k[None, None]
    if variant.startswith("v2"):
        emb = hf_v2.DeepseekV2RotaryEmbedding(hf_cfg)
        ref_q, ref_k = hf_v2.apply_rotary_emb(q4, k4, emb(q4, positions[None]))
    else:
        emb = hf_v3.DeepseekV3RotaryEmbedding(hf_cfg)
        c, s = emb(q4, positions[None])
        fn = hf_v3.apply_rotary_pos_emb_interleave if hf_cfg.rope_interleave else hf_v3.apply_rotary_pos_emb
        ref_q, ref_k = fn(q4, k4, c, s)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k[0, 0], rtol=1e-6, atol=1e-6)


def test_tiny_model_is_deterministic_and_uses_deepseek_dims():
    cfg = tiny_config()
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (512, 64, 128, 128)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [False, True, True]
    a, b, c = load_model("tiny", seed=0), load_model("tiny", seed=0), load_model("tiny", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    attn = a.model.layers[0].self_attn
    w = attn.kv_b_proj.weight.view(4, 256, 512)
    assert torch.equal(attn.w_uk, w[:, :128]) and torch.equal(attn.w_uv, w[:, 128:].transpose(1, 2))


def test_load_model_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="model"):
        load_model("tinyy")
    with pytest.raises(TypeError, match="model"):
        load_model(3)
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="int8")
