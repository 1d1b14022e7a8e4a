"""Tensor-parallel layers: column- and row-parallel linears, vocabulary-parallel embedding and LM head.

Each layer holds this rank's slice of a checkpoint tensor under the checkpoint's own name, and says which
slice (``Shard``), so that loaders and random initialisation fill it from the full tensor's slice. With the
``SINGLE`` group every layer is its plain single-device counterpart (same shapes, same arithmetic).

A block (attention, MLP, MoE) ends in one all-reduce: its row-parallel output projections leave partial
sums (``reduce=False`` where the block adds several before reducing once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedmla.parallel import SINGLE, Group


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a tensor along ``dim``: the dimension holds ``parts`` blocks of ``full``
    entries each (gate | up projections: 2), and rank r of ``size`` takes entries ``r * n .. (r + 1) * n``
    of each block, n = full / size (``DeepseekConfig.check_tensor_parallel`` makes it divide)."""

    dim: int
    full: int
    rank: int
    size: int
    parts: int = 1

    @property
    def local(self) -> int:
        """Entries per block on each rank."""
        return self.full // self.size

    def ranges(self) -> list[tuple[int, int]]:
        """The (start, end) of the full tensor's entries along ``dim`` this rank holds, block by block."""
        start = self.rank * self.local
        return [(p * self.full + start, p * self.full + start + self.local) for p in range(self.parts)]

    def full_shape(self, local_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full * self.parts
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor ``full``."""
        return self.assemble(lambda start, end: full.narrow(self.dim, start, end - start))

    def assemble(self, read: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """This rank's slice from ``read(start, end)``, the full tensor's entries start..end-1 along ``dim``
        (a loader reads just those)."""
        pieces = [read(start, end) for start, end in self.ranges()]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


class ColumnParallelLinear(nn.Linear):
    """y = x W^T (+ b) for this rank's output features: ``out_features`` split over the group, so x [T, in]
    gives this rank's slice [T, out / size] of the full output, with no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: Group = SINGLE):
        super().__init__(in_features, out_features // tp.size, bias=bias)
        self.shards = {name: Shard(0, out_features, tp.rank, tp.size)
                       for name in ("weight", "bias") if name == "weight" or bias}


class RowParallelLinear(nn.Module):
    """y = x W^T + b where x [T, in / size] holds this rank's slice of the input features: each rank computes
    a partial sum [T, out] (rank 0 adds the bias) and ``reduce`` all-reduces it into the full output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: Group = SINGLE,
                 reduce: bool = True):
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = {"weight": Shard(1, in_features, tp.rank, tp.size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce_(y) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split over the group (V / size rows per rank): ids [T] ->
    [T, hidden]; each rank looks up the ids in its range, gives 0 for the others, and an all-reduce sums them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Group = SINGLE):
        super().__init__()
        self.tp = tp
        shard = Shard(0, vocab_size, tp.rank, tp.size)
        self.start = shard.ranges()[0][0]
        self.weight = nn.Parameter(torch.empty(shard.local, hidden_size))
        self.shards = {"weight": shard}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(x)


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary split like ``VocabParallelEmbedding`` (the two may share one weight):
    hidden [n, hidden_size] -> logits [n, vocab] (the weight's dtype): each rank scores its rows and an
    all-gather puts them together in vocabulary order."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: Group = SINGLE):
        super().__init__()
        self.tp = tp
        shard = Shard(0, vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(shard.local, hidden_size))
        self.shards = {"weight": shard}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        parts = self.tp.all_gather(logits)  # [size, n, rows per rank]
        return parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)


def shard_specs(model: nn.Module) -> dict[str, Shard]:
    """Every sharded tensor of ``model`` by its ``state_dict`` name (tensors not listed are whole on each rank)."""
    specs = {}
    for prefix, module in model.named_modules():
        for name, shard in getattr(module, "shards", {}).items():
            specs[f"{prefix}.{name}" if prefix else name] = shard
    return specs
