"""Deterministic random weights (the built-in ``tiny`` model and tests)."""

from __future__ import annotations

import torch

from pagedmla.model.deepseek import DeepseekForCausalLM


@torch.no_grad()
def init_random_(model: DeepseekForCausalLM, seed: int = 0) -> DeepseekForCausalLM:
    """Fill every tensor of ``model`` from a CPU generator seeded with ``seed`` (same values on any device).

    Matrices get N(0, 1 / fan_in) so activations stay O(1) through the layers; the LM head is scaled
    up so the logits of a random model have clear maxima (greedy decoding is then stable across
    numerically different attention kernels); norms are 1, the router bias small.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            values = torch.ones(tensor.shape)
        elif name.endswith(".bias"):
            values = torch.zeros(tensor.shape)
        elif name.endswith("e_score_correction_bias"):
            values = torch.randn(tensor.shape, generator=gen) * 0.05
        elif name == "model.embed_tokens.weight":
            values = torch.randn(tensor.shape, generator=gen)
        elif name == "lm_head.weight":
            values = torch.randn(tensor.shape, generator=gen) * (4.0 / hidden ** 0.5)
        else:
            values = torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5
        tensor.copy_(values)
    model.absorb_weights()
    return model
