"""DeepSeek-V2/V3 causal LM over pagedmla: embeddings, decoder layers (MLA + dense MLP or MoE), norm, LM head.

The forward works on a flat token batch (all requests' new tokens concatenated) with explicit
positions; the attention layers take everything about the paged cache from the StepContext.

Tensor parallelism (``tp``, a ``pagedmla.parallel.Group``): every rank runs the whole model on the whole
batch with its slices of the heads, the MLP and expert intermediate features and the vocabulary
(``pagedmla.model.parallel``); one all-reduce ends each attention and MLP/MoE block and the embedding, and
an all-gather puts the logits together, so every rank holds the same hidden states and logits.
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
from pagedmla.model.parallel import ParallelLMHead, VocabParallelEmbedding
from pagedmla.model.rope import RotaryEmbedding
from pagedmla.parallel import SINGLE, Group


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)).

    layer_id: the checkpoint's layer index (it decides dense MLP or MoE); tp: the tensor-parallel group its
    heads and MLP are split over; cache_layer_id: the attention's layer in the latent cache, ``layer_id``
    unless the layer has a cache of its own (an MTP layer)."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, tp: Group = SINGLE, cache_layer_id: int | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id if cache_layer_id is None else cache_layer_id, tp)
        self.mlp = MoE(cfg, tp) if cfg.is_moe_layer(layer_id) else \
            MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding,
                ctx: StepContext) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekBody(nn.Module):
    """Embeddings, layers and final norm (the checkpoints' ``model.*`` tensors)."""

    def __init__(self, cfg: DeepseekConfig, tp: Group = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """The whole model (this rank's slices of it under ``tp``); ``state_dict()`` names are the Hugging Face
    checkpoint names (routed experts stacked). ValueError naming the config field that ``tp`` cannot split."""

    def __init__(self, cfg: DeepseekConfig, tp: Group = SINGLE):
        super().__init__()
        cfg.check_tensor_parallel(tp.size)
        self.config = cfg
        self.tp = tp
        self.model = DeepseekBody(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
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
