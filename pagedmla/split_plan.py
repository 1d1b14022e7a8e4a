"""The split-KV plan of paged decode: balance (request, KV block) work across the SMs, on the device.

The work of a batch is laid on one line of "units": request b costs ``overhead_blocks(rows)`` units (its
q load, output write and combine share) followed by one unit per ``BLOCK_N``-token KV block. The line is
cut into ``num_sm_parts`` pieces of ``per_part`` units (equal, or longer in the default plan: see
``PIECE_COST_RATIO``; trailing parts past the line are idle); part p processes the blocks whose units fall
into its piece. A request whose blocks all fall into one part is written directly; one spread over several
parts ("split") writes fp32 partial results that the combine kernel merges. Everything is computed on the
device (no host synchronisation), so the call can be captured in a CUDA graph: on CUDA by one Triton
launch (``kernels/triton/metadata.py``), elsewhere with the tensor ops below (``plan_into``). The public
calls that fill it (``get_mla_metadata``, ``schedule_into``) are in ``pagedmla/ops/schedule.py``.

A leaf module (torch and ``pagedmla.device`` only): the decode kernels read its constants, the public ops
call it.

Metadata row of part p (int32 [num_sm_parts, METADATA_WIDTH]):
  0 begin_req, 1 begin_block, 2 end_req (inclusive), 3 end_block (exclusive, within end_req),
  4 split index of begin_req's piece, 5-7 zero, except in row 0: 5 and 6 hold the schedule's fingerprint
  (``fingerprint``), with which the decode kernels check, without a host synchronisation, that the
  metadata and ``num_splits`` they are given were made for the lengths they are given.
An idle part has begin_req > end_req. ``num_splits`` (int32 [bs + 1]) is the cumulative count of pieces
per request; request b's partials live at rows num_splits[b] .. num_splits[b+1]-1 of the partial buffer.
A request with no KV has 0 pieces.
"""

from __future__ import annotations

import torch

from pagedmla.device import sm90_available, sm_count

BLOCK_N = 64
BLOCK_M = 64
# Up to 32 query rows per request (q_len x heads) the portable decode kernel runs one 16- or 32-row tile
# per request slice, small enough (4 warps, ~56-113 KB of shared memory) for two programs per SM; above it,
# 64-row tiles, one per SM. (16-row tiles for 32-64 rows ran 1.2-2x slower on the H200, and 32-row tiles
# two per SM beat one 8-warp 32-row tile per SM by 5-9%: benchmarks/NOTES.md.) On sm_90 the Hopper kernels
# take every request of more than 16 rows in 64-row tiles, one per SM (they beat the 32-row tile by 30%),
# and the rows of NARROW_ROWS in their narrow form.
SMALL_TILE_ROWS = 32
SM90_MIN_ROWS = 17
# The query rows per request (first, last) that the Hopper kernels run in their narrow (transposed) form,
# S^T = K Q^T over a 16- or 32-row Q tile, one program per SM, per cache format (None: a 16-bit cache).
# Measured on an H100 against the 64-row tiles (17-32 rows) and the portable kernel's two 16-row programs
# per SM (benchmarks/NOTES.md, "The narrow form"): faster on every such bf16 and fp8_ds_mla cell and on
# fp8_e4m3 from 17 rows; slower on fp8_e4m3 up to 16 rows, which keeps the portable kernel. Read at each
# call, so that a benchmark can time either choice.
NARROW_ROWS: dict[str | None, tuple[int, int]] = {None: (1, 32), "fp8_e4m3": (17, 32), "fp8_ds_mla": (1, 32)}
# A request's fixed cost in KV blocks. Measured on the H200 with per-part timestamps (benchmarks/NOTES.md,
# v12): a piece (q load, finish, result write) costs about 2 KV blocks of time for tiles of up to 32 valid
# rows and 3 for more; FlashMLA's 5 left the parts that start several requests ending 10-20% early.
OVERHEAD_BLOCKS_SMALL = 2
OVERHEAD_BLOCKS = 3
# The default plan's parts are at least ceil(sqrt(n / PIECE_COST_RATIO)) units long, n the longest request's
# KV blocks. A small batch over many parts would give each part a block or two: every part keeps its fixed
# cost, and a request cut into p pieces ends with a combine whose merge loop runs p times, each pass about a
# tenth of a KV block's time (measured on the H200 at 128 heads, benchmarks/NOTES.md v15: 1.0 us per block
# per part, 0.1 us per piece). A part of k blocks and n / k pieces cost about k + n / (10 k): least at
# k = sqrt(n / 10). It binds when total units / parts < sqrt(n / 10): small batches, or one long request in
# many parts; every batch-128 cell of the benchmark has longer parts.
PIECE_COST_RATIO = 10
METADATA_WIDTH = 8
# Row 0's columns holding the fingerprint, and the three odd constants of each of its two hash mixes (of the
# KV block counts and of num_splits plus the part count): a multiply-xorshift per element, summed mod 2**32.
FINGERPRINT_COLUMNS = (5, 6)
BLOCKS_MIX = (0x9E3779B1, 0x85EBCA77, 0x2C1B3C6D)
SPLITS_MIX = (0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)
_M32 = 0xFFFFFFFF


