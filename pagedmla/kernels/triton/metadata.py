"""The split plan's metadata on the device: the plan (``get_mla_metadata``) as one Triton launch, and the
helpers with which the decode kernels read and check it.

Same arithmetic as the tensor-op version in ``pagedmla/split_plan.py`` (which documents the metadata
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

from pagedmla.device import triton_interpreting
from pagedmla.kernels.triton.common import checked_length
from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.split_plan import BLOCK_N, BLOCKS_MIX, FINGERPRINT_COLUMNS, METADATA_WIDTH, PIECE_COST_RATIO, SPLITS_MIX

# Under the interpreter (CPU tests) small chunks exercise the multi-chunk walk on small batches.
CHUNK = 32 if triton_interpreting() else 1024


_B0, _B1, _B2 = (tl.constexpr(c) for c in BLOCKS_MIX)
_S0, _S1, _S2 = (tl.constexpr(c) for c in SPLITS_MIX)
_FP_BLOCKS, _FP_SPLITS = (tl.constexpr(c) for c in FINGERPRINT_COLUMNS)


@triton.jit
def mix(x, i, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):
    """``split_plan._mix`` on int64 values: one element's hash, < 2**32."""
    v = (x * C0 + (i + 1) * C1) & 0xFFFFFFFF
    v = v ^ (v >> 15)
    v = (v * C2) & 0xFFFFFFFF
    return v ^ (v >> 13)


@triton.jit
def blocks_mix(n, b):
    return mix(n, b, _B0, _B1, _B2)


@triton.jit
def splits_mix(s, j):
    return mix(s, j, _S0, _S1, _S2)


@triton.jit
def schedule_matches(seqlens_ptr, meta_ptr, splits_ptr, bs, parts, lanes, BLOCK: tl.constexpr):
    """Whether metadata row 0's fingerprint is that of these lengths' block counts, this ``num_splits`` and
    ``parts`` parts (``split_plan.fingerprint``): metadata and splits made for these lengths by the
    scheduler. Reads the bs lengths and bs + 1 split counts ``lanes`` (an arange, with the caller's layout)
    at a time."""
    CHUNK: tl.constexpr = lanes.shape[0]
    # Scalars by tl.cast (arguments equal to 1 arrive as compile-time ints), not tl.zeros (a Gluon caller
    # would need a layout for it).
    f_blocks = tl.cast(bs, tl.int64) * 0
    f_splits = f_blocks
    for c in range(0, bs + 1, CHUNK):
        j = (c + lanes).to(tl.int64)
        length = tl.load(seqlens_ptr + j, mask=j < bs, other=0).to(tl.int64)
        n = (tl.maximum(length, 0) + BLOCK - 1) // BLOCK
        f_blocks += tl.sum(tl.where(j < bs, blocks_mix(n, j), 0), 0)
        s = tl.load(splits_ptr + j, mask=j <= bs, other=0).to(tl.int64)
        f_splits += tl.sum(tl.where(j <= bs, splits_mix(s, j), 0), 0)
    f_splits += splits_mix(tl.cast(parts, tl.int64), tl.cast(bs, tl.int64) + 1)
    want_blocks = tl.load(meta_ptr + _FP_BLOCKS)
    want_splits = tl.load(meta_ptr + _FP_SPLITS)
    return ((f_blocks & 0xFFFFFFFF).to(tl.int32) == want_blocks) & ((f_splits & 0xFFFFFFFF).to(tl.int32) == want_splits)


@triton.jit
def part_bounds(meta_ptr, part, last_req, META_W: tl.constexpr):
    """Metadata row ``part`` as (begin_req, begin_block, end_req, end_block, begin_split), clamped so that
    whatever the row holds the part's loop stays inside the batch (0 <= begin_req, end_req <= last_req, the
    batch size - 1) and its block and piece numbers are non-negative; ``request_span`` clamps the blocks to
    each request."""
    row = meta_ptr + part * META_W
    return (tl.maximum(tl.load(row + 0), 0), tl.maximum(tl.load(row + 1), 0), tl.minimum(tl.load(row + 2), last_req),
            tl.maximum(tl.load(row + 3), 0), tl.maximum(tl.load(row + 4), 0))


