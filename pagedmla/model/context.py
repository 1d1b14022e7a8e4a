"""What one forward step hands every attention layer: the planned backend, the cache, the write slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedmla.backend import MLABackend
from pagedmla.cache import MLAKVCache


@dataclass
class StepContext:
    """backend: planned for this step (``init_forward_metadata`` already called);
    cache: the latent cache; out_cache_loc: int64 [T] slot of each new token's latent row."""

    backend: MLABackend
    cache: MLAKVCache
    out_cache_loc: torch.Tensor
