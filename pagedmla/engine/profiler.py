"""Attention profiler: a stand-in for the backend that counts and times the model's attention calls."""

from __future__ import annotations

import time

import torch

from pagedmla.backend import MLABackend


class AttentionProfiler:
    """Wraps a planned MLABackend for the model's layers (``attention_form`` and ``forward``), timing each
    call with a device synchronisation on both sides. Totals accumulate across steps."""

    def __init__(self, backend: MLABackend):
        self.backend = backend
        self.calls = 0
        self.seconds = 0.0

    @property
    def attention_form(self) -> str:
        return self.backend.attention_form

    def _sync(self) -> None:
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        self._sync()
        start = time.perf_counter()
        out = self.backend.forward(*args, **kwargs)
        self._sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out
