"""DeepSeek's multi-token-prediction (MTP) layers as a draft model.

DeepSeek-V3/R1 checkpoints (``num_nextn_predict_layers`` > 0) hold, after their last decoder layer, MTP
layers ``model.layers.{num_hidden_layers + i}.*``: ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, a
decoder block of their own (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``:
MoE or dense by the layer's index, as any layer) and ``shared_head`` (``norm``, ``head``). Embedding and
head are the target's (DeepSeek-V3 trains them shared; its checkpoint stores copies).

Row i of an MTP step pairs the target's final hidden state at position i (after its last norm) with the
embedding of token i + 1 and predicts token i + 2:

    x = eh_proj([enorm(embed(t[i + 1])) | hnorm(h[i])]);  o = shared_head.norm(block(x));  logits = head(o)

The row runs at position i (rope is relative, so this agrees with implementations that use i + 1) and
stores its latent row at the target's slot for position i, in the draft's own cache. Drafting further
steps reuses the layer on its own output: the next row takes o as its hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.model.attention import MLAttention
from pagedmla.model.config import DeepseekConfig
from pagedmla.model.context import StepContext
from pagedmla.model.deepseek import DecoderLayer, DeepseekForCausalLM
from pagedmla.model.moe import Router
from pagedmla.model.norm import RMSNorm
from pagedmla.model.rope import RotaryEmbedding

# The tensors of an MTP layer that are the target's (embedding and LM head), by the end of their names.
SHARED_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    """An MTP layer's output: its own ``norm``, and ``head`` (the target's LM head unless the checkpoint's
    differs)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """One MTP layer: the decoder block of checkpoint layer ``layer_id`` with the MTP input and output parts;
    its attention is layer ``cache_layer_id`` of the draft cache. Parameter names are the checkpoint's
    after ``model.layers.{layer_id}.``."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, cache_layer_id: int):
        super().__init__(cfg, layer_id, cache_layer_id=cache_layer_id)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, ctx: StepContext) -> torch.Tensor:
        """input_ids int64 [T] (token i + 1 of each row), hidden [T, hidden_size] (the target's or this
        layer's previous output) -> o [T, hidden_size], after ``shared_head.norm``."""
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, rotary, ctx))


class DeepseekMTP(nn.Module):
    """The MTP layers of a DeepSeek checkpoint (``cfg.num_nextn_predict_layers`` of them, or
    ``num_layers``); layer i's tensors are ``layers.{i}.*`` here and ``model.layers.{num_hidden_layers +
    i}.*`` in the checkpoint. Build with ``build_empty_mtp`` and fill (``load_mtp``), then
    ``share_with(target)`` where embedding and head are the target's."""

    def __init__(self, cfg: DeepseekConfig, num_layers: int | None = None):
        super().__init__()
        n = cfg.num_nextn_predict_layers if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_nextn_predict_layers: the model has no MTP layers to draft with (got {n!r})")
        self.config = cfg
        self.layers = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + i, i) for i in range(n))
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)

    @property
    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.layers]

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of this module's tensor ``name`` (``layers.{i}.X`` ->
        ``model.layers.{num_hidden_layers + i}.X``)."""
        head, _, rest = name.partition(".")
        index, _, tail = rest.partition(".")
        if head != "layers" or not index.isdigit() or not tail:
            raise ValueError(f"name: {name!r} is not a tensor of an MTP layer")
        return f"model.layers.{self.config.num_hidden_layers + int(index)}.{tail}"

    def share_with(self, target: DeepseekForCausalLM) -> None:
        """Use the target's embedding and LM head (one copy in memory) in every layer."""
        for layer in self.layers:
            layer.embed_tokens = target.model.embed_tokens
            layer.shared_head.head = target.lm_head

    def absorb_weights(self) -> None:
        """Every layer's W_UK / W_UV from its kv_b_proj (after the weights are in place)."""
        for attn in self.attention_layers:
            attn.absorb_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: StepContext,
                layer: int = 0) -> torch.Tensor:
        """One draft step through MTP layer ``layer``: input_ids int64 [T] (token i + 1 of row i), positions
        int64 [T] (i), hidden [T, hidden_size] -> o [T, hidden_size]. ``ctx`` holds the draft backend, planned
        for this step, and the draft cache."""
        cos, sin = self.rotary.cos_sin(positions)
        return self.layers[layer](input_ids, hidden, cos, sin, self.rotary, ctx)

    def compute_logits(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """o [n, hidden_size] of layer ``layer`` -> logits float32 [n, vocab]."""
        return self.layers[layer].shared_head.head(hidden).float()


def build_empty_mtp(cfg: DeepseekConfig, device: torch.device | str, dtype: torch.dtype,
                    num_layers: int | None = None) -> DeepseekMTP:
    """The MTP layers on ``device`` with uninitialised storage in ``dtype`` (routers stay float32), built on
    the meta device first as ``build_empty`` builds the target. Embedding and head stay on the meta device
    (no memory) until ``share_with`` (or a loader) gives each layer one."""
    with torch.device("meta"):
        mtp = DeepseekMTP(cfg, num_layers)
    mtp.to(dtype)
    for layer in mtp.layers:
        for name, child in layer.named_children():
            if name == "shared_head":
                child.norm.to_empty(device=device)
            elif name != "embed_tokens":
                child.to_empty(device=device)
    for module in mtp.modules():
        if isinstance(module, Router):
            module.float()
    return mtp.eval().requires_grad_(False)


def mtp_weight_bytes(cfg: DeepseekConfig, itemsize: int, num_layers: int | None = None) -> int:
    """Bytes of the MTP layers' own tensors (embedding and head not counted: the target's), routers float32."""
    with torch.device("meta"):
        mtp = DeepseekMTP(cfg, num_layers)
    total = 0
    # Parameters and the absorbed attention copies (buffers that no checkpoint holds).
    for name, tensor in [*mtp.named_parameters(), *mtp.named_buffers()]:
        if name.endswith(SHARED_TENSORS):
            continue
        total += tensor.numel() * (4 if ".mlp.gate." in name else itemsize)
    return total
