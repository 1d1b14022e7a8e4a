"""Split-KV schedule for paged decode: balance (request, KV block) work across the SMs, on the device.

The work of a batch is laid on one line of "units": request b costs ``overhead_blocks(rows)`` units (its
q load, output write and combine share) followed by one unit per ``BLOCK_N``-token KV block. The line is
cut into ``num_sm_parts`` pieces of ``per_part`` units (equal, or longer in the default plan: see
``PIECE_COST_RATIO``; trailing parts past the line are idle); part p processes the blocks whose units fall
into its piece. A request whose blocks all fall into one part is written directly; one spread over several
parts ("split") writes fp32 partial results that the combine kernel merges. Everything is computed on the
device (no host synchronisation), so the call can be captured in a CUDA graph: on CUDA by one Triton
launch (``kernels/triton/schedule.py``), elsewhere with the tensor ops below.

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

from pagedmla.ops import library

BLOCK_N = 64
BLOCK_M = 64
# Up to 32 query rows per request (q_len x heads) the portable decode kernel runs one 16- or 32-row tile
# per request slice, small enough (4 warps, ~56-113 KB of shared memory) for two programs per SM; above it,
# 64-row tiles, one per SM. (16-row tiles for 32-64 rows ran 1.2-2x slower on the H200, and 32-row tiles
# two per SM beat one 8-warp 32-row tile per SM by 5-9%: benchmarks/NOTES.md.) On sm_90 the Hopper kernel
# takes every request of more than 16 rows in 64-row tiles, one per SM (it beat the 32-row tile by 30%).
SMALL_TILE_ROWS = 32
HOPPER_MIN_ROWS = 17
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
# k = sqrt(n / 10). It binds when total units / parts < sqrt(n / 10): small batches, or one long request at
# 16 rows (264 parts); every batch-128 cell of the benchmark has longer parts.
PIECE_COST_RATIO = 10
METADATA_WIDTH = 8
# Row 0's columns holding the fingerprint, and the three odd constants of each of its two hash mixes (of the
# KV block counts and of num_splits plus the part count): a multiply-xorshift per element, summed mod 2**32.
FINGERPRINT_COLUMNS = (5, 6)
BLOCKS_MIX = (0x9E3779B1, 0x85EBCA77, 0x2C1B3C6D)
SPLITS_MIX = (0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)
_M32 = 0xFFFFFFFF


def tile_plan(rows: int, hopper: bool = False) -> tuple[int, int]:
    """(rows per tile, programs per SM) the decode kernels use for ``rows`` query rows per request;
    ``hopper``: the Hopper kernel is available (``hopper_decode_available``)."""
    if hopper and rows >= HOPPER_MIN_ROWS:
        return BLOCK_M, 1
    if rows <= SMALL_TILE_ROWS:
        return (16 if rows <= 16 else 32), 2
    return BLOCK_M, 1


def hopper_decode_available(device: torch.device) -> bool:
    """Whether ``device`` runs the Hopper (sm_90) decode kernel: an sm_90 GPU and Triton's Gluon."""
    from pagedmla.kernels.triton.decode_sm90 import hopper_available  # late: the kernels import this module

    return hopper_available(device)


def overhead_blocks(num_q_tokens_per_head_k: int) -> int:
    """The scheduler's fixed cost of one request, in KV blocks, for requests of this many query rows."""
    return OVERHEAD_BLOCKS_SMALL if num_q_tokens_per_head_k <= SMALL_TILE_ROWS else OVERHEAD_BLOCKS


