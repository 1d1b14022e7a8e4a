"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers (the reference nobody on this team wrote)."""

from __future__ import annotations

import torch

HF_VARIANTS = ("v3_yarn_qlora", "v2_softmax_plain_q", "v3_neox_plain_q")

_COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
               qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.1, eos_token_id=1,
               bos_token_id=0)


def hf_config(variant: str):
    """Two layers (one dense, one MoE) in each variant:
    v3_yarn_qlora: V3, q_lora_rank, YaRN rope (mscale), sigmoid router + correction bias + 4 groups, interleaved rope;
    v2_softmax_plain_q: V2, plain q_proj, softmax router with group_limited_greedy, default rope;
    v3_neox_plain_q: V3, plain q_proj, rope_interleave False, one group."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    if variant == "v3_yarn_qlora":
        return DeepseekV3Config(**_COMMON, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "mscale": 1.0, "mscale_all_dim": 1.0,
                                                 "original_max_position_embeddings": 64,
                                                 "beta_fast": 32, "beta_slow": 1})
    if variant == "v2_softmax_plain_q":
        return DeepseekV2Config(**_COMMON, q_lora_rank=None, n_group=4, topk_group=2,
                                topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if variant == "v3_neox_plain_q":
        return DeepseekV3Config(**_COMMON, q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    raise ValueError(f"variant: unknown {variant!r}")


def hf_model(variant: str, seed: int = 0):
    """A randomly initialised transformers model in float32 (router correction bias randomised too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(variant), dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.1)
    return model.eval()


def save_hf_checkpoint(variant: str, path, seed: int = 0, **save_kwargs):
    """Write the variant with ``save_pretrained`` to ``path``; returns the transformers model."""
    model = hf_model(variant, seed)
    model.save_pretrained(path, **save_kwargs)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """transformers' greedy generate of exactly ``max_new_tokens`` tokens (EOS does not stop it), or with
    ``stop_at_eos`` of up to ``max_new_tokens`` ending after EOS (kept, as pagedmla keeps it).

    The two are different greedy rules, not a truncation of one another: ``min_new_tokens`` forbids EOS
    until the length is reached, so without ``stop_at_eos`` the tokens after a would-be EOS differ."""
    min_new = {} if stop_at_eos else {"min_new_tokens": max_new_tokens}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **min_new)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits [len(prompt), vocab] of one unpadded prompt."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: the largest deviation measured against the logits' scale."""
    return ((got - ref).abs().max() / ref.abs().max()).item()
