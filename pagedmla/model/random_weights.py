"""Deterministic random weights (the built-in ``tiny`` model and tests)."""

from __future__ import annotations

import torch

from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.mtp import SHARED_TENSORS, DeepseekMTP
from pagedmla.model.parallel import shard_specs


@torch.no_grad()
def init_random_(model: DeepseekForCausalLM | DeepseekMTP, seed: int = 0) -> DeepseekForCausalLM | DeepseekMTP:
    """Fill every tensor of ``model`` from a generator on the model's device seeded with ``seed``: the
    same values for the same seed on the same kind of device (drawn on the GPU, a 16B-parameter model
    initialises in seconds instead of minutes on the CPU).

    Matrices get N(0, 1 / fan_in) so activations stay O(1) through the layers; the LM head is scaled up
    so the logits of a random model have clear maxima; norms are 1, the router bias small. A
    tensor-parallel rank draws every tensor whole and keeps its slice, so the ranks together hold the
    single-device model of the same seed. An MTP model's embedding and head are the target's
    (``DeepseekMTP.share_with``) and are left as they are.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device)

    hidden = model.config.hidden_size
    shards = shard_specs(model)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if isinstance(model, DeepseekMTP) and name.endswith(SHARED_TENSORS):
            continue
        shard = shards.get(name)
        shape = tensor.shape if shard is None else shard.full_shape(tensor.shape)
        if name.endswith("norm.weight"):
            values = torch.ones(shape, device=device)
        elif name.endswith(".bias"):
            values = torch.zeros(shape, device=device)
        elif name.endswith("e_score_correction_bias"):
            values = randn(shape) * 0.05
        elif name == "model.embed_tokens.weight":
            values = randn(shape)
        elif name == "lm_head.weight":
            values = randn(shape) * (4.0 / hidden ** 0.5)
        else:
            values = randn(shape) / shape[-1] ** 0.5
        tensor.copy_(values if shard is None else shard.take(values))
    model.absorb_weights()
    return model