def narrow_block(rows: int, kv_format: str | None = None) -> int | None:
    """The Hopper kernels' narrow Q tile (16 or 32 rows) for requests of ``rows`` query rows on a cache of
    ``kv_format`` (None: 16-bit), or None outside ``NARROW_ROWS[kv_format]``."""
    first, last = NARROW_ROWS[kv_format]
    if not first <= rows <= min(last, SMALL_TILE_ROWS):
        return None
    return 16 if rows <= 16 else 32


def tile_plan(rows: int, sm90: bool = False, kv_format: str | None = None) -> tuple[int, int]:
    """(rows per tile, programs per SM) the decode kernels use for ``rows`` query rows per request on a cache
    of ``kv_format`` (None: 16-bit); ``sm90``: the Hopper kernels are available
    (``pagedmla.device.sm90_available``)."""
    if sm90:
        narrow = narrow_block(rows, kv_format)
        if narrow is not None:
            return narrow, 1
        if rows >= SM90_MIN_ROWS:
            return BLOCK_M, 1
    if rows <= SMALL_TILE_ROWS:
        return (16 if rows <= 16 else 32), 2
    return BLOCK_M, 1


def overhead_blocks(num_q_tokens_per_head_k: int) -> int:
    """The scheduler's fixed cost of one request, in KV blocks, for requests of this many query rows."""
    return OVERHEAD_BLOCKS_SMALL if num_q_tokens_per_head_k <= SMALL_TILE_ROWS else OVERHEAD_BLOCKS


