"""RMSNorm as DeepSeek defines it: normalise in float32, scale in the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); statistics in float32, result in x's dtype.

    x: [..., dim] any float dtype; weight: [dim].
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # The cast happens before the weight multiply, as in the reference implementation.
        return self.weight * h.to(dtype)
