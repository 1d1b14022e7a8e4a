"""Checkpoint loading: shard layouts, expert layouts, dtypes, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_deepseek import hf_logits, relative_error, save_hf_checkpoint
from safetensors.torch import load_file, save_file

from pagedmla.backend import ForwardMode
from pagedmla.engine import ModelRunner, SamplingParams, Sequence
from pagedmla.model import DeepseekConfig, load_checkpoint, load_model

pytest.importorskip("transformers")

VARIANT = "v3_yarn_qlora"
PROMPT = [5, 17, 3, 99, 42, 8, 61, 2, 7, 150, 33]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    hf = save_hf_checkpoint(VARIANT, path)
    return hf, path


def _logits(model):
    runner = ModelRunner(model, page_size=16, num_pages=8, max_batch_size=1, max_context_len=64, provider="torch")
    seq = Sequence(PROMPT, SamplingParams(), torch.device("cpu"))
    seq.slot = runner.table.add_request()
    runner.table.ensure_capacity(seq.slot, len(seq))
    return runner.run([seq], ForwardMode.EXTEND, 1, all_logits=True)


def _copy(src, dst, tensors=None, config_edit=None):
    os.makedirs(dst, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = load_file(src / "model.safetensors")
    save_file(tensors, dst / "model.safetensors")


def test_sharded_checkpoint_with_index(saved, tmp_path):
    hf, _ = saved
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert relative_error(_logits(load_checkpoint(tmp_path)), hf_logits(hf, PROMPT)) <= 1e-4


def test_shards_without_index(saved, tmp_path):
    hf, src = saved
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    _copy(src, tmp_path, {n: tensors[n] for n in names[::2]})
    save_file({n: tensors[n] for n in names[1::2]}, tmp_path / "model-b.safetensors")
    assert relative_error(_logits(load_checkpoint(tmp_path)), hf_logits(hf, PROMPT)) <= 1e-4


def test_stacked_expert_layout(saved, tmp_path):
    """transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    hf, src = saved
    tensors = dict(hf.state_dict())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in tensors)
    _copy(src, tmp_path, {n: t.contiguous() for n, t in tensors.items()})
    assert relative_error(_logits(load_checkpoint(tmp_path)), hf_logits(hf, PROMPT)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_in_its_dtype(saved, tmp_path, dtype):
    hf, src = saved
    tensors = {n: t.to(dtype) for n, t in load_file(src / "model.safetensors").items()}
    _copy(src, tmp_path, tensors, config_edit=lambda c: c.update(dtype=str(dtype).replace("torch.", "")))
    model = load_model(tmp_path)
    assert model.model.embed_tokens.weight.dtype == dtype
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # routers stay float32
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(model.state_dict()[name], tensors[name])


def test_multi_token_prediction_layers_are_skipped(saved, tmp_path):
    hf, src = saved
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    _copy(src, tmp_path, tensors)
    assert relative_error(_logits(load_checkpoint(tmp_path)), hf_logits(hf, PROMPT)) <= 1e-4


def test_missing_tensor_is_named(saved, tmp_path):
    _, src = saved
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    _copy(src, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.kv_b_proj\.weight'"):
        load_checkpoint(tmp_path)


def test_missing_expert_is_named(saved, tmp_path):
    _, src = saved
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    _copy(src, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        load_checkpoint(tmp_path)


def test_wrong_shape_names_tensor_and_both_shapes(saved, tmp_path):
    _, src = saved
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(79, 64)
    _copy(src, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight' has shape "
                                         r"\[79, 64\], the model expects \[80, 64\]"):
        load_checkpoint(tmp_path)


def test_unexpected_tensor_is_named(saved, tmp_path):
    _, src = saved
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    _copy(src, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) 'model\.layers\.0\.self_attn\.extra_proj\.weight'"):
        load_checkpoint(tmp_path)


def test_integer_tensor_is_rejected(saved, tmp_path):
    _, src = saved
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    _copy(src, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has dtype torch\.int32"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(("edit", "field"), [
    (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), "model_type"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_scaling"),
    (lambda c: c.update(n_group=3), "n_group"),
    (lambda c: c.pop("kv_lora_rank"), "kv_lora_rank"),
    (lambda c: c.update(scoring_func="relu"), "scoring_func"),
])
def test_unsupported_config_names_the_field(saved, tmp_path, edit, field):
    _, src = saved
    _copy(src, tmp_path, config_edit=edit)
    with pytest.raises(ValueError, match=field):
        load_checkpoint(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="model"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 1,
                                                      "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                                      "qk_rope_head_dim": 8, "v_head_dim": 8}))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path)


def test_hub_style_rope_fields(saved):
    """The hub checkpoints' ``rope_scaling`` + top-level ``rope_theta`` mean the same as ``rope_parameters``."""
    _, src = saved
    raw = json.loads((src / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = dict(params, type=params.pop("rope_type"))
    assert DeepseekConfig.from_dict(raw).rope == DeepseekConfig.from_file(src).rope
