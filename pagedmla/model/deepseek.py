"""DeepSeek-V2/V3 causal LM over pagedmla: embeddings, decoder layers (MLA + dense MLP or MoE), norm, LM head.

The forward works on a flat token batch (all requests' new tokens concatenated) with explicit
positions; the attention layers take everything about the paged cache from the StepContext.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.model.attention import MLAttention
from pagedmla.model.config import DeepseekConfig
from pagedmla.model.context import StepContext
from pagedmla.model.mlp import MLP
from pagedmla.model.moe import MoE
from pagedmla.model.norm import RMSNorm
from pagedmla.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)).

    layer_id: the checkpoint's layer index (it decides dense MLP or MoE); cache_layer_id: the attention's
    layer in the latent cache, ``layer_id`` unless the layer has a cache of its own (an MTP layer)."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, cache_layer_id: int | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id if cache_layer_id is None else cache_layer_id)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_id) else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding,
                ctx: StepContext) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekBody(nn.Module):
    """Embeddings, layers and final norm (the checkpoints' ``model.*`` tensors)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """The whole model; ``state_dict()`` names are the Hugging Face checkpoint names (routed experts stacked)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.config = cfg
        self.model = DeepseekBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)

    @property
    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def absorb_weights(self) -> None:
        """Precompute every layer's W_UK / W_UV from kv_b_proj (call after the weights are in place)."""
        for attn in self.attention_layers:
            attn.absorb_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids int64 [T], positions int64 [T] (index of each token in its sequence) -> hidden [T, hidden].

        ``ctx.backend`` must already be planned for this step's batch."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, self.rotary, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits float32 [n, vocab]."""
        return self.lm_head(hidden).float()
