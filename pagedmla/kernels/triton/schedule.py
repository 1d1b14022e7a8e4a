"""The decode schedule (``get_mla_metadata``) as one Triton launch.

Same arithmetic as the tensor-op version in ``pagedmla/ops/schedule.py`` (which documents the metadata
and runs off CUDA): that version is ~25 small torch ops, half a millisecond of host time per decode step
on the H200 machine's CPU; this is one launch. Program p writes metadata row p; program 0 also writes
``num_splits``. Each program walks the lengths in ``CHUNK``-request blocks three times (total units and
the longest request, then its part's first and last request, then those requests' first unit and block
count; program 0 a fourth time for ``num_splits``): a few microseconds of GPU time for thousands of
requests, no host synchronisation, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.ops.providers import triton_interpreting
from pagedmla.ops.schedule import BLOCK_N, METADATA_WIDTH, PIECE_COST_RATIO

# Under the interpreter (CPU tests) small chunks exercise the multi-chunk walk on small batches.
CHUNK = 32 if triton_interpreting() else 1024


@triton.jit
def _chunk(seqlens_ptr, c, bs, carry, BLOCK: tl.constexpr, OVERHEAD: tl.constexpr, CHUNK: tl.constexpr):
    """Requests b = c .. c + CHUNK - 1: (b, KV blocks n, end of b's units, b's first block unit), with
    ``carry`` the units of the requests before c; past the batch n = 0 and the units stop growing."""
    b = c + tl.arange(0, CHUNK)
    length = tl.load(seqlens_ptr + b, mask=b < bs, other=0).to(tl.int64)
    n = (tl.maximum(length, 0) + BLOCK - 1) // BLOCK
    unit_end = carry + tl.cumsum(tl.where(b < bs, n + OVERHEAD, 0), 0)
    return b, n, unit_end, unit_end - n


@triton.jit
def _schedule_kernel(seqlens_ptr, meta_ptr, splits_ptr, bs, parts,
                     BLOCK: tl.constexpr, OVERHEAD: tl.constexpr, META_W: tl.constexpr, CHUNK: tl.constexpr,
                     DEFAULT_PLAN: tl.constexpr, RATIO: tl.constexpr):
    p = tl.program_id(0)
    total = tl.zeros([], dtype=tl.int64)
    n_max = tl.zeros([], dtype=tl.int64)
    for c in range(0, bs, CHUNK):
        _, n, unit_end, _ = _chunk(seqlens_ptr, c, bs, total, BLOCK, OVERHEAD, CHUNK)
        total = tl.max(unit_end, 0)
        n_max = tl.maximum(n_max, tl.max(n, 0))
    per_part = tl.maximum((total + parts - 1) // parts, 1)
    if DEFAULT_PLAN:  # ops.schedule.min_part_units's integer steps (k < 1 only when per_part >= 1 wins)
        k = tl.ceil(tl.sqrt(n_max.to(tl.float64) / RATIO)).to(tl.int64)
        k = tl.where((k - 1) * (k - 1) * RATIO >= n_max, k - 1, k)
        k = tl.where(k * k * RATIO < n_max, k + 1, k)
        per_part = tl.maximum(per_part, k)
    lo = p.to(tl.int64) * per_part
    hi = lo + per_part
    # begin_req: requests whose units all end at or before lo; end_req: the last request starting before hi
    # (searchsorted on the strictly increasing unit_end / first arrays, as the tensor version does).
    begin_req = tl.zeros([], dtype=tl.int64)
    starts_before_hi = tl.zeros([], dtype=tl.int64)
    carry = tl.zeros([], dtype=tl.int64)
    for c in range(0, bs, CHUNK):
        b, n, unit_end, first = _chunk(seqlens_ptr, c, bs, carry, BLOCK, OVERHEAD, CHUNK)
        begin_req += tl.sum(((unit_end <= lo) & (b < bs)).to(tl.int64), 0)
        starts_before_hi += tl.sum(((first < hi) & (b < bs)).to(tl.int64), 0)
        carry = tl.max(unit_end, 0)
    end_req = starts_before_hi - 1
    b_idx = tl.minimum(begin_req, bs - 1)
    e_idx = tl.maximum(end_req, 0)
    first_b = tl.zeros([], dtype=tl.int64)
    first_e = tl.zeros([], dtype=tl.int64)
    n_e = tl.zeros([], dtype=tl.int64)
    carry = tl.zeros([], dtype=tl.int64)
    for c in range(0, bs, CHUNK):
        b, n, unit_end, first = _chunk(seqlens_ptr, c, bs, carry, BLOCK, OVERHEAD, CHUNK)
        first_b += tl.sum(tl.where(b == b_idx, first, 0), 0)
        first_e += tl.sum(tl.where(b == e_idx, first, 0), 0)
        n_e += tl.sum(tl.where(b == e_idx, n, 0), 0)
        carry = tl.max(unit_end, 0)
    begin_block = tl.maximum(lo - first_b, 0)
    end_block = tl.minimum(n_e, tl.maximum(hi - first_e, 0))
    begin_split = tl.maximum(p - first_b // per_part, 0)
    cols = tl.arange(0, META_W)
    row = tl.where(cols == 0, begin_req, 0)
    row = tl.where(cols == 1, begin_block, row)
    row = tl.where(cols == 2, end_req, row)
    row = tl.where(cols == 3, end_block, row)
    row = tl.where(cols == 4, begin_split, row)
    tl.store(meta_ptr + p * META_W + cols, row.to(tl.int32))
    if p == 0:
        tl.store(splits_ptr, 0)
        carry = tl.zeros([], dtype=tl.int64)
        done = tl.zeros([], dtype=tl.int64)
        for c in range(0, bs, CHUNK):
            b, n, unit_end, first = _chunk(seqlens_ptr, c, bs, carry, BLOCK, OVERHEAD, CHUNK)
            pieces = tl.where(n > 0, (first + n - 1) // per_part - first // per_part + 1, 0)
            counts = done + tl.cumsum(pieces, 0)
            tl.store(splits_ptr + 1 + b, counts.to(tl.int32), mask=b < bs)
            carry = tl.max(unit_end, 0)
            done = tl.max(counts, 0)


_SCHEDULE = CachedKernel(_schedule_kernel)


def schedule_into(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor,
                  overhead: int, default_plan: bool = False) -> None:
    """Write the schedule of ``cache_seqlens`` (int32 [bs], contiguous, bs >= 1) into ``metadata`` (int32
    [parts, METADATA_WIDTH], contiguous) and ``num_splits`` (int32 [bs + 1]), ``overhead`` units per request
    (``ops.schedule.overhead_blocks``), parts at least ``ops.schedule.min_part_units`` long when
    ``default_plan``; checked by the caller."""
    bs, parts = cache_seqlens.shape[0], metadata.shape[0]
    _SCHEDULE.launch(cache_seqlens.device, (parts,), cache_seqlens, metadata, num_splits, bs, parts,
                     BLOCK=BLOCK_N, OVERHEAD=overhead, META_W=METADATA_WIDTH, CHUNK=CHUNK,
                     DEFAULT_PLAN=bool(default_plan), RATIO=PIECE_COST_RATIO, num_warps=4)
