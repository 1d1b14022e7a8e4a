"""Memory-safety instruments for Triton kernels under the CPU interpreter.

``checked_accesses()`` watches every load, store and atomic the interpreter executes: each launch's
tensor arguments (and tensor descriptors' bases) define the byte ranges it may touch, and any masked-on
address outside all of them is recorded (the interpreter itself would read or write arbitrary host
memory). ``guarded(t)`` places a tensor in the middle of a larger buffer whose margins hold a sentinel,
so that a write past either end shows up in ``margins_intact``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

MARGIN = 4096  # elements on each side of a guarded tensor


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    start = t.data_ptr() - sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if s < 0) * t.element_size()
    return start, start + span * t.element_size()


class AccessLog:
    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.violations: list[str] = []
        self.launches = 0

    def check(self, kind: str, ptrs, mask, itemsize: int) -> None:
        addr = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        live = np.ones(addr.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool).reshape(-1)
        addr = addr[live]
        if addr.size == 0:
            return
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in self.ranges:
            inside |= (addr >= lo) & (addr + itemsize <= hi)
        if not inside.all():
            bad = addr[~inside]
            self.violations.append(f"{kind} of {bad.size} element(s) outside the launch's tensors, e.g. at "
                                   f"{int(bad[0]):#x} (ranges {[(hex(a), hex(b)) for a, b in self.ranges]})")


@contextlib.contextmanager
def checked_accesses() -> Iterator[AccessLog]:
    """Record every interpreter memory access outside the current launch's tensor arguments."""
    from triton.runtime import interpreter as it
    from triton.tools.tensor_descriptor import TensorDescriptor

    log = AccessLog()
    builder = it.InterpreterBuilder
    originals = {name: getattr(builder, name) for name in
                 ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    init_args = it.GridExecutor._init_args_hst

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges = []
        for a in list(args_hst) + list(kwargs_hst.values()):
            base = a.base if isinstance(a, TensorDescriptor) else a
            if isinstance(base, torch.Tensor):
                e = _extent(base)
                if e is not None:
                    ranges.append(e)
        log.ranges = ranges
        log.launches += 1
        return args_hst, kwargs_hst

    def masked_load(self, ptrs, mask, other, *args):
        log.check("load", ptrs.data, mask.data, np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return originals["create_masked_load"](self, ptrs, mask, other, *args)

    def masked_store(self, ptrs, value, mask, *args):
        log.check("store", ptrs.data, mask.data, value.data.dtype.itemsize)
        return originals["create_masked_store"](self, ptrs, value, mask, *args)

    def atomic_rmw(self, op, ptr, val, mask, *args):
        log.check("atomic", ptr.data, mask.data, val.data.dtype.itemsize)
        return originals["create_atomic_rmw"](self, op, ptr, val, mask, *args)

    def atomic_cas(self, ptr, cmp, val, *args):
        log.check("atomic_cas", ptr.data, None, val.data.dtype.itemsize)
        return originals["create_atomic_cas"](self, ptr, cmp, val, *args)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    it.GridExecutor._init_args_hst = init_args_hst
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(builder, name, fn)
        it.GridExecutor._init_args_hst = init_args


def guarded(t: torch.Tensor, sentinel: float | int | None = None) -> torch.Tensor:
    """A copy of ``t`` (contiguous) living inside a buffer with MARGIN sentinel elements on each side."""
    if sentinel is None:
        sentinel = float("nan") if t.is_floating_point() else -77
    buf = torch.full((t.numel() + 2 * MARGIN,), sentinel, dtype=t.dtype, device=t.device)
    view = buf[MARGIN: MARGIN + t.numel()].view(t.shape)
    view.copy_(t)
    view._guard_buffer = buf  # keep the margins alive and findable
    view._guard_sentinel = sentinel
    return view


def margins_intact(*tensors: torch.Tensor) -> bool:
    """Whether every ``guarded`` tensor's margins still hold their sentinel."""
    for t in tensors:
        buf, s = t._guard_buffer, t._guard_sentinel
        margins = torch.cat([buf[:MARGIN], buf[-MARGIN:]])
        same = margins.isnan() if isinstance(s, float) and s != s else margins == s
        if not bool(same.all()):
            return False
    return True
