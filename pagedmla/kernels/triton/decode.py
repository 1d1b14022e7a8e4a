"""Split-KV MLA decode over the paged latent cache: a main kernel, a combine kernel and their launcher.

Work layout. The query rows of one request are its (token, head) pairs packed token-major
(row = t * H + h) into BLOCK_M-row tiles: a TP-sharded 16-head decode is one 16-row tile, 128 heads are
two 64-row tiles. The grid is (M tiles, SM parts); part p walks the (request, KV block) range that
``get_mla_metadata`` gave it (pagedmla/split_plan.py documents the metadata) and, for each request in
it, streams the KV blocks once: each [BLOCK_N, 576] tile is the key (all 576 columns) and the value
(its first 512) of the same load. A request covered by one part is normalised and written straight to
``out`` / ``lse``; a request cut across parts writes one partial per piece (normalised output, log2 LSE), and the
combine kernel merges them in float32. The portable kernel writes the values in the output's dtype, the Hopper
kernels in float32 (``common.partials_views``). The combine kernel also writes the empty result (output 0,
LSE -inf) of requests with no KV.

Masking. Blocks that lie wholly before the first masked key (the sequence end, and with ``causal`` the
first key the earliest query row cannot see) run without masks; the last one or two blocks of a range
run masked: the loads past the sequence end are skipped (unused cache slots may hold anything, NaN
included) and masked scores become -inf before the exponential, so no such value reaches the output.

Guards (``pagedmla.errors``). Metadata rows are clamped to the batch, lengths to the block-table row, page
ids to page 0 and piece indices to the partials buffer, so no value sends a load or store outside the
tensors; a request with a bad length or page gets NaN rows. Part 0 also checks the metadata's fingerprint
(``split_plan.fingerprint``: metadata and num_splits made for these lengths) and leaves its verdict at
the end of the partials buffer; without it the combine kernel poisons every request, since a schedule
made for other lengths may skip or repeat any request's keys.

Launch parameters depend only on shapes and the metadata's shape (no host synchronisation), so the
metadata call, the main kernel and the combine kernel can be captured in a CUDA graph. A plan per call
shape (``_DecodePlan``) keeps both launches bound (``launch.BoundLaunch``) after the first call.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagedmla import checks, errors
from pagedmla.device import pdl_available, sm_count
from pagedmla.kernels.triton.common import (
    _LN2,
    BLOCK_TABLE,
    DS_ROPE_OFFSET,
    LOG2E,
    PARTIALS_EVICTION,
    PARTIALS_HEADER,
    SCHEDULE,
    checked_length,
    checked_page,
    finish_rows,
    fp8_cols,
    fp8_nan_fixup,
    fp8_pair_values,
    fp8_values,
    fp16_row_scale,
    kv_format_args,
    kv_format_width,
    partials_views,
    report,
    wait_prior_options,
)
from pagedmla.kernels.triton.launch import CachedKernel, current_stream, unaligned_mask
from pagedmla.kernels.triton.metadata import part_bounds, request_span, schedule_matches
from pagedmla.kernels.triton.sm90 import seesaw
from pagedmla.kernels.triton.sm90.decode import sm90_main_args
from pagedmla.kernels.triton.sm90.decode_fp8 import sm90_fp8_main_args, sm90_fp8_supported
from pagedmla.kernels.triton.sm90.mla import sm90_supported
from pagedmla.kernels.triton.sm90.pipeline import tma_rows
from pagedmla.split_plan import BLOCK_N as SCHED_BLOCK_N
from pagedmla.split_plan import METADATA_WIDTH, SM90_MIN_ROWS, narrow_block, tile_plan


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and pipelining of the main kernel (chosen per call from shapes by ``default_config``).

    block_m: query rows per tile (16, 32 or 64);
    block_n: KV tokens per step (divides the schedule's 64-token block); num_warps, num_stages: Triton's;
    chunks: the value width is processed as this many column chunks (1, 2 or 4), each its own dot
    operand and accumulator, so that no operand spans all 512 columns;
    use_tma: load KV tiles with tensor descriptors (CUDA, pages a multiple of block_n, contiguous cache);
    carry_pages: read the next tile's page id one step ahead (a loop-carried value), so no KV load waits
    on a load of its own step. Compiled for sm_90a with 3 stages, this turns the small tiles' single KV
    buffer with ``cp.async.wait_group 0`` into two buffers with the next tile in flight (benchmarks/NOTES.md
    v5); on the H200 it made 16-row tiles 6-13% and 32-row tiles 14-16% faster;
    use_sm90: run a Hopper Gluon main kernel (64-row tiles, warp-specialised, wgmma) instead: the seesaw one
    (``sm90/seesaw.py``) for requests of at least ``SEESAW_MIN_ROWS`` query rows, ``sm90/decode.py``'s below,
    ``sm90/decode_fp8.py``'s on an FP8 cache; block_m 16 or 32 runs ``sm90/decode.py``'s or
    ``sm90/decode_fp8.py``'s narrow (transposed) form, for requests of at most that many rows; the other
    fields do not apply to them. Without a config, requests of more than 16 query rows use one wherever
    ``sm90_supported`` holds (on an FP8 cache ``sm90_fp8_supported``), and the narrow form takes the rows of
    ``split_plan.NARROW_ROWS``: all up to 32 on a 16-bit or fp8_ds_mla cache, 17-32 on fp8_e4m3 (and its
    requests of up to 16 rows under a schedule of at most one part per SM: ``select_config``).
    """

    block_m: int
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    chunks: int = 1
    use_tma: bool = False
    carry_pages: bool = False
    use_sm90: bool = False

    @property
    def spec(self) -> str:
        """Short name, e.g. ``m16n32w4s2c4`` (+ ``t`` for TMA loads, ``p`` for carried page ids, ``h`` for
        the Hopper kernel)."""
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}c{self.chunks}"
                + ("t" if self.use_tma else "") + ("p" if self.carry_pages else "") + ("h" if self.use_sm90 else ""))

    @classmethod
    def from_spec(cls, spec: str) -> DecodeConfig:
        """The config ``spec`` names (the inverse of ``DecodeConfig.spec``)."""
        m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)c(\d+)(t?)(p?)(h?)", spec)
        if not m:
            raise ValueError(f"spec: expected m<rows>n<block_n>w<warps>s<stages>c<chunks>[t][p][h], got {spec!r}")
        bm, bn, w, st, c, t, p, hop = m.groups()
        return cls(block_m=int(bm), block_n=int(bn), num_warps=int(w), num_stages=int(st), chunks=int(c),
                   use_tma=bool(t), carry_pages=bool(p), use_sm90=bool(hop))


def default_config(rows: int, fp8: bool = False) -> DecodeConfig:
    """Portable-kernel config for ``rows`` = q_len * heads query rows per request (measured on the H200:
    benchmarks/NOTES.md); ``select_config`` picks the Hopper kernel instead where it applies.

    ``tile_plan`` (the schedule's) picks the tile height. Up to 32 rows (memory bound), 16- or 32-row
    tiles: 4 warps, 32-token steps and 4 column chunks keep one program within half an SM, so two share
    each SM (the schedule makes two parts per SM for them); carried page ids and 3 stages give them a
    second KV buffer. More rows: 64-row tiles, 8 warps, 64-token steps, two 256-column chunks, TMA loads
    where the pages allow (page size a multiple of 64); 128 heads or q_len x heads > 64 take several 64-row
    tiles per part, which read the same KV (the later from L2).

    ``fp8``: an FP8 cache. Up to 32 rows its tiles come by TMA where the pages allow (pointer loads feeding
    the conversion were not pipelined: 1.44x faster by TMA on the H200) and as 16-bit words (``fp8_pairs``);
    32- and 64-row tiles take 64-token steps in four 128-column chunks with 8 warps (1.2-1.5x over 32-token
    steps: an FP8 step moves half a bf16 step's bytes), three stages deep (5-13% over two at 32 rows, 10% at
    64), the 64-row ones by pointer loads (TMA gained nothing there for fp8_e4m3 and cost fp8_ds_mla 18-24%:
    benchmarks/NOTES.md, FP8).
    """
    block_m, _ = tile_plan(rows)
    if fp8 and block_m > 16:
        return DecodeConfig(block_m=block_m, block_n=64, num_warps=8, num_stages=3, chunks=4, use_tma=block_m <= 32,
                            carry_pages=True)
    if block_m <= 32:
        return DecodeConfig(block_m=block_m, block_n=32, num_warps=4, num_stages=3, chunks=4, use_tma=fp8,
                            carry_pages=True)
    return DecodeConfig(block_m=block_m, block_n=64, num_warps=8, num_stages=2, chunks=2, use_tma=True,
                        carry_pages=True)


