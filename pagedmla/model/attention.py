"""Multi-head Latent Attention layer: projections, rope, and the call into MLABackend in either form.

Per token the layer stores one latent row ``[kv_a_layernorm(c_kv) | rope(k_pe)]`` (kv_lora_rank +
qk_rope_head_dim wide). The backend decides the form of each step (``backend.attention_form``):
"absorbed" folds ``W_UK`` into the query and ``W_UV`` into the output so attention runs over latent
rows; "mha" / "chunked" decompress the latent with ``kv_b_proj`` into per-head keys and values.

Under tensor parallelism each rank holds its slice of the heads (``q_proj`` / ``q_b_proj`` / ``kv_b_proj``
column-parallel, ``o_proj`` row-parallel: one all-reduce per layer) and the whole latent path
(``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms), so every rank stores the same latent rows: MLA has
one latent head, which is not split.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.model.config import DeepseekConfig
from pagedmla.model.context import StepContext
from pagedmla.model.norm import RMSNorm
from pagedmla.model.parallel import ColumnParallelLinear, RowParallelLinear
from pagedmla.model.rope import RotaryEmbedding
from pagedmla.parallel import SINGLE, Group


class MLAttention(nn.Module):
    """One MLA layer; parameter names follow the Hugging Face checkpoints (``self_attn.*``). ``num_heads``
    is this rank's share of the heads."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, tp: Group = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads // tp.size
        self.nope = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * cfg.qk_head_dim, False, tp)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * cfg.qk_head_dim, False, tp)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False,
                                              tp)
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, hidden, cfg.attention_bias, tp)
        # Absorbed weights, derived from kv_b_proj by absorb_weights() after loading.
        local = self.num_heads
        self.register_buffer("w_uk", torch.empty(local, cfg.qk_nope_head_dim, cfg.kv_lora_rank), persistent=False)
        self.register_buffer("w_uv", torch.empty(local, cfg.kv_lora_rank, cfg.v_head_dim), persistent=False)

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """Split kv_b_proj [H * (nope + v), kv_lora_rank] into W_UK [H, nope, r] and W_UV^T [H, r, v]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope].contiguous()
        self.w_uv = w[:, self.nope:].transpose(1, 2).contiguous()

    def decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [n, kv_lora_rank + rope] -> k [n, H, nope + rope], v [n, H, v_head_dim].

        The rope part of the rows is already rotated, so it is broadcast to every head as is."""
        n = rows.shape[0]
        c, k_pe = rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank:]
        kv = self.kv_b_proj(c.to(self.kv_b_proj.weight.dtype)).view(n, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.to(k_nope.dtype)[:, None, :].expand(n, self.num_heads, self.rope_dim)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding,
                ctx: StepContext) -> torch.Tensor:
        """x [T, hidden] (the step's new tokens), cos/sin [T, rope / 2] -> [T, hidden]."""
        t = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe = rotary.apply(q_pe, cos, sin)
        k_pe = rotary.apply(k_pe, cos, sin)
        latent = torch.cat([c, k_pe], dim=-1)
        backend = ctx.backend
        if backend.attention_form == "absorbed":
            q_abs = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            q_full = torch.cat([q_abs, q_pe], dim=-1)
            o = backend.forward(q_full, latent[:, None, :], None, self.layer_id, ctx.out_cache_loc, ctx.cache)
            o = torch.bmm(o.view(t, self.num_heads, self.kv_lora_rank).transpose(0, 1).to(self.w_uv.dtype), self.w_uv)
            o = o.transpose(0, 1).reshape(t, self.num_heads * self.v_dim)
        else:
            k, v = self.decompress(latent)
            q_full = torch.cat([q_nope, q_pe], dim=-1)
            o = backend.forward(q_full, k, v, self.layer_id, ctx.out_cache_loc, ctx.cache, latent=latent,
                                kv_decompress=self.decompress)
        return self.o_proj(o.to(x.dtype))
