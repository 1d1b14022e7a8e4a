"""DeepSeek mixture of experts: router (softmax or sigmoid scoring, grouped top-k), routed and shared experts.

Router math is float32 (as the checkpoints keep ``gate.weight`` and ``e_score_correction_bias`` in
float32). Experts run grouped: tokens are sorted by expert and each expert with hits runs one GEMM
pair over its tokens. That needs the per-expert counts on the host, which a CUDA graph cannot capture;
under capture the experts run densely instead (every expert over every token, combined with the routing
weights, zero for unchosen experts): more FLOPs, but decode batches are small and the step has no sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedmla.model.config import DeepseekConfig
from pagedmla.model.mlp import MLP


class Router(nn.Module):
    """Chooses ``num_experts_per_tok`` experts per token and their weights.

    scoring "softmax" (V2) or "sigmoid" (V3); topk_method "greedy" (plain top-k),
    "group_limited_greedy" (V2: keep the ``topk_group`` groups with the best single expert) or
    "noaux_tc" (V3: groups ranked by the sum of their two best bias-corrected scores; the bias only
    steers the choice, the weights are the uncorrected scores).
    ``norm_topk_prob`` renormalises the chosen weights to sum 1 before ``routed_scaling_factor``
    (transformers' DeepSeek-V2 ignores the flag; DeepSeek's own V2 code and every V3 implementation honour it).
    """

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.scoring = cfg.scoring_func
        self.method = cfg.topk_method
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, dtype=torch.float32))
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights float32 [T, top_k], expert ids int64 [T, top_k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.method != "greedy":
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.method == "noaux_tc":
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
                masked_value = float("-inf")
            else:
                group_scores = grouped.max(dim=-1).values
                masked_value = 0.0
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            keep = keep[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~keep, masked_value)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        # noaux_tc weighs by the uncorrected scores; the other methods by the (group-masked) scores.
        weights = (scores if self.method == "noaux_tc" else choice).gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up_proj [E, 2 * inter, hidden] (gate rows first) and
    down_proj [E, hidden, inter]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights float32 [T, k], ids [T, k] -> sum_k weight * expert(x), [T, hidden] in x's dtype."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_dense(x, weights, ids)
        return self.forward_grouped(x, weights, ids)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same as ``forward_grouped`` without any host synchronisation (capturable): each expert runs
        over all T tokens and contributes with its combined routing weight (0 where not chosen)."""
        num_experts = self.gate_up_proj.shape[0]
        # dense[t, e] = routing weight of expert e for token t (ids are distinct within a row).
        dense = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in range(num_experts):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * dense[:, e:e + 1]
            out += y.to(out.dtype)
        return out

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert with tokens runs one GEMM pair over just those tokens (reads the counts back)."""
        out = torch.zeros_like(x)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        # One host read per MoE layer: the per-expert token counts decide which GEMMs run.
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // k
        flat_w = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * flat_w[start:start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out


class MoE(nn.Module):
    """Routed experts plus (optionally) always-on shared experts; x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.mlp_bias)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
