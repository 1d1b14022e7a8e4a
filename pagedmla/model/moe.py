"""DeepSeek mixture of experts: router (softmax or sigmoid scoring, grouped top-k), routed and shared experts.

Router math is float32 (as the checkpoints keep ``gate.weight`` and ``e_score_correction_bias`` in
float32). Routed experts run as grouped GEMMs over the (token, choice) pairs sorted by expert, with
the group offsets computed on the device, so a step never waits for the host and a CUDA graph can
capture it; see ``Experts`` for the fallbacks where this torch build has no grouped GEMM.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pagedmla.model.config import DeepseekConfig
from pagedmla.model.mlp import MLP
from pagedmla.model.parallel import Shard
from pagedmla.parallel import SINGLE, Group


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
    down_proj [E, hidden, inter]. Under tensor parallelism every rank holds every expert with its slice
    of the intermediate features (``inter / size``), so the output is a partial sum over the group.

    Three ways to run them, all computing the same function:
    - ``forward_sorted``: the (token, choice) pairs sorted by expert, one grouped GEMM per projection
      (``torch._grouped_mm`` with device-side group offsets). No host synchronisation, so it is also
      what a CUDA graph captures; used wherever this torch build runs grouped GEMMs for the device and
      dtype (probed once per device type and dtype).
    - ``forward_grouped``: a GEMM pair per expert with hits; reads the per-expert counts back to the host.
    - ``forward_dense``: every expert over every token, weighted 0 where not chosen; no host
      synchronisation, E/top_k times the FLOPs. The capture fallback where grouped GEMMs are unavailable.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: Group = SINGLE):
        super().__init__()
        local = intermediate_size // tp.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        self.shards = {"gate_up_proj": Shard(1, intermediate_size, tp.rank, tp.size, parts=2),
                       "down_proj": Shard(2, intermediate_size, tp.rank, tp.size)}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights float32 [T, k], ids [T, k] -> sum_k weight * expert(x), [T, hidden] in x's dtype."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        # Grouped GEMM kernels want 16-byte-aligned rows: hidden and intermediate sizes multiples of 8.
        aligned = x.shape[1] % 8 == 0 and self.down_proj.shape[2] % 8 == 0
        if aligned and grouped_mm_supported(x.device, x.dtype, probe=not capturing):
            return self.forward_sorted(x, weights, ids)
        if capturing:
            return self.forward_dense(x, weights, ids)
        return self.forward_grouped(x, weights, ids)

    def forward_sorted(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection over the pairs sorted by expert; group offsets stay on the device."""
        num_tokens, k = ids.shape
        num_experts = self.gate_up_proj.shape[0]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        # scatter_add rather than bincount: bincount sizes its output from the data (a host read).
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        hidden = torch._grouped_mm(x[order // k], self.gate_up_proj.transpose(1, 2), offs=offsets)
        gate, up = hidden.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        y = y.to(_accumulate_dtype(x.dtype)) * weights.flatten()[order, None]
        # Back to (token, choice) order, then a fixed-order sum over the k choices (deterministic; no atomics).
        pairs = torch.empty_like(y).index_copy_(0, order, y)
        return pairs.view(num_tokens, k, x.shape[1]).sum(dim=1).to(x.dtype)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over all T tokens as one batched GEMM per projection, combined with the routing
        weights (0 for unchosen experts)."""
        num_experts = self.gate_up_proj.shape[0]
        # dense[t, e] = routing weight of expert e for token t (the router's ids are distinct within a row).
        dense = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        hidden = torch.bmm(x.expand(num_experts, -1, -1), self.gate_up_proj.transpose(1, 2))
        gate, up = hidden.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))
        return (y.to(_accumulate_dtype(x.dtype)) * dense.t()[:, :, None]).sum(dim=0).to(x.dtype)

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert with tokens runs one GEMM pair over just those tokens (reads the counts back)."""
        out = torch.zeros(x.shape, dtype=_accumulate_dtype(x.dtype), device=x.device)
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
            y = F.linear(F.silu(gate) * up, self.down_proj[e]).to(out.dtype) * flat_w[start:start + n, None]
            out.index_add_(0, rows, y)
            start += n
        return out.to(x.dtype)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The k weighted expert outputs of a token are summed in at least float32."""
    return torch.promote_types(dtype, torch.float32)


_GROUPED_MM: dict[tuple[str, int | None, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, probe: bool = True) -> bool:
    """Whether ``torch._grouped_mm`` runs for this device and dtype in this torch build without the host
    (it exists from torch 2.8; which devices, architectures and dtypes it accepts varies by build, and on
    CUDA some dtypes take a fallback that copies offsets through the host). Probed with a tiny call the
    first time, on CUDA inside a graph capture; ``probe=False`` (during a capture) answers False until probed."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index, dtype)
    if key not in _GROUPED_MM:
        if not probe:
            return False
        _GROUPED_MM[key] = _probe_grouped_mm(torch.device(device.type, index), dtype)
    return _GROUPED_MM[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    a = torch.ones(4, 16, dtype=dtype, device=device)
    b = torch.ones(2, 16, 16, dtype=dtype, device=device)
    offsets = torch.tensor([1, 4], dtype=torch.int32, device=device)
    if device.type != "cuda":
        try:
            out = torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        return bool((out == 16).all())
    # Captured, so a path that reads the offsets on the host fails here rather than mid-capture later. A
    # failed capture can end before torch restores the caller's stream: restore it here.
    caller_stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.device(device):
            torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
            graph = torch.cuda.CUDAGraph()
            with warnings.catch_warnings():
                # A refused capture ends as an empty graph, which torch warns about before we return False.
                warnings.simplefilter("ignore", UserWarning)
                with torch.cuda.graph(graph):
                    out = torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
            graph.replay()
            return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    finally:
        torch.cuda.set_stream(caller_stream)


class MoE(nn.Module):
    """Routed experts plus (optionally) always-on shared experts; x [T, hidden] -> [T, hidden]. Under tensor
    parallelism the router runs whole on every rank, the experts on their slices, and the routed and shared
    partial sums share one all-reduce."""

    def __init__(self, cfg: DeepseekConfig, tp: Group = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.mlp_bias,
                                   tp, reduce=False) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce_(out)
