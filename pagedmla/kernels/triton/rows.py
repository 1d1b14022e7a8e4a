"""Row moves whose addresses come from index tensors: latent rows stored into and gathered from the paged
cache by slot (FP8 caches quantising the rows as they store them), a step's request rows of the block
table gathered by request slot, and the pages a block table references dequantised into a workspace.

Each guards its indices on the device (``pagedmla.errors``): a store to a slot outside the cache is
skipped, a gather from one yields a NaN row, a request slot outside the table yields page-0 rows and a
length of -1 (which the attention kernels turn into NaN rows); each sets its error bit. One more writes NaN
into the output rows of requests whose device length the host's plan cannot stand for (``poison_bad_lengths``,
the backend's MHA forms). One launch each, no host synchronisation, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla import checks, errors, kv_format
from pagedmla.kernels.triton.common import (
    DS_MIN_SCALE_INV,
    DS_ROPE_OFFSET,
    DS_SCALES_OFFSET,
    DS_TILE,
    DS_TILES,
    FP8_MAX,
    KV_FORMATS,
    LATENT_DIM,
    PAGE_LAYOUT,
    ROPE_DIM,
    checked_length,
    checked_page,
    fp8_cols,
    fp8_nan_fixup,
    indptr_is_partition,
    kv_format_width,
    report,
)
from pagedmla.kernels.triton.launch import BoundLaunch, CachedKernel, current_stream, unaligned_mask

_ROWS = 16  # rows per program: 16 x 576 x 2 bytes = 18 KB in flight
# Rows per program of the FP8 store, whose division and rounding per value make it ALU-latency bound: a
# decode step's 128 rows over 32 SMs, not 8.
_FP8_ROWS = 4
# ``dequantize_pages``' programs are (request, page): CUDA's limit on a grid's second dimension.
DEQUANT_MAX_WIDTH = 65535
# ``poison_bad_lengths``' programs per request: a bad request's rows (a prefill's thousands x heads x 128 values)
# are written by this many programs at once, a good request's leave after two loads.
_POISON_PROGRAMS = 32


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
def _fp8_bytes(x):
    """float32 values already divided by their scale as float8_e4m3fn bytes, rounded to nearest even and
    saturating at +-448 as ``kv_format.quantize_latent`` does (NaN stays NaN). In integer arithmetic, so
    that every backend gives the same bytes: Triton's interpreter rounds fp8 casts half up and truncates
    subnormals."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), FP8_MAX)
    # Below 2^-6 (subnormals, step 2^-9): a * 512 is exact and adding 2^23 rounds it to an integer, nearest
    # even; 8 (the carry into the smallest normal) is that normal's byte too.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    # Normals: the exponent rebiased (127 -> 7) and 23 mantissa bits rounded to 3, nearest even; a carry
    # out of the mantissa increments the exponent, as the byte's layout does by itself.
    abits = a.to(tl.int32, bitcast=True)
    keep = (abits >> 20) & 7
    rest = abits & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    normal = ((((abits >> 23) & 0xFF) - 120) << 3) + keep + up.to(tl.int32)
    q = tl.where(a < 0.015625, sub, normal)
    q = tl.where(x != x, 0x7F, q)
    return (q | sign).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """float32 values as bfloat16 bit patterns (int16, stored through an int16 pointer to the row's rope
    bytes), rounded to nearest even (the interpreter's cast rounds half up); NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _pow2_at_or_above(v):
    """The smallest power of two >= v, for positive normal float32 v: exact, where exp2(ceil(log2(v))) would
    depend on the device's approximate log2."""
    bits = v.to(tl.int32, bitcast=True)
    up = tl.where((bits & 0x007FFFFF) != 0, 0x00800000, 0)
    return ((bits & 0x7F800000) + up).to(tl.float32, bitcast=True)