@triton.jit
def _kv_cols(kv_ptr, desc, tok, row, in_seq, col0,
             WIDTH: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, KV_FMT: tl.constexpr,
             ROPE: tl.constexpr, NAN_FIXUP: tl.constexpr):
    """Columns col0 .. col0 + WIDTH - 1 of one KV tile's rows; rows past the sequence end read as 0. FP8 caches
    (KV_FMT > 0) come back as ``common.fp8_cols`` gives them (fp8_e4m3 as fp16, fp8_ds_mla as float32), by TMA
    or pointer loads; ROPE marks the rope columns."""
    if KV_FMT > 0 and USE_TMA:
        # FP8 tiles by TMA (rows 16-byte aligned: 576 / 656 bytes): the loads pipeline as the bf16 ones do,
        # where pointer loads feeding a conversion did not (benchmarks/NOTES.md, FP8). tok holds the rows'
        # byte offsets for fp8_ds_mla's scales.
        if KV_FMT == 2 and ROPE:
            x = desc.load([row, DS_ROPE_OFFSET // 2]).to(tl.float32)
        else:
            x = fp8_values(desc.load([row, col0]), kv_ptr + tok[:, None], col0, in_seq[:, None], KV_FMT, MASKED,
                           NAN_FIXUP)
        if MASKED:
            x = tl.where(in_seq[:, None], x, 0.0)
    elif KV_FMT > 0:
        x = fp8_cols(kv_ptr + tok[:, None], col0, in_seq[:, None], WIDTH, KV_FMT, ROPE, MASKED, NAN_FIXUP)
    elif USE_TMA:
        x = desc.load([row, col0])
        if MASKED:
            # TMA reads whole tiles: zero the rows past the end (0 * NaN would poison P @ V).
            x = tl.where(in_seq[:, None], x, 0.0)
    else:
        ptrs = kv_ptr + tok[:, None] + col0 + tl.arange(0, WIDTH)[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=in_seq[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _kv_pairs(kv_ptr, desc, tok, row, in_seq, word0, WIDTH: tl.constexpr, MASKED: tl.constexpr,
              USE_TMA: tl.constexpr, KV_FMT: tl.constexpr, NAN_FIXUP: tl.constexpr):
    """FP8 latent words word0 .. word0 + WIDTH - 1 (16-bit) of one KV tile's rows as their even- and
    odd-column values (``common.fp8_pair_values``), by TMA (``desc`` over the rows as int16) or pointer
    loads; rows past the sequence end read as 0."""
    rows = kv_ptr + tok[:, None]
    if USE_TMA:
        words = desc.load([row, word0])
    else:
        ptrs = rows.to(tl.pointer_type(tl.int16)) + word0 + tl.arange(0, WIDTH)[None, :]
        if MASKED:
            words = tl.load(ptrs, mask=in_seq[:, None], other=0)
        else:
            words = tl.load(ptrs)
    even, odd = fp8_pair_values(words, rows, word0, in_seq[:, None], KV_FMT, MASKED, NAN_FIXUP)
    if MASKED and USE_TMA:
        # TMA reads whole tiles: zero the rows past the end (0 * NaN would poison P @ V).
        even = tl.where(in_seq[:, None], even, 0.0)
        odd = tl.where(in_seq[:, None], odd, 0.0)
    return even, odd


# How far (log2 units) a row's tile max may exceed the running max in use before the accumulators are rescaled
# to it: P values up to 2^8 (FA4's lazy rescale; benchmarks/NOTES.md decode v31).
RESCALE_SLACK = tl.constexpr(8.0)


@triton.jit
def _rescaled(acc0, acc1, acc2, acc3, m_i, m_tile, NC: tl.constexpr):
    """The accumulator chunks moved to the running max m_new = max(m_i, m_tile): (chunks, m_new, m_new with a
    still -inf max read as 0, the factor exp2(m_i - that)). A row with no visible key yet keeps max -inf:
    subtracting 0 instead makes exp2 give 0, not NaN."""
    m_new = tl.maximum(m_i, m_tile)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    acc0 = acc0 * alpha[:, None]
    if NC >= 2:
        acc1 = acc1 * alpha[:, None]
    if NC == 4:
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
    return acc0, acc1, acc2, acc3, m_new, m_safe, alpha


@triton.jit
def _sum_unfused(a, b):
    """a + b for float32 [M, N] tiles, written as a reduction: Triton folds ``dot(x, y) + b`` into the dot's
    accumulator (one MMA chain after the other), which this keeps two independent chains."""
    return tl.sum(tl.join(a, b), 2)


@triton.jit
def _attend_tile(
    acc0, acc1, acc2, acc3, m_i, l_i, q0, q1, q2, q3, q_pe,
    kv_ptr, desc, desc_pe, bt_row, n0, seqlen, lim, stride_page, stride_tok, qk_scale, page_id, num_pages,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DC: tl.constexpr, NC: tl.constexpr, DR: tl.constexpr,
    HAS_PE: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, CARRY_PAGES: tl.constexpr,
    PRECISION: tl.constexpr, KV_FMT: tl.constexpr, NAN_FIXUP: tl.constexpr, PAIRS: tl.constexpr,
):
    """One online-softmax step over KV tokens n0 .. n0 + BLOCK_N - 1 (running max in log2 units).

    Each [BLOCK_N, 576] tile is loaded once, as NC value/key column chunks plus the rope-key part; the
    chunks serve as K in Q K^T and as V in P V. With CARRY_PAGES the caller passes the tile's page id
    (pages of at least BLOCK_N tokens, already checked); otherwise it is read and checked here. Returns the
    updated state and whether a page id of the tile was outside the cache (read as page 0 instead). qk_scale:
    the score scale (log2 units), per row (float32 [BLOCK_M]) for fp8_e4m3 and one scalar otherwise. FP8 rows
    are read as ``common.fp8_cols`` gives them and cast to q's dtype for the dots (exact: fp8_e4m3's scale is
    folded into qk_scale and the output by the caller, which also hands its q over as fp16 rows on GPUs).
    l_i holds the row sums, per key slot ([BLOCK_M, BLOCK_N]) where the caller keeps them so (FP8 tiles of 16
    rows, ``SLOT_SUMS``; it sums them at the request's end) and per row ([BLOCK_M]) otherwise.
    PAIRS (FP8, NC 4): the value's bytes come as 16-bit words, two word tiles of DC words per step
    (``_kv_pairs``); chunks 0 / 1 are the even / odd columns of the value's first 2 * DC bytes (0-255 for a
    512-wide value), chunks 2 / 3 those of the next 2 * DC, and q's chunks and the accumulators hold the
    same columns.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_seq = offs_n < seqlen
    row = 0
    bad_page = False
    if PAGE >= BLOCK_N and not CARRY_PAGES:
        page_id, bad_page = checked_page(tl.load(bt_row + n0 // PAGE), num_pages)
    if USE_TMA:
        # Pages hold a multiple of BLOCK_N tokens: the tile is BLOCK_N consecutive cache rows.
        row = page_id * PAGE + n0 % PAGE
        tok = offs_n
        if KV_FMT == 2:
            tok = (row + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_tok
    elif PAGE >= BLOCK_N:
        tok = page_id.to(tl.int64) * stride_page + (n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_tok
    else:
        # Several pages per tile: one page-id lookup per token; past the end read page 0 (never used).
        pages, bad = checked_page(tl.load(bt_row + offs_n // PAGE, mask=in_seq, other=0), num_pages)
        bad_page = tl.max(bad.to(tl.int32), 0) > 0
        tok = pages.to(tl.int64) * stride_page + (offs_n % PAGE) * stride_tok
    if PAIRS:
        k0, k1 = _kv_pairs(kv_ptr, desc, tok, row, in_seq, 0, DC, MASKED, USE_TMA, KV_FMT, NAN_FIXUP)
        k2, k3 = _kv_pairs(kv_ptr, desc, tok, row, in_seq, DC, DC, MASKED, USE_TMA, KV_FMT, NAN_FIXUP)
        k0 = k0.to(q0.dtype)
        k1 = k1.to(q0.dtype)
        k2 = k2.to(q0.dtype)
        k3 = k3.to(q0.dtype)
        # Partial scores per chunk (and the rope part's below) summed at the end, not one accumulator through
        # all 36 k-steps: no chain of dependent MMAs is longer than 8 (benchmarks/NOTES.md, decode v32: level
        # alone, 0.4-1.2% beside v33's row sums on the H100).
        s = _sum_unfused(_sum_unfused(tl.dot(q0, tl.trans(k0), input_precision=PRECISION),
                                      tl.dot(q1, tl.trans(k1), input_precision=PRECISION)),
                         _sum_unfused(tl.dot(q2, tl.trans(k2), input_precision=PRECISION),
                                      tl.dot(q3, tl.trans(k3), input_precision=PRECISION)))
    else:
        k0 = _kv_cols(kv_ptr, desc, tok, row, in_seq, 0, DC, MASKED, USE_TMA, KV_FMT, False,
                      NAN_FIXUP).to(q0.dtype)
        s = tl.dot(q0, tl.trans(k0), input_precision=PRECISION)
        k1 = k0
        k2 = k0
        k3 = k0
        if NC >= 2:
            k1 = _kv_cols(kv_ptr, desc, tok, row, in_seq, DC, DC, MASKED, USE_TMA, KV_FMT, False,
                          NAN_FIXUP).to(q0.dtype)
            s = tl.dot(q1, tl.trans(k1), s, input_precision=PRECISION)
        if NC == 4:
            k2 = _kv_cols(kv_ptr, desc, tok, row, in_seq, 2 * DC, DC, MASKED, USE_TMA, KV_FMT, False,
                          NAN_FIXUP).to(q0.dtype)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
            k3 = _kv_cols(kv_ptr, desc, tok, row, in_seq, 3 * DC, DC, MASKED, USE_TMA, KV_FMT, False,
                          NAN_FIXUP).to(q0.dtype)
            s = tl.dot(q3, tl.trans(k3), s, input_precision=PRECISION)
    if HAS_PE:
        k_pe = _kv_cols(kv_ptr, desc_pe, tok, row, in_seq, NC * DC, DR, MASKED, USE_TMA, KV_FMT, True,
                        NAN_FIXUP).to(q0.dtype)
        if PAIRS:
            s = _sum_unfused(s, tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION))
        else:
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
    if KV_FMT == 1:
        s = s * qk_scale[:, None]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(offs_n[None, :] < lim[:, None], s, float("-inf"))
    m_tile = tl.max(s, 1)
    # On FP8 tiles of up to 32 rows the running max in use moves only when some row's tile max exceeds it by
    # more than RESCALE_SLACK (log2 units), so most steps skip the accumulators' rescale: P stays below
    # 2^RESCALE_SLACK, far inside fp16's and bf16's range, and the final LSE (m + log2 l) does not depend on
    # which max was used. A row with no visible key yet keeps max -inf; comparing, not subtracting, keeps
    # -inf - -inf (NaN) out of the decision. Elsewhere every step rescales: the branch left 16-bit tiles level
    # and made the 64-row (wgmma) tiles 15% slower (benchmarks/NOTES.md, decode v31).
    if KV_FMT != 0 and q0.shape[0] <= 32:
        if tl.max((m_tile > m_i + RESCALE_SLACK).to(tl.int32), 0) > 0:
            acc0, acc1, acc2, acc3, m_i, _, alpha = _rescaled(acc0, acc1, acc2, acc3, m_i, m_tile, NC)
            if len(l_i.shape) == 2:
                l_i = l_i * alpha[:, None]
            else:
                l_i = l_i * alpha
        # Subtract 0 where the max is still -inf, so exp2 gives 0, not NaN.
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        if len(l_i.shape) == 2:
            # The row sums stay per (row, key slot) until the request's end (the caller's ``tl.sum``): no
            # reduction across the warps that hold a row's keys at every step (32-row tiles spilled with it).
            l_i = l_i + p
        else:
            l_i = l_i + tl.sum(p, 1)
    else:
        acc0, acc1, acc2, acc3, m_i, m_safe, alpha = _rescaled(acc0, acc1, acc2, acc3, m_i, m_tile, NC)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(k0.dtype)
    acc0 = tl.dot(p, k0, acc0, input_precision=PRECISION)
    if NC >= 2:
        acc1 = tl.dot(p, k1, acc1, input_precision=PRECISION)
    if NC == 4:
        acc2 = tl.dot(p, k2, acc2, input_precision=PRECISION)
        acc3 = tl.dot(p, k3, acc3, input_precision=PRECISION)
    return acc0, acc1, acc2, acc3, m_i, l_i, bad_page


@triton.jit
def _attend_range(
    acc0, acc1, acc2, acc3, m_i, l_i, page_id, bad_page, q0, q1, q2, q3, q_pe,
    kv_ptr, desc, desc_pe, bt_row, lo, hi, tok_hi, seqlen, lim, stride_page, stride_tok, qk_scale, num_pages,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DC: tl.constexpr, NC: tl.constexpr, DR: tl.constexpr,
    HAS_PE: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, CARRY_PAGES: tl.constexpr,
    PRECISION: tl.constexpr, KV_FMT: tl.constexpr, NAN_FIXUP: tl.constexpr, PAIRS: tl.constexpr,
):
    """``_attend_tile`` over KV tokens lo .. hi - 1, BLOCK_N at a time (all MASKED or none). With CARRY_PAGES
    ``page_id`` / ``bad_page`` hold the checked page id of the tile at lo, and each step reads the next
    tile's (up to the range's end ``tok_hi``) before its own loads. Returns the updated state, the carried page
    id and whether any page id so far was outside the cache."""
    for n0 in range(lo, hi, BLOCK_N):
        next_id = page_id
        next_bad = bad_page
        if CARRY_PAGES:
            next_id, next_bad = checked_page(
                tl.load(bt_row + (n0 + BLOCK_N) // PAGE, mask=n0 + BLOCK_N < tok_hi, other=0), num_pages)
            next_bad = next_bad | bad_page
        acc0, acc1, acc2, acc3, m_i, l_i, tile_bad = _attend_tile(
            acc0, acc1, acc2, acc3, m_i, l_i, q0, q1, q2, q3, q_pe,
            kv_ptr, desc, desc_pe, bt_row, n0, seqlen, lim, stride_page, stride_tok, qk_scale, page_id,
            num_pages, PAGE, BLOCK_N, DC, NC, DR, HAS_PE, MASKED, USE_TMA, CARRY_PAGES, PRECISION, KV_FMT,
            NAN_FIXUP, PAIRS)
        page_id = next_id
        bad_page = next_bad | tile_bad
    return acc0, acc1, acc2, acc3, m_i, l_i, page_id, bad_page


@triton.jit
def _store_rows(ptrs, acc0, acc1, acc2, acc3, scale, row_ok, DC: tl.constexpr, NC: tl.constexpr,
                PAIRS: tl.constexpr, EVICT: tl.constexpr):
    """Store the NC accumulator chunks, scaled per row, to the rows ``ptrs`` [BLOCK_M, 1] point at (with PAIRS
    the even- and odd-column chunks of ``_attend_tile``, interleaved back), with L2 eviction policy EVICT."""
    ty = ptrs.dtype.element_ty
    if PAIRS:
        cols = tl.arange(0, 2 * DC)[None, :]
        tl.store(ptrs + cols, (_interleave(acc0, acc1) * scale[:, None]).to(ty), mask=row_ok[:, None],
                 eviction_policy=EVICT)
        tl.store(ptrs + 2 * DC + cols, (_interleave(acc2, acc3) * scale[:, None]).to(ty), mask=row_ok[:, None],
                 eviction_policy=EVICT)
    else:
        cols = tl.arange(0, DC)[None, :]
        tl.store(ptrs + cols, (acc0 * scale[:, None]).to(ty), mask=row_ok[:, None], eviction_policy=EVICT)
        if NC >= 2:
            tl.store(ptrs + DC + cols, (acc1 * scale[:, None]).to(ty), mask=row_ok[:, None], eviction_policy=EVICT)
        if NC == 4:
            tl.store(ptrs + 2 * DC + cols, (acc2 * scale[:, None]).to(ty), mask=row_ok[:, None], eviction_policy=EVICT)
            tl.store(ptrs + 3 * DC + cols, (acc3 * scale[:, None]).to(ty), mask=row_ok[:, None], eviction_policy=EVICT)


@triton.jit
def _even_odd(x):
    """(even columns, odd columns) of x [M, 2N]."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@triton.jit
def _interleave(even, odd):
    """The [M, 2N] tile whose even columns are ``even`` [M, N] and odd ones ``odd``."""
    return tl.reshape(tl.join(even, odd), [even.shape[0], 2 * even.shape[1]])


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, part_ptr, err_ptr, desc, desc_pe, scale_ptr,
    B, H, Q_LEN, ROWS, NUM_PAGES, MAX_PAGES, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_page, stride_tok, stride_btb,
    stride_ob, stride_ot, stride_oh,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, SCHED_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr, NC: tl.constexpr, DR: tl.constexpr,
    HAS_PE: tl.constexpr, META_W: tl.constexpr, USE_TMA: tl.constexpr, CARRY_PAGES: tl.constexpr,
    PRECISION: tl.constexpr, KV_FMT: tl.constexpr, NAN_FIXUP: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr,
    OUT_TYPED: tl.constexpr, WAIT_PRIOR: tl.constexpr,
):
    """One program: a row tile of one split-plan part's requests, every KV step of each and its result.
    Long (~110 lines) on purpose: the loop-carried state (the accumulator chunks, row max and sum, the
    carried page id) stays in one body; Triton inlines helpers anyway, and a helper per stage would take
    and return all of it."""
    if WAIT_PRIOR:
        # Launched as the previous kernel's programmatic dependent: nothing is read before its end.
        gdc_wait()
    if PDL:
        # The combine's programs may be scheduled once every program here has passed this point: each waits for
        # this grid's end before it reads the partials, and reads the schedule and the lengths before that,
        # which the wait above makes safe (``_decode_combine_kernel``).
        gdc_launch_dependents()
    DC: tl.constexpr = DV // NC
    k_scale = 1.0
    if KV_FMT == 1:
        # fp8_e4m3: keys and values are fp8 x k_scale; the tiles hold the fp8 values, the scale goes here.
        k_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * k_scale
    pid_m = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, part, B - 1, META_W)
    # The partials buffer (``partials_size``): the schedule verdict that program (0, 0) writes and the combine
    # kernel reads, pieces x rows x DV values, pieces x rows log2 LSEs.
    pieces_cap = B + parts
    verdict_ptr, pval_ptr, plse_ptr = partials_views(part_ptr, out_ptr, pieces_cap, ROWS, DV, OUT_TYPED)
    capacity = MAX_PAGES * PAGE

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    t = rows // H
    h = rows % H
    offs_dc = tl.arange(0, DC)
    q_row = t.to(tl.int64) * stride_qt + h * stride_qh
    o_row = t.to(tl.int64) * stride_ot + h * stride_oh
    lse_row = h * Q_LEN + t

    for b in range(begin_req, end_req + 1):
        seqlen, tok_lo, tok_hi, bits = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk, capacity,
                                                    SCHED_N)
        if tok_lo < tok_hi:
            q_ptrs = q_ptr + tl.cast(b, tl.int64) * stride_qb + q_row[:, None]
            if PAIRS:
                # The chunks as _attend_tile's PAIRS reads the cache: even and odd columns of each 2 * DC.
                q0, q1 = _even_odd(tl.load(q_ptrs + tl.arange(0, 2 * DC)[None, :], mask=row_ok[:, None], other=0.0))
                q2, q3 = _even_odd(tl.load(q_ptrs + 2 * DC + tl.arange(0, 2 * DC)[None, :], mask=row_ok[:, None],
                                           other=0.0))
            else:
                q0 = tl.load(q_ptrs + offs_dc[None, :], mask=row_ok[:, None], other=0.0)
                q1 = q0
                q2 = q0
                q3 = q0
                if NC >= 2:
                    q1 = tl.load(q_ptrs + DC + offs_dc[None, :], mask=row_ok[:, None], other=0.0)
                if NC == 4:
                    q2 = tl.load(q_ptrs + 2 * DC + offs_dc[None, :], mask=row_ok[:, None], other=0.0)
                    q3 = tl.load(q_ptrs + 3 * DC + offs_dc[None, :], mask=row_ok[:, None], other=0.0)
            q_pe = q0
            if HAS_PE:
                q_pe = tl.load(q_ptrs + DV + tl.arange(0, DR)[None, :], mask=row_ok[:, None], other=0.0)
            # One scale for every row unless fp8_e4m3 rescales q rows below: with a per-row vector the bf16
            # 16-row kernel compiled to 186 registers instead of 252 and ran 4-5% slower on the H200
            # (benchmarks/NOTES.md, decode v19).
            qk_row = qk_scale
            if KV_FMT == 1:
                qk_row = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
            if KV_FMT == 1 and q_ptr.dtype.element_ty != tl.float32:
                # fp8_e4m3 tiles are fp16 values (``fp8_cols``): the dots run in fp16 on q rows scaled into
                # its range by a power of two, which the scores take back.
                amax = tl.max(tl.abs(q0.to(tl.float32)), 1)
                if NC >= 2:
                    amax = tl.maximum(amax, tl.max(tl.abs(q1.to(tl.float32)), 1))
                if NC == 4:
                    amax = tl.maximum(amax, tl.max(tl.abs(q2.to(tl.float32)), 1))
                    amax = tl.maximum(amax, tl.max(tl.abs(q3.to(tl.float32)), 1))
                if HAS_PE:
                    amax = tl.maximum(amax, tl.max(tl.abs(q_pe.to(tl.float32)), 1))
                q_mul, q_inv = fp16_row_scale(amax)
                qk_row = qk_row * q_inv
                q0 = (q0.to(tl.float32) * q_mul[:, None]).to(tl.float16)
                q1 = (q1.to(tl.float32) * q_mul[:, None]).to(tl.float16)
                q2 = (q2.to(tl.float32) * q_mul[:, None]).to(tl.float16)
                q3 = (q3.to(tl.float32) * q_mul[:, None]).to(tl.float16)
                q_pe = (q_pe.to(tl.float32) * q_mul[:, None]).to(tl.float16)
            bt_row = bt_ptr + tl.cast(b, tl.int64) * stride_btb
            # Keys a row may see: [0, lim); with causal, query t of Q_LEN sees keys 0 .. seqlen - Q_LEN + t.
            # Tiles before the first key some row cannot see run unmasked; the rest run masked.
            if CAUSAL:
                lim = seqlen - Q_LEN + 1 + t
                first_masked = seqlen - Q_LEN + 1
            else:
                lim = tl.zeros([BLOCK_M], dtype=tl.int32) + seqlen
                first_masked = seqlen
            tok_mid = tok_lo + tl.maximum(tl.minimum(tok_hi, first_masked) - tok_lo, 0) // BLOCK_N * BLOCK_N
            lim = tl.minimum(lim, tok_hi)

            acc0 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
            acc1 = acc0
            acc2 = acc0
            acc3 = acc0
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            # Row sums per key slot on FP8 tiles of 16 rows (``_attend_tile``), summed at the end.
            SLOT_SUMS: tl.constexpr = KV_FMT != 0 and BLOCK_M <= 16
            if SLOT_SUMS:
                l_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            else:
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            carry: tl.constexpr = CARRY_PAGES and PAGE >= BLOCK_N
            page_id = tok_lo * 0
            bad_page = page_id != 0
            if carry:
                page_id, bad_page = checked_page(tl.load(bt_row + tok_lo // PAGE), NUM_PAGES)
            acc0, acc1, acc2, acc3, m_i, l_i, page_id, bad_page = _attend_range(
                acc0, acc1, acc2, acc3, m_i, l_i, page_id, bad_page, q0, q1, q2, q3, q_pe,
                kv_ptr, desc, desc_pe, bt_row, tok_lo, tok_mid, tok_hi, seqlen, lim, stride_page, stride_tok, qk_row,
                NUM_PAGES, PAGE, BLOCK_N, DC, NC, DR, HAS_PE, False, USE_TMA, carry, PRECISION, KV_FMT,
                NAN_FIXUP, PAIRS)
            acc0, acc1, acc2, acc3, m_i, l_i, page_id, bad_page = _attend_range(
                acc0, acc1, acc2, acc3, m_i, l_i, page_id, bad_page, q0, q1, q2, q3, q_pe,
                kv_ptr, desc, desc_pe, bt_row, tok_mid, tok_hi, tok_hi, seqlen, lim, stride_page, stride_tok, qk_row,
                NUM_PAGES, PAGE, BLOCK_N, DC, NC, DR, HAS_PE, True, USE_TMA, carry, PRECISION, KV_FMT,
                NAN_FIXUP, PAIRS)

            bits = bits | tl.where(bad_page, BLOCK_TABLE, 0)
            report(err_ptr, bits)
            if SLOT_SUMS:
                l_i = tl.sum(l_i, 1)
            inv_l, lse2 = finish_rows(l_i, m_i, bits != 0)
            if KV_FMT == 1:
                inv_l = inv_l * k_scale
            s_lo = tl.load(splits_ptr + b)
            pieces = tl.load(splits_ptr + b + 1) - s_lo
            if pieces == 1:
                _store_rows(out_ptr + tl.cast(b, tl.int64) * stride_ob + o_row[:, None],
                            acc0, acc1, acc2, acc3, inv_l, row_ok, DC, NC, PAIRS, "")
                tl.store(lse_ptr + tl.cast(b, tl.int64) * ROWS + lse_row, lse2 * _LN2, mask=row_ok)
            else:
                # Inside the partials buffer whatever num_splits holds (a schedule made for other lengths is
                # caught by the verdict below, and the combine kernel then poisons every request).
                piece = tl.minimum(tl.maximum(s_lo + tl.where(b == begin_req, begin_split, 0), 0), pieces_cap - 1)
                p_row = piece.to(tl.int64) * ROWS + rows
                _store_rows(pval_ptr + p_row[:, None] * DV, acc0, acc1, acc2, acc3, inv_l, row_ok, DC, NC, PAIRS,
                            PARTIALS_EVICTION)
                tl.store(plse_ptr + p_row, lse2, mask=row_ok, eviction_policy=PARTIALS_EVICTION)
    if (pid_m == 0) & (part == 0):
        sched_ok = schedule_matches(seqlens_ptr, meta_ptr, splits_ptr, B, parts, tl.arange(0, 1024), SCHED_N)
        tl.store(verdict_ptr, tl.where(sched_ok, 1.0, 0.0))
        report(err_ptr, tl.where(sched_ok, 0, SCHEDULE))


@triton.jit
def _combine_piece(plse_ptr, pval_ptr, s, s_hi, rows, cols, row_ok, ROWS, DV: tl.constexpr):
    """(log2 LSEs, values as stored) of piece ``s``'s rows and columns: -inf and 0 past ``s_hi``. The values
    are loaded first and widened only where used (``_add_piece``): so written, ptxas issues every piece's
    loads of a combine step before the first use (sm_90a SASS; with the LSEs first or the values widened
    here it issued a piece's value loads after the previous piece's multiply-adds, a round trip each)."""
    ok = row_ok & (s < s_hi)
    p_row = tl.cast(s, tl.int64) * ROWS + rows
    os = tl.load(pval_ptr + p_row[:, None] * DV + cols[None, :], mask=ok[:, None], other=0.0)
    return tl.load(plse_ptr + p_row, mask=ok, other=float("-inf")), os


@triton.jit
def _add_piece(acc, l, ls, os, m_safe):
    """The running sums plus a piece of log2 LSEs ``ls`` and values ``os`` at row max ``m_safe``."""
    w = tl.exp2(ls - m_safe)  # NaN for a piece of a corrupt request: the sums stay NaN
    return acc + w[:, None] * os.to(tl.float32), l + w


@triton.jit
def _decode_combine_kernel(
    out_ptr, lse_ptr, part_ptr, splits_ptr, seqlens_ptr, err_ptr,
    B, H, Q_LEN, ROWS, PARTS, CAPACITY,
    stride_ob, stride_ot, stride_oh,
    DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PIECES: tl.constexpr, PDL: tl.constexpr,
    OUT_TYPED: tl.constexpr,
):
    """Merge the partials of request program_id(0), rows block program_id(1), columns block program_id(2),
    ``PIECES`` pieces a step.

    Also writes requests with no KV (no pieces): output 0, LSE -inf. Requests in one piece were written
    by the main kernel, unless the main kernel found the schedule was made for other lengths: then every
    request's rows are NaN (and a negative length's request with no pieces too). With PDL (launched as a
    programmatic dependent of the main kernel) the programs start while the main kernel runs and wait for
    its end (``griddepcontrol.wait``) before touching results; the programs of a one-piece request other
    than request 0 have nothing to do unless the schedule is bad, and leave before that wait (the grid
    would otherwise hold them after the main kernel: at 128-256 rows per request most programs are such,
    and the tail after the main kernel grew with them, benchmarks/NOTES.md decode v37); request 0's
    programs always wait, so the grid ends after the main kernel, and under a bad schedule write the NaN
    rows of every request.
    """
    tl.static_assert((PIECES == 1) | (PIECES == 2) | (PIECES == 4), "PIECES: the step loads 1, 2 or 4 pieces")
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < ROWS
    pieces_cap = B + PARTS
    verdict_ptr, pval_ptr, plse_ptr = partials_views(part_ptr, out_ptr, pieces_cap, ROWS, DV, OUT_TYPED)
    # The piece range and the length were written before the main kernel started, and under PDL the main
    # kernel lets this grid start only after its own wait for its predecessor: both may be read before the
    # wait below, so that after it the verdict and the first pieces are one round trip.
    s_lo = tl.load(splits_ptr + b)
    s_hi = tl.load(splits_ptr + b + 1)
    _, bits = checked_length(tl.load(seqlens_ptr + b), CAPACITY)
    t = rows // H
    h = rows % H
    if PDL:
        if (s_hi - s_lo == 1) & (b != 0):
            return
        # Request 0's programs wait whatever its pieces: the next kernel in the stream is ordered after this
        # grid only, so the grid must not finish before the main kernel has (a reader of ``out`` could
        # otherwise overtake it when no request is split).
        gdc_wait()
    bad_schedule = tl.load(verdict_ptr) != 1.0
    # A one-piece request was written by the main kernel; this program writes it only under a bad schedule.
    # Nothing branches on the verdict before the pieces' loads are issued: it is used when storing.
    merge = s_hi - s_lo != 1
    if (tl.program_id(1) == 0) & (tl.program_id(2) == 0) & (s_hi == s_lo):
        # A request with no pieces never reached the main kernel, which reports the others' lengths.
        report(err_ptr, bits)
    # Pieces inside the buffer whatever num_splits holds (a schedule for other lengths poisons anyway).
    s_lo = tl.minimum(tl.maximum(s_lo, 0), pieces_cap)
    s_hi = tl.where(merge, tl.minimum(tl.maximum(s_hi, s_lo), pieces_cap), s_lo)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    # PIECES pieces a step, all loaded before any is used: Triton does not pipeline this loop (no dot), so one
    # piece a step costs a round trip per piece (benchmarks/NOTES.md, decode v35). Each piece is a tile of its
    # own: one [PIECES, rows, columns] tile got warps across the pieces and a cross-warp sum.
    for s0 in range(s_lo, s_hi, PIECES):
        ls0, os0 = _combine_piece(plse_ptr, pval_ptr, s0, s_hi, rows, cols, row_ok, ROWS, DV)
        top = ls0
        if PIECES >= 2:
            ls1, os1 = _combine_piece(plse_ptr, pval_ptr, s0 + 1, s_hi, rows, cols, row_ok, ROWS, DV)
            top = tl.maximum(top, ls1)
        if PIECES >= 4:
            ls2, os2 = _combine_piece(plse_ptr, pval_ptr, s0 + 2, s_hi, rows, cols, row_ok, ROWS, DV)
            ls3, os3 = _combine_piece(plse_ptr, pval_ptr, s0 + 3, s_hi, rows, cols, row_ok, ROWS, DV)
            top = tl.maximum(top, tl.maximum(ls2, ls3))
        m_new = tl.maximum(m, top)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        acc, l = _add_piece(acc * alpha[:, None], l * alpha, ls0, os0, m_safe)
        if PIECES >= 2:
            acc, l = _add_piece(acc, l, ls1, os1, m_safe)
        if PIECES >= 4:
            acc, l = _add_piece(acc, l, ls2, os2, m_safe)
            acc, l = _add_piece(acc, l, ls3, os3, m_safe)
        m = m_new
    inv_l, lse2 = finish_rows(l, m, bad_schedule | (bits != 0))
    write = row_ok & (merge | bad_schedule)
    o_ptrs = (out_ptr + tl.cast(b, tl.int64) * stride_ob + (t.to(tl.int64) * stride_ot + h * stride_oh)[:, None]
              + cols[None, :])
    tl.store(o_ptrs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=write[:, None])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + tl.cast(b, tl.int64) * ROWS + h * Q_LEN + t, lse2 * _LN2, mask=write)
    if PDL:
        # After this program's own stores, so that no branch on the verdict precedes the pieces' loads.
        if (b == 0) & bad_schedule:
            # The one-piece requests' programs left above: this program's tile of every request is NaN.
            nan = float("nan")
            for b2 in range(1, B):
                o_ptrs = (out_ptr + tl.cast(b2, tl.int64) * stride_ob
                          + (t.to(tl.int64) * stride_ot + h * stride_oh)[:, None] + cols[None, :])
                tl.store(o_ptrs, tl.full([BLOCK_R, BLOCK_D], nan, out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.store(lse_ptr + tl.cast(b2, tl.int64) * ROWS + h * Q_LEN + t, tl.full([BLOCK_R], nan, tl.float32),
                         mask=row_ok & (tl.program_id(2) == 0))


_SPLIT = CachedKernel(_decode_split_kernel)
_COMBINE = CachedKernel(_decode_combine_kernel)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check_dims(d: int, head_dim_v: int) -> int:
    """Returns the rope width D - Dv; the kernel needs Dv a power of two and D - Dv zero or a power of two."""
    dr = d - head_dim_v
    if not _is_pow2(head_dim_v) or not 16 <= head_dim_v <= 512:
        raise ValueError(f"head_dim_v: the triton decode kernel needs a power of two in 16..512, got {head_dim_v}")
    if dr != 0 and (not _is_pow2(dr) or not 16 <= dr <= 256):
        raise ValueError(f"q: head dim {d} minus head_dim_v {head_dim_v} must be 0 or a power of two in 16..256 "
                         f"for the triton decode kernel, got {dr}")
    return dr


def _tma_ok(cfg: DecodeConfig, k_cache: torch.Tensor, d: int) -> bool:
    """TMA tiles are consecutive cache rows: pages a multiple of block_n, rows packed, 16-byte aligned."""
    page = k_cache.shape[1]
    return (cfg.use_tma and k_cache.is_cuda and page % cfg.block_n == 0 and k_cache.stride(1) == d
            and k_cache.stride(0) == page * d and k_cache.data_ptr() % 16 == 0
            and (d * k_cache.element_size()) % 16 == 0)


def partials_size(b: int, parts: int, rows: int, head_dim_v: int, value_bytes: int) -> int:
    """float32 words of the partials buffer of a call (``common.partials_views`` reads it): the schedule
    verdict in a 128-byte line of its own, then for at most b + parts - 1 pieces (each part boundary cuts one
    request in two) their rows x head_dim_v normalised values of ``value_bytes`` each (the output's element
    size), then their rows log2 LSEs."""
    n = (b + parts) * rows
    return PARTIALS_HEADER.value + n * head_dim_v * value_bytes // 4 + n


def _portable_main_args(q, k_cache, block_table, cache_seqlens, metadata, num_splits, softmax_scale, causal, cfg,
                        out, lse, partials, err, kv_fmt=None, k_scale=None, pdl=False, out_typed=False,
                        wait_prior=False):
    """(kernel, grid, args, options) of the portable main kernel (``kv_fmt``, ``k_scale``: an FP8 cache's
    format and scale, ``paged_decode_triton``; ``pdl``: the combine kernel follows as a programmatic
    dependent launch; ``wait_prior``: this kernel is launched as one itself, ``common.wait_prior_options``)."""
    b, q_len, h, d = q.shape
    rows = q_len * h
    head_dim_v = out.shape[-1]
    dr = d - head_dim_v
    page = k_cache.shape[1]
    m_tiles = -(-rows // cfg.block_m)  # plain arithmetic: triton.cdiv costs microseconds of host time per call
    width = kv_format_width(kv_fmt, d)
    use_tma = _tma_ok(cfg, k_cache, width)
    kv, scale_arg, fmt_id = kv_format_args(k_cache, kv_fmt, k_scale)
    # Words are read through int16 pointers: rows at even addresses only (a cache carved out of a byte buffer at
    # an odd offset reads its bytes one by one, as before).
    pairs = fp8_pairs(cfg, kv_fmt) and not (kv.data_ptr() | kv.stride(0) | kv.stride(1)) & 1
    desc = desc_pe = None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        flat = kv.view(-1, width)
        if pairs:
            # The value's bytes as 16-bit words (``_kv_pairs``): boxes of one chunk's width in words.
            words = flat.view(torch.int16)
            desc = TensorDescriptor(words, list(words.shape), [width // 2, 1], [cfg.block_n, head_dim_v // cfg.chunks])
        else:
            desc = TensorDescriptor(flat, list(flat.shape), [width, 1], [cfg.block_n, head_dim_v // cfg.chunks])
        # fp8_ds_mla's rope columns are bf16 values at a 16-byte aligned offset of the row.
        pe = flat.view(torch.bfloat16) if kv_fmt == "fp8_ds_mla" else flat
        desc_pe = TensorDescriptor(pe, list(pe.shape), [pe.shape[1], 1], [cfg.block_n, max(dr, 16)])
    args = (q, kv, block_table, cache_seqlens, metadata, num_splits, out, lse, partials, err, desc, desc_pe,
            scale_arg, b, h, q_len, rows, k_cache.shape[0], block_table.shape[1], softmax_scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), kv.stride(1), block_table.stride(0),
            out.stride(0), out.stride(1), out.stride(2))
    options = dict(CAUSAL=bool(causal), PAGE=page, SCHED_N=SCHED_BLOCK_N, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                   DV=head_dim_v, NC=cfg.chunks, DR=max(dr, 16), HAS_PE=dr > 0, META_W=METADATA_WIDTH,
                   USE_TMA=use_tma, CARRY_PAGES=cfg.carry_pages,
                   PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FMT=fmt_id,
                   NAN_FIXUP=fmt_id > 0 and fp8_nan_fixup(), PAIRS=pairs, PDL=pdl, OUT_TYPED=out_typed,
                   num_warps=cfg.num_warps, num_stages=cfg.num_stages, **wait_prior_options(wait_prior))
    return _SPLIT, (m_tiles, metadata.shape[0], 1), args, options


def fp8_pairs(cfg: DecodeConfig, kv_fmt: str | None) -> bool:
    """Whether the main kernel reads an FP8 cache's latent bytes as 16-bit words (``_attend_tile``'s PAIRS):
    four value chunks, tiles of up to 32 rows (warp-level MMAs, whose value operand is read
    from shared memory in pairs of tokens; 64-row tiles compile to wgmma, which reads it in place)."""
    return kv_fmt is not None and cfg.chunks == 4 and cfg.block_m <= 32


# Pieces of a split request the combine kernel loads in one step (its ``PIECES``): four where few requests
# have tens of pieces each (one round trip per four), two where many requests (``_DecodePlan``'s 16-row
# tiles) have two or three, whose programs then take 72 registers a thread instead of 115, so that 7 fit an
# SM instead of 4 (1.5-1.7% on 128-256-row cells at 1024 tokens, 5.9% slower at batch 1; decode v37).
COMBINE_PIECES = 4
COMBINE_PIECES_MANY = 2


def _combine_args(out, lse, partials, num_splits, cache_seqlens, err, parts, capacity, pdl, block_r, out_typed,
                  pieces=COMBINE_PIECES):
    b, q_len, h, head_dim_v = out.shape
    rows = q_len * h
    block_r = min(block_r, 1 << (rows - 1).bit_length())
    block_d = min(128, head_dim_v)
    # Up to four warps, as many as load 16 bytes each per piece (a one-row tile fills one warp).
    num_warps = max(1, min(4, block_r * block_d * (out.element_size() if out_typed else 4) // (16 * 32)))
    args = (out, lse, partials, num_splits, cache_seqlens, err, b, h, q_len, rows, parts, capacity,
            out.stride(0), out.stride(1), out.stride(2))
    options = dict(DV=head_dim_v, BLOCK_R=block_r, BLOCK_D=block_d, PIECES=pieces, PDL=pdl, OUT_TYPED=out_typed,
                   num_warps=num_warps, num_stages=3,
                   **({"launch_pdl": True} if pdl else {}))
    return (b, -(-rows // block_r), head_dim_v // block_d), args, options


class _DecodePlan:
    """Everything about one decode call shape that does not depend on the tensors' addresses: the config,
    the launch parameters and the result shapes. The first call of a shape builds it (compiling the kernels);
    every call then allocates the results and launches (``run``), through ``BoundLaunch`` where it applies."""

    def __init__(self, q, k_cache, block_table, head_dim_v, metadata, softmax_scale, causal, config, kv_fmt):
        b, q_len, h, d = q.shape
        _check_dims(d, head_dim_v)
        self.rows = q_len * h
        self.cfg = select_config(q, k_cache, head_dim_v, config, kv_fmt, metadata.shape[0])
        self.kv_fmt = kv_fmt
        self.device = q.device
        self.dtype = q.dtype
        self.out_shape = (b, q_len, h, head_dim_v)
        self.lse_shape = (b, h, q_len)
        self.parts = metadata.shape[0]
        self.capacity = block_table.shape[1] * k_cache.shape[1]
        many = 4 * b >= self.parts and self.rows >= 32
        # Partial values in the output's dtype after the portable kernel (16-row bf16 cells 1.5-2.5% faster, FP8
        # 64-128 rows ~2%) and after the 16-bit Hopper kernels for many requests (half the bytes the combine
        # reads: benchmarks/NOTES.md decode v38); float32 after the Hopper kernels for few requests (16-bit ones
        # 7-11% slower at batch 1-8; v22) and after the FP8 ones.
        self.out_typed = not self.cfg.use_sm90 or (many and kv_fmt is None)
        self.partials_numel = partials_size(b, self.parts, self.rows, head_dim_v,
                                            q.element_size() if self.out_typed else 4)
        self.scale, self.causal = softmax_scale, causal
        # From a request per four SMs (a few pieces each) the combine overlaps the main kernel's end (PDL,
        # after either main kernel: batch 128 in v11 / v21, batch 64 at 64 rows 1% in v30); below, the
        # early-scheduled combine only waits beside the main grid (on every call: batch 1 / 8 3-14% slower, v30).
        # Many requests (one per four SMs, at most ~4 pieces each) also merge 16 rows per program from 32 rows,
        # two pieces a step (at 64 x 4 x 16 x 4096, one per two SMs, 1% faster than 4-row tiles; decode v37);
        # fewer have ~parts / b pieces each, which small tiles spread over more programs.
        per_sm = 1 if self.cfg.use_sm90 else tile_plan(self.rows)[1]  # the portable small tiles: two per SM
        self.pdl = 4 * b * per_sm >= self.parts and pdl_available(q.device)
        self.wait_prior = pdl_available(q.device)
        sms = sm_count(q.device) if q.is_cuda else 8
        self.block_r = 16 if many else few_requests_block_r(b, self.rows, head_dim_v, sms)
        self.pieces = COMBINE_PIECES_MANY if many else COMBINE_PIECES
        # (main, grid, combine, combine grid) per alignment pattern of the plain pointer parameters
        # (``unaligned_mask``: a caller's lengths slice cache_seqlens[1:] is 4 bytes off), once bound.
        self.bound: dict[int, tuple] = {}
        self.tried_bind: set[int] = set()

    def run(self, q, k_cache, block_table, cache_seqlens, metadata, num_splits, out, lse, k_scale=None):
        dev = self.device
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=dev)
        if lse is None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        if self.out_shape[0] == 0:
            return out, lse
        partials = torch.empty(self.partials_numel, dtype=torch.float32, device=dev)
        err = errors.error_word(dev)
        # The bound launch does not switch devices: tensors off the current device take the full path.
        if self.bound and dev.index == torch.cuda.current_device():
            qp, kp, bp = q.data_ptr(), k_cache.data_ptr(), block_table.data_ptr()
            sp, mp, np_ = cache_seqlens.data_ptr(), metadata.data_ptr(), num_splits.data_ptr()
            op, lp = out.data_ptr(), lse.data_ptr()
            # fp8_e4m3's scale is the main kernel's last tensor parameter.
            xp = (k_scale.data_ptr(),) if self.kv_fmt == "fp8_e4m3" else ()
            # q and the cache at 16-byte aligned addresses (TMA bases, and what the bound launches were compiled
            # for); the other pointers pick the launch bound for their alignment pattern.
            bound = None if (qp | kp) & 15 else self.bound.get(unaligned_mask((bp, sp, mp, np_, op, lp, *xp)))
            if bound is not None:
                main, grid, combine, cgrid = bound
                pp, ep = partials.data_ptr(), err.data_ptr()
                stream = current_stream(dev.index)
                if self.cfg.use_sm90:
                    # fp8_ds_mla's rows carry a third descriptor (their scales).
                    maps = (qp, qp, kp, kp, kp) if self.kv_fmt == "fp8_ds_mla" else (qp, qp, kp, kp)
                    main.launch(grid, stream, (bp, sp, mp, np_, op, lp, pp, ep, *xp), maps)
                else:
                    main.launch(grid, stream, (qp, kp, bp, sp, mp, np_, op, lp, pp, ep, *xp), (kp, kp))
                combine.launch(cgrid, stream, (op, lp, pp, np_, sp, ep))
                return out, lse
        # The bound launch takes later calls' q by address with the bound call's strides: bind only from a call
        # that ran on the caller's own q, not on a copy of it (made below or by tma_rows).
        q_in = q
        if q.stride(-1) != 1:
            q = q.contiguous()
        if self.cfg.use_sm90:
            q_rows = tma_rows(q.reshape(-1, q.shape[-1]))
            if self.kv_fmt is not None:
                kernel, grid, args, options = sm90_fp8_main_args(q_rows, k_cache, self.kv_fmt, k_scale, block_table,
                                                                 cache_seqlens, metadata, num_splits, self.scale,
                                                                 self.causal, out, lse, partials, err, self.pdl,
                                                                 self.wait_prior, self.cfg.block_m)
            elif self.rows >= seesaw.SEESAW_MIN_ROWS:
                kernel, grid, args, options = seesaw.seesaw_main_args(q_rows, k_cache, block_table, cache_seqlens,
                                                                      metadata, num_splits, self.scale, self.causal,
                                                                      out, lse, partials, err, self.pdl,
                                                                      self.wait_prior, self.out_typed)
            else:
                kernel, grid, args, options = sm90_main_args(q_rows, k_cache, block_table, cache_seqlens, metadata,
                                                             num_splits, self.scale, self.causal, out, lse, partials,
                                                             err, self.pdl, self.wait_prior, self.cfg.block_m,
                                                             self.out_typed)
            own_q = q_rows.data_ptr() == q_in.data_ptr()
        else:
            kernel, grid, args, options = _portable_main_args(q, k_cache, block_table, cache_seqlens, metadata,
                                                              num_splits, self.scale, self.causal, self.cfg, out,
                                                              lse, partials, err, self.kv_fmt, k_scale, self.pdl,
                                                              self.out_typed, self.wait_prior)
            own_q = q is q_in
        cgrid, cargs, coptions = _combine_args(out, lse, partials, num_splits, cache_seqlens, err, self.parts,
                                               self.capacity, self.pdl, self.block_r, self.out_typed, self.pieces)
        if dev.type == "cuda" and own_q and not (q_in.data_ptr() | k_cache.data_ptr()) & 15:
            # Bind once per alignment pattern, from a call whose tensors the later calls' addresses stand for.
            xs = (k_scale,) if self.kv_fmt == "fp8_e4m3" else ()
            mask = unaligned_mask(tuple(t.data_ptr() for t in (block_table, cache_seqlens, metadata, num_splits,
                                                                 out, lse, *xs)))
            if mask not in self.tried_bind:
                self.tried_bind.add(mask)
                main = kernel.bind(dev, grid, *args, **options)
                combine = _COMBINE.bind(dev, cgrid, *cargs, **coptions)
                if main is not None and combine is not None:
                    self.bound[mask] = (main, grid, combine, cgrid)
        kernel.launch(dev, grid, *args, **options)
        _COMBINE.launch(dev, cgrid, *cargs, **coptions)
        return out, lse


_PLANS: dict[tuple, _DecodePlan] = {}


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    kv_format: str | None = None,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode with the split-KV Triton kernels (the ``triton`` provider's ``paged_decode``).

    q: [b, q_len, h, D] fp16/bf16 (fp32 too, with exact fp32 dots); k_cache: [num_pages, page_size, 1, D], q's
    dtype, or an FP8 cache (below); block_table: int32 [b, max_pages]; cache_seqlens: int32 [b], KV lengths
    including the q_len new tokens (0 allowed); tile_scheduler_metadata, num_splits: from
    ``get_mla_metadata(cache_seqlens, q_len * h, 1)`` (any ``num_sm_parts``); softmax_scale: multiplies q.k; causal:
    bottom-right aligned. Returns out [b, q_len, h, head_dim_v] in q's dtype and lse [b, h, q_len] float32 (natural
    log); a row with no visible key gets output 0 and LSE -inf. The value is the first head_dim_v columns of each
    row. FP8 caches (``kv_format`` "fp8_e4m3" with ``k_scale`` float32 [1], or "fp8_ds_mla": ``pagedmla.kv_format``;
    the public call checks them) are dequantised tile by tile as they are read: in registers by the portable
    kernel, in shared memory by the Hopper one (``sm90/decode_fp8.py``).
    Values only the device sees are guarded (``pagedmla.errors``): a request whose length is negative or
    beyond its block-table row, or which reads a page id outside the cache, gets NaN rows; metadata made for
    other lengths makes every row NaN. ``out`` / ``lse`` (contiguous, those shapes and dtypes) receive the
    results when given, e.g. a CUDA graph's static buffers; ``config`` overrides the tile shape (benchmarks
    sweep it). On sm_90 GPUs, with pages a multiple of 64, requests run a Hopper main kernel (bf16/fp16 caches:
    ``sm90/seesaw.py`` from 128 rows, ``sm90/decode.py`` below, transposed up to 32 rows; FP8 caches:
    ``sm90/decode_fp8.py``), except fp8_e4m3's requests of up to 16 rows under a schedule of more parts than
    SMs (``get_mla_metadata(..., kv_format="fp8_e4m3")``), which run the portable kernel (``select_config``).
    No host synchronisation: capturable in a CUDA graph.
    """
    key = (q.shape, q.stride(), q.dtype, q.get_device(), k_cache.shape, k_cache.stride(), k_cache.dtype,
           block_table.shape, block_table.stride(), cache_seqlens.is_contiguous(), tile_scheduler_metadata.shape,
           tile_scheduler_metadata.is_contiguous(), num_splits.is_contiguous(), head_dim_v, softmax_scale, causal,
           config, kv_format)
    plan = _PLANS.get(key)
    if plan is None:
        softmax_scale = checks.positive_scale(softmax_scale)
        if tile_scheduler_metadata.dim() != 2 or tile_scheduler_metadata.shape[1] != METADATA_WIDTH:
            raise ValueError(f"tile_scheduler_metadata: expected {METADATA_WIDTH} columns, "
                             f"got shape {tuple(tile_scheduler_metadata.shape)}")
        plan = _DecodePlan(q, k_cache, block_table, head_dim_v, tile_scheduler_metadata, softmax_scale, causal,
                           config, kv_format)
        if len(_PLANS) > 1024:  # shapes vary with the batch: keep the table bounded
            _PLANS.clear()
        _PLANS[key] = plan
    if out is not None:
        _check_result(out, "out", plan.out_shape, plan.dtype, plan.device)
    if lse is not None:
        _check_result(lse, "lse", plan.lse_shape, torch.float32, plan.device)
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    # The kernels index these as dense arrays (a no-op when they already are).
    cache_seqlens, num_splits = cache_seqlens.contiguous(), num_splits.contiguous()
    return plan.run(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata.contiguous(), num_splits, out,
                    lse, k_scale)


def _check_result(t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {shape} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def few_requests_block_r(b: int, rows: int, head_dim_v: int, sms: int) -> int:
    """Query rows per combine program outside the many-requests case (fewer requests than half the parts,
    or fewer than 32 rows per request): 4, or fewer when that leaves under three programs per SM (``sms``).
    Each program merges its rows' pieces in one loop of dependent loads, so a batch of 1-2 requests runs
    faster with its rows spread over more programs (measured on the H200, benchmarks/NOTES.md v15: batch 1
    at 128 heads, 60 pieces, 8.6 us with 1 row per program against 13.6 us with 4; from batch 4 at 128 rows
    4 rows per program was fastest)."""
    programs = b * max(1, head_dim_v // 128)  # the combine's column blocks
    for block_r in (4, 2):
        if programs * -(-rows // block_r) >= 3 * sms:
            return block_r
    return 1


def launch_combine(out: torch.Tensor, lse: torch.Tensor, partials: torch.Tensor, num_splits: torch.Tensor,
                   cache_seqlens: torch.Tensor, parts: int, capacity: int, pdl: bool = False, block_r: int = 4,
                   out_typed: bool = False, pieces: int = COMBINE_PIECES) -> None:
    """The combine kernel alone (tests): merge the pieces in ``partials`` (``partials_size`` layout, b +
    ``parts`` pieces, values float32 or with ``out_typed`` in out's dtype) of the requests ``num_splits``
    (int32 [b + 1], cumulative) gives more than one into
    out [b, q_len, h, Dv] / lse [b, h, q_len] (natural log); requests with no piece get output 0 and LSE
    -inf; a verdict other than 1.0 or a length outside 0 .. ``capacity`` poisons the request (NaN);
    ``pdl``: launched as the main kernel's programmatic dependent (sm_90+): it reads ``num_splits`` and
    ``cache_seqlens`` before waiting, so the kernel before it must be a decode main kernel, which lets it start
    only once those are written. ``block_r`` rows per program, ``pieces`` (1, 2 or 4) pieces merged a step."""
    if pieces not in (1, 2, 4):
        raise ValueError(f"pieces: 1, 2 or 4, got {pieces}")
    err = errors.error_word(out.device)
    grid, args, options = _combine_args(out, lse, partials, num_splits, cache_seqlens, err, parts, capacity, pdl,
                                        block_r, out_typed, pieces)
    _COMBINE.launch(out.device, grid, *args, **options)


def select_config(q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int, config: DecodeConfig | None = None,
                  kv_format: str | None = None, parts: int | None = None) -> DecodeConfig:
    """The main-kernel config ``paged_decode_triton`` runs for these inputs: ``config`` (checked), else where
    ``sm90_supported`` holds (an FP8 ``kv_format``: ``sm90_fp8_supported``) the Hopper kernel in its narrow
    form's 16- / 32-row tiles where ``split_plan.narrow_block`` gives one, in 64-row tiles for more than 16
    query rows, else ``default_config`` with no more column chunks than keep each 16 columns wide (the dots'
    least depth: head_dim_v 16 or 32 run one or two chunks). ``parts``: the schedule's part count; a schedule
    of at most one part per SM, made without the cache's format (``get_mla_metadata``'s ``kv_format``),
    runs the narrow form also where the format's own plan is the portable kernel's two programs per SM
    (fp8_e4m3 up to 16 rows: on an H100 1.25-1.42x FlashMLA's bf16 there, the portable kernel at one
    program per SM 1.08-1.21x; benchmarks/NOTES.md, "The narrow form")."""
    rows = q.shape[1] * q.shape[2]
    if kv_format is None:
        hopper = sm90_supported(q, k_cache, head_dim_v)
    else:
        hopper = sm90_fp8_supported(q, k_cache, head_dim_v, kv_format)
    narrow = narrow_block(rows, kv_format)
    if narrow is None and parts is not None and q.is_cuda and parts <= sm_count(q.device):
        narrow = narrow_block(rows)
    if config is None:
        if narrow is not None and hopper:
            return DecodeConfig(block_m=narrow, use_sm90=True)
        if rows >= SM90_MIN_ROWS and hopper:
            return DecodeConfig(block_m=64, use_sm90=True)
        cfg = default_config(rows, kv_format is not None)
        if head_dim_v // cfg.chunks < 16:
            cfg = dataclasses.replace(cfg, chunks=max(1, head_dim_v // 16))
        return cfg
    if config.use_sm90:
        if not hopper:
            raise ValueError("config: use_sm90 needs an sm_90 GPU, Triton's Gluon, bf16/fp16 q, a cache of q's "
                             "dtype or an FP8 one, head dims 576/512, pages a multiple of 64 and a contiguous "
                             "cache")
        if config.block_m != 64 and not (config.block_m in (16, 32) and rows <= config.block_m):
            raise ValueError(f"config: use_sm90 takes block_m 64, or 16 / 32 (the transposed form) for requests of "
                             f"at most that many query rows; got block_m {config.block_m} for {rows} rows")
    elif (SCHED_BLOCK_N % config.block_n or config.block_m not in (16, 32, 64) or config.chunks not in (1, 2, 4)
            or head_dim_v // config.chunks < 16):
        raise ValueError(f"config: block_n must divide {SCHED_BLOCK_N}, block_m be 16, 32 or 64, chunks 1, 2 or 4 "
                         f"of >= 16 columns; got {config}")
    return config