def num_sm_parts_for(device: torch.device, num_q_tokens_per_head_k: int, num_heads_k: int) -> int:
    """How many parts the batch is cut into: the programs that fit on the GPU at once (SMs times programs
    per SM), divided by the row tiles each part launches. On sm_90 the plan assumes the Hopper kernel for
    more than 16 rows; calls it cannot take (fp32, pages not a multiple of 64) run the portable kernel
    with that part count: correct, with half the small tiles' two-per-SM slots unused."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 8
    tile_m, per_sm = tile_plan(num_q_tokens_per_head_k, hopper_decode_available(device))
    m_tiles = -(-num_q_tokens_per_head_k // tile_m)
    return max(1, sms * per_sm // max(1, num_heads_k) // max(1, m_tiles))


def get_mla_metadata(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
    *,
    num_sm_parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's scheduling call: returns (tile_scheduler_metadata, num_splits), both int32 on the device.

    cache_seqlens: int32 [bs] KV lengths (this step's tokens included);
    num_q_tokens_per_head_k: q_len * num_heads_q // num_heads_k; num_heads_k: KV heads (1 for MLA).
    The default cuts the work into ``num_sm_parts_for`` parts, each at least ``min_part_units`` long (a small
    batch leaves the last parts idle); ``num_sm_parts`` cuts it into exactly that many equal parts instead
    (FlashMLA's rule; tests use it to force splits on small problems). No host synchronisation: safe to
    call while capturing a CUDA graph (during a capture the tensor-op version runs, so that a first call
    never has to compile and load the Triton kernel inside it).
    """
    if torch.compiler.is_dynamo_compiling():
        return library.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens: expected an int32 1-D tensor, got {cache_seqlens.dtype} "
                         f"shape {tuple(cache_seqlens.shape)}")
    for name, value in (("num_q_tokens_per_head_k", num_q_tokens_per_head_k), ("num_heads_k", num_heads_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    dev = cache_seqlens.device
    parts = num_sm_parts if num_sm_parts is not None else num_sm_parts_for(dev, num_q_tokens_per_head_k, num_heads_k)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"num_sm_parts: expected a positive int, got {parts!r}")
    bs = cache_seqlens.shape[0]
    metadata = torch.empty(parts, METADATA_WIDTH, dtype=torch.int32, device=dev)
    num_splits = torch.empty(bs + 1, dtype=torch.int32, device=dev)
    _fill(cache_seqlens, metadata, num_splits, overhead_blocks(num_q_tokens_per_head_k), num_sm_parts is None)
    return metadata, num_splits


def schedule_into(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor,
                  num_q_tokens_per_head_k: int, default_plan: bool = False) -> None:
    """``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, 1, num_sm_parts=metadata.shape[0])`` into
    given buffers (CUDA-graph state): int32 ``cache_seqlens`` [bs], ``metadata`` int32 [parts,
    METADATA_WIDTH] and ``num_splits`` int32 [bs + 1], all on one device, the buffers contiguous;
    ``default_plan`` gives the default plan's parts instead, at least ``min_part_units`` long (with
    ``metadata.shape[0]`` from ``num_sm_parts_for``, the default ``get_mla_metadata``). No host
    synchronisation."""
    if isinstance(num_q_tokens_per_head_k, bool) or not isinstance(num_q_tokens_per_head_k, int) \
            or num_q_tokens_per_head_k < 1:
        raise ValueError(f"num_q_tokens_per_head_k: expected a positive int, got {num_q_tokens_per_head_k!r}")
    for name, x in (("cache_seqlens", cache_seqlens), ("metadata", metadata), ("num_splits", num_splits)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.device != cache_seqlens.device:
            raise ValueError(f"{name}: expected an int32 tensor on {cache_seqlens.device}")
    bs = cache_seqlens.shape[0] if cache_seqlens.dim() == 1 else -1
    if bs < 0:
        raise ValueError(f"cache_seqlens: expected a 1-D tensor, got shape {tuple(cache_seqlens.shape)}")
    if metadata.dim() != 2 or metadata.shape[1] != METADATA_WIDTH or metadata.shape[0] < 1 \
            or not metadata.is_contiguous():
        raise ValueError(f"metadata: expected a contiguous [parts >= 1, {METADATA_WIDTH}] tensor, "
                         f"got shape {tuple(metadata.shape)}")
    if num_splits.shape != (bs + 1,) or not num_splits.is_contiguous():
        raise ValueError(f"num_splits: expected a contiguous [{bs + 1}] tensor, got shape {tuple(num_splits.shape)}")
    _fill(cache_seqlens, metadata, num_splits, overhead_blocks(num_q_tokens_per_head_k), bool(default_plan))


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



def _fill(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor, overhead: int,
          default_plan: bool) -> None:
    """The schedule into checked buffers, ``overhead`` units per request, parts at least
    ``min_part_units`` long when ``default_plan`` (the last parts stay idle when that leaves them nothing):
    on CUDA one Triton launch (``kernels/triton/schedule.py``) except while a CUDA graph is being captured,
    elsewhere (and then) the same arithmetic in tensor ops."""
    bs, parts = cache_seqlens.shape[0], metadata.shape[0]
    if bs == 0:
        metadata.zero_()
        metadata[:, 2].fill_(-1)
        num_splits.zero_()
        _store_fingerprint(metadata, cache_seqlens.to(torch.int64), num_splits)
        return
    if cache_seqlens.is_cuda and not torch.cuda.is_current_stream_capturing():
        from pagedmla.kernels.triton.schedule import schedule_into as launch  # late: that module imports this one

        launch(cache_seqlens.contiguous(), metadata, num_splits, overhead, default_plan)
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
