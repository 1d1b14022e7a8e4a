"""Dense SwiGLU MLP (the dense layers and the shared experts), its intermediate features split over the
tensor-parallel group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedmla.model.parallel import ColumnParallelLinear, RowParallelLinear
from pagedmla.parallel import SINGLE, Group


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x [T, hidden] -> [T, hidden]. Under tensor parallelism each rank runs
    its slice of the intermediate features; ``reduce=False`` leaves the output a partial sum over the
    group (for a caller that adds it to another before one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: Group = SINGLE,
                 reduce: bool = True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