def num_sm_parts_for(device: torch.device, num_q_tokens_per_head_k: int, num_heads_k: int,
                     kv_format: str | None = None) -> int:
    """How many parts the batch is cut into: the programs that fit on the GPU at once (SMs times programs
    per SM), divided by the row tiles each part launches, for a cache of ``kv_format`` (None: 16-bit; FP8
    formats plan as ``tile_plan`` says). On sm_90 the plan assumes the Hopper kernels wherever they take
    these rows; calls they cannot take (fp32, pages not a multiple of 64) run the portable kernel with that
    part count: correct, with half the small tiles' two-per-SM slots unused."""
    sms = sm_count(device) if device.type == "cuda" else 8
    tile_m, per_sm = tile_plan(num_q_tokens_per_head_k, sm90_available(device), kv_format)
    m_tiles = -(-num_q_tokens_per_head_k // tile_m)
    return max(1, sms * per_sm // max(1, num_heads_k) // max(1, m_tiles))


def min_part_units(max_blocks: torch.Tensor) -> torch.Tensor:
    """ceil(sqrt(max_blocks / PIECE_COST_RATIO)), at least 1, exactly in integers (int64 tensor in and out):
    the default plan's shortest part for a batch whose longest request has ``max_blocks`` KV blocks."""
    k = torch.ceil(torch.sqrt(max_blocks.double() / PIECE_COST_RATIO)).long()
    k = torch.where((k - 1) * (k - 1) * PIECE_COST_RATIO >= max_blocks, k - 1, k)
    k = torch.where(k * k * PIECE_COST_RATIO < max_blocks, k + 1, k)
    return k.clamp(min=1)


def _mix(x, i, c: tuple[int, int, int]):
    """One element's hash, values < 2**32 (int64 tensors or Python ints; the kernels' ``mix`` is the same)."""
    v = (x * c[0] + (i + 1) * c[1]) & _M32
    v = v ^ (v >> 15)
    v = (v * c[2]) & _M32
    return v ^ (v >> 13)


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """A value in 0 .. 2**32 - 1 (int64) as the int32 with the same bits."""
    v = v & _M32
    return (v - (v >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32)


def fingerprint(blocks: torch.Tensor, num_splits: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two int32 words a schedule stores in metadata row 0 (``FINGERPRINT_COLUMNS``): hashes of the
    requests' KV block counts (int64 [bs]) and of ``num_splits`` (int [bs + 1]) with the part count."""
    bs = blocks.shape[0]
    idx = torch.arange(bs + 1, device=blocks.device, dtype=torch.int64)
    f_blocks = _mix(blocks.to(torch.int64), idx[:bs], BLOCKS_MIX).sum()
    # The part count's term is a host integer (the same arithmetic on Python ints).
    f_splits = _mix(num_splits.to(torch.int64), idx, SPLITS_MIX).sum() + _mix(parts, bs + 1, SPLITS_MIX)
    return _as_int32(f_blocks), _as_int32(f_splits)



def plan_into(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor, overhead: int,
              default_plan: bool) -> None:
    """The plan in tensor ops into checked buffers (``ops.schedule.schedule_into`` documents them),
    ``overhead`` units per request, parts at least ``min_part_units`` long when ``default_plan`` (the last
    parts stay idle when that leaves them nothing). ``kernels/triton/metadata.py`` is the same arithmetic
    as one launch."""
    bs, parts = cache_seqlens.shape[0], metadata.shape[0]
    if bs == 0:
        metadata.zero_()
        metadata[:, 2].fill_(-1)
        num_splits.zero_()
        _store_fingerprint(metadata, cache_seqlens.to(torch.int64), num_splits)
        return
    dev = cache_seqlens.device
    n = (cache_seqlens.to(torch.int64).clamp(min=0) + BLOCK_N - 1) // BLOCK_N
    unit_end = torch.cumsum(n + overhead, 0)  # end of request b's units (exclusive)
    first = unit_end - n  # unit of request b's first KV block
    per_part = torch.clamp((unit_end[-1] + parts - 1) // parts, min=1)
    if default_plan:
        per_part = torch.maximum(per_part, min_part_units(n.max()))
    lo = torch.arange(parts, device=dev, dtype=torch.int64) * per_part
    hi = lo + per_part
    begin_req = torch.searchsorted(unit_end, lo, right=True)
    end_req = torch.searchsorted(first, hi, right=False) - 1
    b_idx = begin_req.clamp(max=bs - 1)
    e_idx = end_req.clamp(min=0)
    begin_block = torch.clamp(lo - first[b_idx], min=0)
    end_block = torch.minimum(n[e_idx], torch.clamp(hi - first[e_idx], min=0))
    first_part = first // per_part
    begin_split = torch.clamp(torch.arange(parts, device=dev) - first_part[b_idx], min=0)
    pieces = torch.where(n > 0, (first + n - 1) // per_part - first_part + 1, torch.zeros_like(n))
    metadata.zero_()
    metadata[:, 0] = begin_req.to(torch.int32)
    metadata[:, 1] = begin_block.to(torch.int32)
    metadata[:, 2] = end_req.to(torch.int32)
    metadata[:, 3] = end_block.to(torch.int32)
    metadata[:, 4] = begin_split.to(torch.int32)
    # fill_ / copy_ rather than item assignment: a Python scalar would be a host-to-device copy, which a
    # CUDA-graph capture rejects.
    num_splits[:1].zero_()
    num_splits[1:].copy_(torch.cumsum(pieces, 0))
    _store_fingerprint(metadata, n, num_splits)


def _store_fingerprint(metadata: torch.Tensor, blocks: torch.Tensor, num_splits: torch.Tensor) -> None:
    f_blocks, f_splits = fingerprint(blocks, num_splits, metadata.shape[0])
    metadata[0, FINGERPRINT_COLUMNS[0]].copy_(f_blocks)
    metadata[0, FINGERPRINT_COLUMNS[1]].copy_(f_splits)