@triton.jit
def request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk, capacity, SCHED_N: tl.constexpr):
    """Request b's slice of a part: (length clamped to 0 .. capacity, first token, end token, error bits of
    its length). capacity = the block-table row's pages x page size, so no token of the slice lies past
    the row; the slice's blocks lie within the clamped length's."""
    seqlen, bits = checked_length(tl.load(seqlens_ptr + b), capacity)
    n = tl.cdiv(seqlen, SCHED_N)
    blk_lo = tl.minimum(tl.where(b == begin_req, begin_blk, 0), n)
    blk_hi = tl.minimum(tl.where(b == end_req, end_blk, n), n)
    return seqlen, blk_lo * SCHED_N, tl.minimum(blk_hi * SCHED_N, seqlen), bits


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
    if DEFAULT_PLAN:  # split_plan.min_part_units's integer steps (k < 1 only when per_part >= 1 wins)
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
    if p == 0:
        tl.store(splits_ptr, 0)
        carry = tl.zeros([], dtype=tl.int64)
        done = tl.zeros([], dtype=tl.int64)
        # The fingerprint (split_plan.fingerprint) of the block counts and of num_splits as stored.
        f_blocks = tl.zeros([], dtype=tl.int64)
        f_splits = splits_mix(tl.zeros([], dtype=tl.int64), tl.zeros([], dtype=tl.int64))
        for c in range(0, bs, CHUNK):
            b, n, unit_end, first = _chunk(seqlens_ptr, c, bs, carry, BLOCK, OVERHEAD, CHUNK)
            pieces = tl.where(n > 0, (first + n - 1) // per_part - first // per_part + 1, 0)
            counts = done + tl.cumsum(pieces, 0)
            tl.store(splits_ptr + 1 + b, counts.to(tl.int32), mask=b < bs)
            f_blocks += tl.sum(tl.where(b < bs, blocks_mix(n, b.to(tl.int64)), 0), 0)
            f_splits += tl.sum(tl.where(b < bs, splits_mix(counts, b.to(tl.int64) + 1), 0), 0)
            carry = tl.max(unit_end, 0)
            done = tl.max(counts, 0)
        f_splits += splits_mix(tl.cast(parts, tl.int64), tl.cast(bs, tl.int64) + 1)
        row = tl.where(cols == _FP_BLOCKS, f_blocks & 0xFFFFFFFF, row)
        row = tl.where(cols == _FP_SPLITS, f_splits & 0xFFFFFFFF, row)
    tl.store(meta_ptr + p * META_W + cols, row.to(tl.int32))


_SCHEDULE = CachedKernel(_schedule_kernel)


def schedule_into(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor,
                  overhead: int, default_plan: bool = False) -> None:
    """Write the schedule of ``cache_seqlens`` (int32 [bs], contiguous, bs >= 1) into ``metadata`` (int32
    [parts, METADATA_WIDTH], contiguous) and ``num_splits`` (int32 [bs + 1]), ``overhead`` units per request
    (``split_plan.overhead_blocks``), parts at least ``split_plan.min_part_units`` long when
    ``default_plan``; checked by the caller."""
    bs, parts = cache_seqlens.shape[0], metadata.shape[0]
    _SCHEDULE.launch(cache_seqlens.device, (parts,), cache_seqlens, metadata, num_splits, bs, parts,
                     BLOCK=BLOCK_N, OVERHEAD=overhead, META_W=METADATA_WIDTH, CHUNK=CHUNK,
                     DEFAULT_PLAN=bool(default_plan), RATIO=PIECE_COST_RATIO, num_warps=4)
