"""Materialise a DeepSeek model on a device without running any parameter initialiser."""

from __future__ import annotations

import torch

from pagedmla.model.config import DeepseekConfig
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.moe import Router
from pagedmla.parallel import SINGLE, Group


def build_empty(cfg: DeepseekConfig, device: torch.device | str, dtype: torch.dtype,
                tp: Group = SINGLE) -> DeepseekForCausalLM:
    """The model's modules (this rank's slices of them under ``tp``) on ``device`` with uninitialised storage
    in ``dtype`` (routers stay float32).

    Built on the meta device first, so no memory is touched twice and no random init runs; the
    caller fills every tensor of ``state_dict()`` and then calls ``absorb_weights()``."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, tp)
    model.to_empty(device=device)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)
