"""Process groups of tensor and decode-context parallelism, and the collectives the model and backend run on them.

A ``Group`` is a ``torch.distributed`` process group together with this process's rank in it and its size;
``SINGLE`` (size 1, no process group) makes every collective the identity, so single-process code runs the
same functions without a process group. The collectives are plain ``torch.distributed`` calls on the
tensors' device (NCCL on CUDA, gloo on CPU): they read nothing back to the host, so they can sit on a step
path and inside a CUDA-graph capture (where NCCL's work joins the capturing stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (output: the inputs concatenated along dim 0).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Group:
    """``group``: the process group (None for ``SINGLE``); ``rank``: this process's rank in it; ``size``: its
    number of ranks."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Group:
        """The Group of ``group`` (None: the default process group) as this process sees it."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's ``x``, in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, ...]: ``x[j]`` goes to rank j; returns [size, ...] whose row j came from rank j."""
        if self.size == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out


SINGLE = Group(None, 0, 1)
