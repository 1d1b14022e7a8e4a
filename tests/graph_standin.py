"""CPU stand-in for a CUDA graph: replay runs the captured function again into the same output tensors, so
everything but the capture itself (static buffers, padding, the backends' replay planning) runs on the CPU."""

from __future__ import annotations

import torch


class ReRunGraph:
    """``capture(fn)`` runs fn once and keeps its output (a tensor or a tuple of tensors); ``replay`` runs fn
    again and copies its results into that output, as a graph replay refreshes its static outputs."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        new = self.fn()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
            return
        for old, fresh in zip(self.out, new):
            old.copy_(fresh)