@triton.jit
def _store_fp8_rows_kernel(buf_ptr, slots_ptr, rows_ptr, err_ptr, scale_ptr, n, num_slots, stride_buf, stride_rows,
                           D: tl.constexpr, D_MAIN: tl.constexpr, BLOCK_REST: tl.constexpr, ROWS: tl.constexpr,
                           KV_FMT: tl.constexpr, ERR: tl.constexpr):
    """``_store_rows_kernel`` into an FP8 cache's bytes (buf uint8 [num_slots, row bytes]), quantising on the
    way: KV_FMT 1 (fp8_e4m3) x / *scale_ptr; 2 (fp8_ds_mla, D = 576) the 656-byte row of
    ``pagedmla.kv_format``: per 128-column tile the power-of-two scale at or above max(amax / 448, 1e-4), the
    tile's values over it, the four scales, then the rope columns as bfloat16. Byte for byte what
    ``kv_format.quantize_latent`` writes (IEEE division, round to nearest even), NaN values excepted: those
    are stored as a NaN code of their own (torch's bfloat16 NaN differs by device).

    A row is read as its first D_MAIN columns (a power of two: 512 of 576) and the rest padded to BLOCK_REST,
    not padded whole to 1024: the division and the rounding are ALU work per value, and a few rows per
    program spread one step's rows over many SMs (benchmarks/NOTES.md, FP8: the store)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n
    slot = tl.load(slots_ptr + r, mask=live, other=0)
    ok = live & (slot >= 0) & (slot < num_slots)
    src = rows_ptr + r.to(tl.int64)[:, None] * stride_rows
    dst = buf_ptr + tl.where(ok, slot, 0).to(tl.int64)[:, None] * stride_buf
    cols = tl.arange(0, D_MAIN)[None, :]
    x = tl.load(src + cols, mask=live[:, None]).to(tl.float32)
    if KV_FMT == 1:
        scale = tl.load(scale_ptr)
        tl.store(dst + cols, _fp8_bytes(tl.math.div_rn(x, scale + tl.zeros_like(x))), mask=ok[:, None])
        if BLOCK_REST > 0:
            rest = D_MAIN + tl.arange(0, BLOCK_REST)[None, :]
            y = tl.load(src + rest, mask=live[:, None] & (rest < D)).to(tl.float32)
            tl.store(dst + rest, _fp8_bytes(tl.math.div_rn(y, scale + tl.zeros_like(y))), mask=ok[:, None] & (rest < D))
    else:
        tiles = tl.reshape(x, [ROWS, DS_TILES, DS_TILE])
        # NaN values leave their tile's amax alone on every backend (the GPU's max ignores NaN, the
        # interpreter's would propagate it): they are stored as NaN, the rest of the tile as without them.
        amax = tl.max(tl.where(tiles != tiles, 0.0, tl.abs(tiles)), axis=2)
        inv = tl.math.div_rn(amax, FP8_MAX + tl.zeros_like(amax))
        scales = _pow2_at_or_above(tl.maximum(inv, DS_MIN_SCALE_INV))  # [ROWS, 4]
        scaled = tl.math.div_rn(tiles, scales[:, :, None] + tl.zeros_like(tiles))
        q = _fp8_bytes(tl.reshape(scaled, [ROWS, LATENT_DIM]))
        tl.store(dst + cols, q, mask=ok[:, None])
        tile_ids = tl.arange(0, DS_TILES)[None, :]
        tl.store((dst + DS_SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + tile_ids, scales, mask=ok[:, None])
        rope = tl.arange(0, ROPE_DIM)[None, :]
        pe = tl.load(src + LATENT_DIM + rope, mask=live[:, None]).to(tl.float32)
        tl.store((dst + DS_ROPE_OFFSET).to(tl.pointer_type(tl.int16)) + rope, _bf16_bits(pe), mask=ok[:, None])
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
                            in_width, capacity, beyond, stride_table, stride_out, BLOCK_W: tl.constexpr,
                            ERR: tl.constexpr):
    i = tl.program_id(0)
    idx = tl.load(index_ptr + i).to(tl.int64)
    ok = (idx >= 0) & (idx < rows)
    cols = tl.arange(0, BLOCK_W)
    for c in range(0, width, BLOCK_W):
        m = c + cols < width
        pages = tl.load(table_ptr + tl.where(ok, idx, 0) * stride_table + c + cols, mask=m & ok & (c + cols < in_width),
                        other=0)
        tl.store(out_table_ptr + i * stride_out + c + cols, pages, mask=m)
    length = tl.load(lens_ptr + i)
    tl.store(out_lens_ptr + i, tl.where(ok, tl.where(length > capacity, beyond, length), -1))
    report(err_ptr, tl.where(ok, 0, ERR))


@triton.jit
def _dequantize_pages_kernel(kv_ptr, bt_ptr, lens_ptr, indptr_ptr, ws_ptr, ws_bt_ptr, err_ptr, batch, width, num_pages,
                             num_ws_pages, stride_btb, stride_page, stride_row, PAGE: tl.constexpr,
                             ROWS: tl.constexpr, COMPACT: tl.constexpr, KV_FMT: tl.constexpr,
                             NAN_FIXUP: tl.constexpr):
    # Program (b, j): page j of request b, into workspace page b * width + j, or with COMPACT page
    # indptr[b] + j while j is below request b's span indptr[b + 1] - indptr[b].
    b = tl.program_id(0)
    j = tl.program_id(1)
    slot = b.to(tl.int64) * width + j
    length, _ = checked_length(tl.load(lens_ptr + b), width * PAGE)
    ws_page = b * width + j
    if COMPACT:
        # Only a partition of the workspace keeps requests' spans apart (and its entries within 0 ..
        # num_ws_pages, so no sum below wraps); otherwise no request gets a page.
        first = tl.load(indptr_ptr + b)
        layout_ok = indptr_is_partition(indptr_ptr, batch, num_ws_pages, tl.arange(0, 1024))
        inside = layout_ok & (j < tl.load(indptr_ptr + b + 1) - first)
        ws_page = tl.where(inside, first + j, -1)
    if j * PAGE < length:
        page, bad = checked_page(tl.load(bt_ptr + b.to(tl.int64) * stride_btb + j), num_pages)
        if COMPACT:
            # A corrupt layout, or a device length past the pages the host said this request spans.
            report(err_ptr, tl.where(inside, 0, PAGE_LAYOUT))
            bad = bad | ~inside
        if bad:
            ws_page = -1  # the attention kernel's own page check poisons the rows that read it and reports it
        else:
            cols = tl.arange(0, LATENT_DIM)[None, :]
            rope = LATENT_DIM + tl.arange(0, ROPE_DIM)[None, :]
            for r0 in tl.static_range(0, PAGE, ROWS):
                r = r0 + tl.arange(0, ROWS)[:, None]
                rows = kv_ptr + page.to(tl.int64) * stride_page + r * stride_row
                out = ws_ptr + (ws_page.to(tl.int64) * PAGE + r) * (LATENT_DIM + ROPE_DIM)
                lat = fp8_cols(rows, 0, None, LATENT_DIM, KV_FMT, False, False, NAN_FIXUP)
                tl.store(out + cols, lat.to(ws_ptr.dtype.element_ty))
                pe = fp8_cols(rows, LATENT_DIM, None, ROPE_DIM, KV_FMT, True, False, NAN_FIXUP)
                tl.store(out + rope, pe.to(ws_ptr.dtype.element_ty))
    # Pages past the length keep their workspace page, or -1 (never read: the attention stops at the same length).
    tl.store(ws_bt_ptr + slot, ws_page)


@triton.jit
def _poison_lengths_kernel(out_ptr, indptr_ptr, lens_ptr, planned_ptr, err_ptr, capacity, width, stride_out,
                           BLOCK_W: tl.constexpr, MISMATCH: tl.constexpr):
    # Program (b, p): rows indptr[b] + p, + P, ... of request b, P the grid's second dimension.
    b = tl.program_id(0)
    p = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    _, bits = checked_length(length, capacity)
    bits = tl.where((bits == 0) & (length != tl.load(planned_ptr + b)), MISMATCH, bits)
    if bits != 0:
        if p == 0:
            report(err_ptr, bits)
        cols = tl.arange(0, BLOCK_W)
        nan = tl.full([BLOCK_W], float("nan"), out_ptr.dtype.element_ty)
        for r in range(tl.load(indptr_ptr + b) + p, tl.load(indptr_ptr + b + 1), tl.num_programs(1)):
            row = out_ptr + tl.cast(r, tl.int64) * stride_out
            for c in range(0, width, BLOCK_W):
                tl.store(row + c + cols, nan, mask=c + cols < width)


_STORE = CachedKernel(_store_rows_kernel)
_STORE_FP8 = CachedKernel(_store_fp8_rows_kernel)
_GATHER = CachedKernel(_gather_rows_kernel)
_SELECT = CachedKernel(_select_requests_kernel)
_DEQUANT_PAGES = CachedKernel(_dequantize_pages_kernel)
_POISON = CachedKernel(_poison_lengths_kernel)


# Bound launches of the kernels a step runs every layer (the backend's store, the MHA forms' length guard) per
# call shape and pointer alignment: False where binding does not apply.
_plans: dict[tuple, BoundLaunch | bool] = {}


def _launch_bound(kernel: CachedKernel, key: tuple, dev: torch.device, grid: tuple[int, ...], ptrs: tuple[int, ...],
                  args: tuple, options: dict) -> None:
    """``kernel`` over ``args``: through its ``BoundLaunch`` for ``key`` (which must hold every argument but the
    tensors' addresses ``ptrs``, in signature order, and the grid), bound on the first CUDA call of that key."""
    key = (kernel, *key, unaligned_mask(ptrs))
    plan = _plans.get(key)
    if plan:
        plan.launch(grid, current_stream(dev.index), ptrs)
        return
    if plan is None and dev.type == "cuda":
        if len(_plans) > 1024:
            _plans.clear()
        _plans[key] = kernel.bind(dev, grid, *args, **options) or False
    kernel.launch(dev, grid, *args, **options)


def store_rows(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, err_bit: int = errors.CACHE_SLOT) -> None:
    """buf[slots[i]] = rows[i] (cast to buf's dtype) for buf [num_slots, D], slots int [n], rows [n, D]
    (unit last strides); rows whose slot is outside 0 .. num_slots - 1 are skipped and set ``err_bit``."""
    n, d = rows.shape
    if n == 0:
        return
    dev = buf.device
    err = errors.error_word(dev)
    key = (buf.shape, buf.stride(), buf.dtype, rows.shape, rows.stride(), rows.dtype, slots.dtype, dev, err_bit)
    _launch_bound(_STORE, key, dev, (-(-n // _ROWS), 1, 1),
                  (buf.data_ptr(), slots.data_ptr(), rows.data_ptr(), err.data_ptr()),
                  (buf, slots, rows, err, n, buf.shape[0], buf.stride(0), rows.stride(0)),
                  dict(D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=_ROWS, ERR=err_bit, num_warps=4))


def store_fp8_rows(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: str,
                   k_scale: torch.Tensor | None = None, err_bit: int = errors.CACHE_SLOT) -> None:
    """buf[slots[i]] = quantize_latent(rows[i], fmt) for an FP8 cache's bytes: buf uint8 [num_slots,
    row bytes] (``kv_format.row_bytes``), slots int [n], rows float [n, D] (unit last stride; D = 576 for
    fp8_ds_mla), k_scale float32 [1] for fp8_e4m3 (read on the device). One launch, no host synchronisation;
    rows whose slot is outside 0 .. num_slots - 1 are skipped and set ``err_bit``."""
    n, d = rows.shape
    if fmt == "fp8_ds_mla" and d != kv_format.ROW_DIM:
        raise ValueError(f"rows: the fp8_ds_mla format stores {kv_format.ROW_DIM} columns, got {d}")
    if n == 0:
        return
    dev = buf.device
    d_main = 1 << (d.bit_length() - 1)
    rest = triton.next_power_of_2(d - d_main) if d > d_main else 0
    _STORE_FP8.launch(dev, (-(-n // _FP8_ROWS),), buf, slots, rows, errors.error_word(dev), k_scale, n,
                      buf.shape[0], buf.stride(0), rows.stride(0), D=d, D_MAIN=d_main, BLOCK_REST=rest,
                      ROWS=_FP8_ROWS, KV_FMT=KV_FORMATS[fmt], ERR=err_bit, num_warps=4)


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
                    out_lens: torch.Tensor, tokens_per_page: int, err_bit: int = errors.REQUEST_SLOT) -> None:
    """``pagedmla.rows.select_requests`` (which documents it) in one launch: table int32 [rows, >= 1], index int
    [n], lens int32 [n], out_table int32 [n, width], out_lens int32 [n]; a bad request slot sets ``err_bit``."""
    n, width = out_table.shape
    if n == 0:
        return
    in_width = min(width, table.shape[1])
    _SELECT.launch(table.device, (n,), table, index, lens, out_table, out_lens, errors.error_word(table.device), n,
                   table.shape[0], width, in_width, in_width * tokens_per_page, width * tokens_per_page + 1,
                   table.stride(0), out_table.stride(0), BLOCK_W=min(1024, triton.next_power_of_2(max(width, 16))),
                   ERR=err_bit, num_warps=4)


def poison_bad_lengths(out: torch.Tensor, indptr: torch.Tensor, lens: torch.Tensor, planned: torch.Tensor,
                       capacity: int, max_rows: int) -> None:
    """NaN into rows indptr[b] .. indptr[b + 1] - 1 of ``out`` for each request b whose device length ``lens[b]``
    is negative (setting ``errors.NEGATIVE_LENGTH``), above ``capacity`` (``errors.LENGTH_BEYOND_TABLE``) or
    else differs from ``planned[b]``, the length the host planned the call's work for (``errors.PAGE_LAYOUT``); the
    other rows are not touched. out [T, W] (unit last stride), indptr int32 [b + 1] (a partition of out's rows
    the caller built), lens and planned int32 [b]; ``max_rows`` (the host's longest request) sizes the grid.
    One launch, no host synchronisation."""
    if out.dim() != 2 or out.stride(1) != 1:
        raise ValueError(f"out: expected a 2-D tensor with unit last stride, got shape {tuple(out.shape)} and "
                         f"strides {out.stride()}")
    b = lens.shape[0]
    if b == 0:
        return
    dev = out.device
    err = errors.error_word(dev)
    width = out.shape[1]
    key = (width, out.stride(0), out.dtype, indptr.dtype, lens.dtype, planned.dtype, dev, capacity)
    _launch_bound(_POISON, key, dev, (b, max(1, min(max_rows, _POISON_PROGRAMS)), 1),
                  (out.data_ptr(), indptr.data_ptr(), lens.data_ptr(), planned.data_ptr(), err.data_ptr()),
                  (out, indptr, lens, planned, err, capacity, width, out.stride(0)),
                  dict(BLOCK_W=min(1024, triton.next_power_of_2(max(width, 16))), MISMATCH=errors.PAGE_LAYOUT,
                       num_warps=4))


def dequantize_pages(k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, fmt: str,
                     dtype: torch.dtype, kv_page_indptr: torch.Tensor | None = None,
                     num_kv_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages an FP8 cache's block table references, dequantised into a workspace of their own: (cache
    ``dtype`` [ws_pages, page_size, 1, 576], block table int32 [b, width]) for k_cache uint8 / float8
    [num_pages, page_size, 1, row bytes] in format ``fmt`` (``pagedmla.kv_format``), block_table int32
    [b, width], cache_seqlens int32 [b] (read on the device).

    Request b's page j (for j * page_size below its length) goes to workspace page b * width + j (ws_pages =
    b * width), or with ``kv_page_indptr`` (int32 [b + 1] on the cache's device: request b spans pages
    kv_page_indptr[b] .. kv_page_indptr[b + 1] - 1) and ``num_kv_pages`` (its last value, known on the host)
    to page kv_page_indptr[b] + j (ws_pages = num_kv_pages): a batch of one long request among short ones
    then takes the pages its lengths span, not b x the longest. The returned table names each: fp8_ds_mla
    rows as their values (fp8 x the power-of-two tile scale, exact in bf16), fp8_e4m3 rows as their fp8
    values *without* k_scale (exact; the attention kernel folds the scale in). A page id outside the cache,
    a page past the span kv_page_indptr gives its request (a device length beyond the host's), or any page
    under a kv_page_indptr that is not a partition of the num_kv_pages pages (0 first, non-decreasing,
    num_kv_pages last; the last two set ``errors.PAGE_LAYOUT``) names page -1 in the returned table, so that
    the attention kernel's page check handles it as it would in the cache's own table; the workspace pages
    past a length are left unwritten and never read. One launch, no host synchronisation."""
    b, width = block_table.shape
    page = k_cache.shape[1]
    d = kv_format.ROW_DIM
    if k_cache.shape[2:] != (1, kv_format_width(fmt, d)):
        raise ValueError(f"k_cache: expected [num_pages, page_size, 1, {kv_format_width(fmt, d)}] for {fmt}, got "
                         f"{tuple(k_cache.shape)}")
    if width > DEQUANT_MAX_WIDTH:
        raise ValueError(f"block_table: at most {DEQUANT_MAX_WIDTH} pages per request, got {width}")
    compact = kv_page_indptr is not None
    checks.page_layout(kv_page_indptr, num_kv_pages, b, k_cache.device)
    ws_pages = num_kv_pages if compact else b * width
    kv_page_indptr = kv_page_indptr.contiguous() if compact else cache_seqlens  # (the kernel skips it unless compact)
    ws = torch.empty(ws_pages, page, 1, d, dtype=dtype, device=k_cache.device)
    ws_table = torch.empty(b, width, dtype=torch.int32, device=k_cache.device)
    if b and width:
        kv = k_cache.view(torch.uint8)
        kv = kv if kv.stride(3) == 1 else kv.contiguous()
        _DEQUANT_PAGES.launch(k_cache.device, (b, width), kv, block_table, cache_seqlens, kv_page_indptr, ws,
                              ws_table, errors.error_word(k_cache.device), b, width, k_cache.shape[0], ws_pages,
                              block_table.stride(0), kv.stride(0), kv.stride(1), PAGE=page, ROWS=min(page, _ROWS),
                              COMPACT=compact, KV_FMT=KV_FORMATS[fmt], NAN_FIXUP=fp8_nan_fixup(), num_warps=4)
    return ws, ws_table
