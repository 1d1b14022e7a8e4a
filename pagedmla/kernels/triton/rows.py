"""Row moves whose addresses come from index tensors: latent rows stored into and gathered from the paged
cache by slot, and a step's request rows of the block table gathered by request slot.

Each guards its indices on the device (``pagedmla.errors``): a store to a slot outside the cache is
skipped, a gather from one yields a NaN row, a request slot outside the table yields page-0 rows and a
length of -1 (which the attention kernels turn into NaN rows); each sets its error bit. One launch each,
no host synchronisation, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla import errors
from pagedmla.kernels.triton.common import report
from pagedmla.kernels.triton.launch import BoundLaunch, CachedKernel, current_stream

_ROWS = 16  # rows per program: 16 x 576 x 2 bytes = 18 KB in flight


@triton.jit
def _store_rows_kernel(buf_ptr, slots_ptr, rows_ptr, err_ptr, n, num_slots, stride_buf, stride_rows,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, ERR: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n
    slot = tl.load(slots_ptr + r, mask=live, other=0)
    ok = live & (slot >= 0) & (slot < num_slots)
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(rows_ptr + r.to(tl.int64)[:, None] * stride_rows + cols[None, :],
                mask=live[:, None] & (cols[None, :] < D))
    tl.store(buf_ptr + slot[:, None] * stride_buf + cols[None, :], x.to(buf_ptr.dtype.element_ty),
             mask=ok[:, None] & (cols[None, :] < D))
    report(err_ptr, tl.where(tl.max((live & ~ok).to(tl.int32), 0) > 0, ERR, 0))


@triton.jit
def _gather_rows_kernel(buf_ptr, slots_ptr, out_ptr, err_ptr, n, num_slots, stride_buf, stride_out,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, ERR: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n
    slot = tl.load(slots_ptr + r, mask=live, other=0)
    ok = (slot >= 0) & (slot < num_slots)
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(buf_ptr + tl.where(ok, slot, 0)[:, None] * stride_buf + cols[None, :],
                mask=(live & ok)[:, None] & (cols[None, :] < D), other=float("nan"))
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + cols[None, :], x,
             mask=live[:, None] & (cols[None, :] < D))
    report(err_ptr, tl.where(tl.max((live & ~ok).to(tl.int32), 0) > 0, ERR, 0))


@triton.jit
def _select_requests_kernel(table_ptr, index_ptr, lens_ptr, out_table_ptr, out_lens_ptr, err_ptr, n, rows, width,
                            stride_table, stride_out, BLOCK_W: tl.constexpr, ERR: tl.constexpr):
    i = tl.program_id(0)
    idx = tl.load(index_ptr + i).to(tl.int64)
    ok = (idx >= 0) & (idx < rows)
    cols = tl.arange(0, BLOCK_W)
    for c in range(0, width, BLOCK_W):
        m = c + cols < width
        pages = tl.load(table_ptr + tl.where(ok, idx, 0) * stride_table + c + cols, mask=m & ok, other=0)
        tl.store(out_table_ptr + i * stride_out + c + cols, pages, mask=m)
    tl.store(out_lens_ptr + i, tl.where(ok, tl.load(lens_ptr + i), -1))
    report(err_ptr, tl.where(ok, 0, ERR))


_STORE = CachedKernel(_store_rows_kernel)
_GATHER = CachedKernel(_gather_rows_kernel)
_SELECT = CachedKernel(_select_requests_kernel)


# Bound launches of the store per call shape (the backend stores one layer's rows per call, every layer of
# every step): False where binding does not apply.
_store_plans: dict[tuple, BoundLaunch | bool] = {}


def store_rows(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, err_bit: int = errors.CACHE_SLOT) -> None:
    """buf[slots[i]] = rows[i] (cast to buf's dtype) for buf [num_slots, D], slots int [n], rows [n, D]
    (unit last strides); rows whose slot is outside 0 .. num_slots - 1 are skipped and set ``err_bit``."""
    n, d = rows.shape
    if n == 0:
        return
    dev = buf.device
    err = errors.error_word(dev)
    grid = (-(-n // _ROWS), 1, 1)
    key = (buf.shape, buf.stride(), buf.dtype, rows.shape, rows.stride(), rows.dtype, slots.dtype, dev, err_bit)
    plan = _store_plans.get(key)
    if plan:
        ptrs = (buf.data_ptr(), slots.data_ptr(), rows.data_ptr(), err.data_ptr())
        if not (ptrs[0] | ptrs[1] | ptrs[2]) & 15:  # the alignment the kernel was compiled for
            plan.launch(grid, current_stream(dev.index), ptrs)
            return
    args = (buf, slots, rows, err, n, buf.shape[0], buf.stride(0), rows.stride(0))
    options = dict(D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=_ROWS, ERR=err_bit, num_warps=4)
    if plan is None and dev.type == "cuda":
        if len(_store_plans) > 1024:
            _store_plans.clear()
        _store_plans[key] = _STORE.bind(dev, grid, *args, **options) or False
    _STORE.launch(dev, grid, *args, **options)


def gather_rows(buf: torch.Tensor, slots: torch.Tensor, err_bit: int = errors.CACHE_SLOT) -> torch.Tensor:
    """buf[slots] as a new [n, D] tensor (buf [num_slots, D], slots int [n]); a slot outside the buffer
    gives a NaN row and sets ``err_bit``."""
    n, d = slots.shape[0], buf.shape[1]
    out = torch.empty(n, d, dtype=buf.dtype, device=buf.device)
    if n:
        _GATHER.launch(buf.device, (-(-n // _ROWS),), buf, slots, out, errors.error_word(buf.device), n, buf.shape[0],
                       buf.stride(0), out.stride(0), D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=_ROWS, ERR=err_bit,
                       num_warps=4)
    return out


def select_requests(table: torch.Tensor, index: torch.Tensor, lens: torch.Tensor, out_table: torch.Tensor,
                    out_lens: torch.Tensor, err_bit: int = errors.REQUEST_SLOT) -> None:
    """out_table[i] = table[index[i], :width] and out_lens[i] = lens[i] (width = out_table's columns), or
    page-0 rows and length -1 where index[i] is outside the table's rows (setting ``err_bit``): table int32
    [rows, >= width], index int [n], lens int32 [n], out_table int32 [n, width], out_lens int32 [n]."""
    n, width = out_table.shape
    if n == 0:
        return
    _SELECT.launch(table.device, (n,), table, index, lens, out_table, out_lens, errors.error_word(table.device), n,
                   table.shape[0], width, table.stride(0), out_table.stride(0),
                   BLOCK_W=min(1024, triton.next_power_of_2(max(width, 16))), ERR=err_bit, num_warps=4)
