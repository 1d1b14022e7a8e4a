"""Hopper (sm_90a) variable-q-length paged absorbed attention in Gluon: the decode kernel's structure for
prefill over a cached prefix.

Work tiles as in ``paged_varlen.py``: 64 (token, head) rows of one request over all the keys its rows may
see (request b's tiles start at ``qo_indptr[b] * H // 64 + b``, found by binary search). Each tile runs the
decode kernel's partitions and steps (``sm90/decode.py``, ``sm90/mla.py``): a TMA loader warp, warpgroup 0
computing S once per 64-key tile and the online softmax, both warpgroups accumulating half of the 512 value
columns from the shared P. No split of the keys, so no partials: each tile writes its rows' output and LSE directly,
each warpgroup's half of the output through its own columns of the tile's last KV slot, so that rows go out in
128-byte lines (``_store_rows``).

The kernel is persistent: one program per SM, whose loader claims tiles from a global counter (last tile
first: requests from the last, and within a request the heaviest causal tiles first; the tiles in flight
share one request's keys in L2) and hands each to the warpgroups through shared memory once the current
tile's loads are issued. The next tile's search, Q and first KV tiles then load while the warpgroups
finish the current one, instead of each tile paying a program's start (search, Q and first KV round
trips) with the tensor cores idle.

``paged_varlen_attention`` picks it on sm_90 wherever ``sm90_supported`` holds, the H200 measurements in
benchmarks/NOTES.md (Prefill) having put it ahead of the portable kernel there.
"""

from __future__ import annotations

import torch

from pagedmla import errors
from pagedmla.device import sm_count
from pagedmla.kernels.triton.common import (
    _LN2,
    BLOCK_TABLE,
    LOG2E,
    QUERY_INDPTR,
    checked_length,
    indptr_is_partition,
    report,
)
from pagedmla.kernels.triton.launch import CachedKernel, current_stream
from pagedmla.kernels.triton.sm90 import mla
from pagedmla.kernels.triton.sm90.mla import BLOCK_M, D_V, mla_descriptors, sm90_supported
from pagedmla.kernels.triton.sm90.pipeline import HAVE_GLUON, MAX_TILES, tma_rows
from pagedmla.kernels.triton.steps import paged_tile

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from pagedmla.kernels.triton.sm90.pipeline import (
        ONE_WARP,
        WARPGROUP,
        claim_tile,
        free_phase,
        phase,
        receive_fields,
        release_staged,
        restage,
    )

if HAVE_GLUON:

    @gluon.jit
    def _tile_work(tile, qo_ptr, seqlens_ptr, H, batch, capacity, CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        """Work tile ``tile`` (request-major numbering): (request, its first flat q row, rows r0 .. r0 + 63 of
        its q_len * H, q_len, kv_len clamped to 0 .. capacity, the error bits of its length, end of the keys any
        row of the tile sees). Needs qo_indptr to be a partition of the rows (the caller checks)."""
        b, q_start, q_len, r0 = paged_tile(tile, qo_ptr, H, batch, mla._BM, SEARCH_STEPS)
        n_rows = q_len * H
        kv_len, bits = checked_length(gl.load(seqlens_ptr + b), capacity)
        if CAUSAL:
            # Token t of the request sees keys 0 .. kv_len - q_len + t.
            last_tok = (gl.minimum(r0 + mla._BM, n_rows) - 1) // H
            end = gl.maximum(gl.minimum(kv_len, kv_len - q_len + last_tok + 1), 0)
        else:
            end = kv_len
        return b, q_start * H, r0, q_len, kv_len, bits, end

    @gluon.jit
    def _rows_ok(qo_ptr, batch, T_rows, layout: gl.constexpr):
        """Whether qo_indptr partitions the q rows; each partition checks it once, reading pieces of the
        partition's width (``layout``); every program reads the same values, so all agree."""
        return indptr_is_partition(qo_ptr, batch, T_rows, gl.arange(0, 32 * layout.warps_per_cta[0], layout=layout))

    @gluon.jit
    def _publish_tile(i, counter, T, qo_ptr, seqlens_ptr, H, batch, capacity, tile_info, tile_ready, tile_free,
                      CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        """Loader: claim the next tile from the global counter and hand it to the warpgroups as their i-th
        (slot i % 2: claim index, first flat q row, r0, q_len, kv_len, length error bits, end, a spare word).
        Claims run from the last tile down: within a request, the heaviest causal tiles first. Returns
        (request, first flat q row of the tile, end of its keys: 0 when the tile loads nothing, -1 past the
        last tile)."""
        s = i % 2
        mbarrier.wait(tile_free.index(s), free_phase(i, 2))
        slot = tile_info.index(s)
        claim = claim_tile(counter, tile_info, s)
        # Past the last tile the bounds are tile 0's (in range); the warpgroups then only read the claim index.
        b, row0, r0, q_len, kv_len, bits, end = _tile_work(gl.maximum(T - 1 - claim, 0), qo_ptr, seqlens_ptr, H,
                                                           batch, capacity, CAUSAL, SEARCH_STEPS)
        k = gl.arange(0, 8, layout=ONE_WARP)
        slot.store(gl.where(k == 0, claim, gl.where(k == 1, row0, gl.where(k == 2, r0, gl.where(
            k == 3, q_len, gl.where(k == 4, kv_len, gl.where(k == 5, bits, gl.where(k == 6, end, 0))))))))
        gl.thread_barrier()
        mbarrier.arrive(tile_ready.index(s), count=1)
        return b, row0 + r0, gl.where(claim < T, gl.where(r0 < q_len * H, end, 0), -1)

    @gluon.jit
    def _receive_tile(i, tile_info, tile_ready, tile_free):
        """A warpgroup's i-th tile as the loader published it (``_publish_tile``'s seven fields)."""
        return receive_fields(i, tile_info, tile_ready, tile_free, WARPGROUP)

    @gluon.jit
    def _store_rows(o, scale, lse2, col0, out_ptr, lse_ptr, row0, r0, n_rows, WRITE_LSE: gl.constexpr,
                    layout: gl.constexpr, staged=False, kv=None, kv_free=None):
        """Columns col0 .. col0 + 255 of rows r0 .. r0 + 63 (of n_rows), normalised, at flat rows row0 + r of
        out [T * H, 512]; with WRITE_LSE the natural-log LSE at lse[row0 + r]. ``staged``: through the same
        columns of the tile's last KV slot ``kv`` (``restage``; only this warpgroup still reads them there),
        then frees the slot (``kv_free``)."""
        r = r0 + gl.arange(0, mla._BM, layout=gl.SliceLayout(1, layout))
        flat = row0.to(gl.int64) + r
        ok = r < n_rows
        y = (o * scale[:, None]).to(out_ptr.dtype.element_ty)
        if staged:
            rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
            x = restage(kv.slice(col0, 256, dim=1), y, rows_l)
            rs = r0 + gl.arange(0, mla._BM, layout=gl.SliceLayout(1, rows_l))
            cs = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, rows_l))
            gl.store(out_ptr + (row0.to(gl.int64) + rs)[:, None] * mla._DV + cs[None, :], x,
                     mask=(rs < n_rows)[:, None])
            release_staged(kv_free)
        else:
            cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, layout))
            gl.store(out_ptr + flat[:, None] * mla._DV + cols[None, :], y, mask=ok[:, None])
        if WRITE_LSE:
            gl.store(lse_ptr + flat, lse2 * _LN2, mask=ok)

    @gluon.jit
    def _poison_tiles(col0, out_ptr, lse_ptr, T, rows, WRITE_LSE: gl.constexpr, layout: gl.constexpr):
        """Without a partition of the q rows (``_rows_ok``) a warpgroup writes NaN into its columns of the flat
        rows 64 t .. 64 t + 63 of each tile t = program, program + programs, ... (the tiles cover every row)."""
        nan = gl.full([mla._BM, 256], float("nan"), gl.float32, layout)
        nan_rows = gl.full([mla._BM], float("nan"), gl.float32, gl.SliceLayout(1, layout))
        for t in range(gl.program_id(0), T, gl.num_programs(0)):
            _store_rows(nan, nan_rows, nan_rows, col0, out_ptr, lse_ptr, t * 0, t * mla._BM, rows, WRITE_LSE, layout)

    @gluon.jit
    def _prefill_loader(q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, seqlens_ptr, qo_ptr, counter, T,
                        H, batch, T_rows, capacity, num_pages, q_smem, q_pe_smem, kv_ring, kv_pe_ring, tile_info,
                        tile_ready, tile_free, q_ready, q_free, kv_ready, kv_empty, page_flags, CAUSAL: gl.constexpr,
                        PAGE: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        if _rows_ok(qo_ptr, batch, T_rows, ONE_WARP):
            b, q_row, end = _publish_tile(0, counter, T, qo_ptr, seqlens_ptr, H, batch, capacity, tile_info,
                                          tile_ready, tile_free, CAUSAL, SEARCH_STEPS)
            i = 1
            nq = 0
            it = 0
            while end >= 0:
                if end > 0:
                    # Q of the previous tile stays until warpgroup 0's last S of it is done.
                    mbarrier.wait(q_free, free_phase(nq, 1))
                    mla.load_q(q_desc, q_pe_desc, q_row, q_smem, q_pe_smem, q_ready)
                    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
                    it = mla.load_kv_tiles(kv_desc, kv_pe_desc, bt_row, gl.load(bt_row), 0, end, it, kv_ring,
                                           kv_pe_ring, kv_ready, kv_empty, page_flags.index(nq % 2), num_pages,
                                           PAGE)
                    nq += 1
                # The next tile is claimed once this one's loads are all issued (the warpgroups are then about
                # two KV tiles from its end): late enough that a program never sits on a claimed tile it has not
                # started while others run out of work, early enough for the search to finish before it is needed.
                b, q_row, end = _publish_tile(i, counter, T, qo_ptr, seqlens_ptr, H, batch, capacity, tile_info,
                                              tile_ready, tile_free, CAUSAL, SEARCH_STEPS)
                i += 1

    @gluon.jit
    def _prefill_softmax_warpgroup(
        q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, tile_info, tile_ready, tile_free, q_ready,
        q_free, kv_ready, kv_empty, p_ready, p_free, page_flags, out_ptr, lse_ptr, qo_ptr, err_ptr, batch, T_rows, T,
        H, qk_scale, kv_scale_ptr, CAUSAL: gl.constexpr, KV_SCALED: gl.constexpr,
    ):
        s_layout: gl.constexpr = mla.S_LAYOUT
        v_scale = mla.kv_scale(kv_scale_ptr, KV_SCALED)
        qk_scale = qk_scale * v_scale
        o_layout: gl.constexpr = mla.O_LAYOUT
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        if not _rows_ok(qo_ptr, batch, T_rows, WARPGROUP):
            _poison_tiles(0, out_ptr, lse_ptr, T, T_rows * H, True, o_layout)
            if gl.program_id(0) == 0:
                report(err_ptr, QUERY_INDPTR)
        else:
            i = 0
            nq = 0
            it = 0
            npm = 0
            claim = 0
            while claim < T:
                claim, row0, r0, q_len, kv_len, bits, end = _receive_tile(i, tile_info, tile_ready, tile_free)
                i += 1
                n_rows = q_len * H
                if (claim < T) & (r0 < n_rows):
                    first_masked = kv_len
                    if CAUSAL:
                        tok = (r0 + gl.arange(0, mla._BM, layout=row_l)) // H
                        lim = gl.minimum(kv_len - q_len + 1 + tok, kv_len)
                        first_masked = gl.minimum(gl.maximum(kv_len - q_len + r0 // H + 1, 0), kv_len)
                    else:
                        lim = gl.zeros([mla._BM], dtype=gl.int32, layout=row_l) + kv_len
                    if end > 0:
                        mbarrier.wait(q_ready, phase(nq, 1))
                        nq += 1
                    o, m_i, l_i, it, npm = mla.softmax_tiles(it, npm, 0, end, first_masked, lim, kv_len, qk_scale,
                                                             q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem,
                                                             scale_smem, q_free, kv_ready, kv_empty, p_ready, p_free,
                                                             s_layout, o_layout, True)
                    if end > 0:  # the loader's page check of this tile's keys (nq counted its Q load)
                        bits = bits | gl.where(mla.pages_ok(page_flags.index((nq - 1) % 2)), 0, BLOCK_TABLE)
                    if r0 == 0:
                        report(err_ptr, bits)
                    inv_l, lse2 = mla.softmax_finish(m_i, l_i, qk_scale, bits != 0, npm, scale_smem, p_ready, p_free)
                    npm += 1
                    _store_rows(o, gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)) * v_scale,
                                gl.convert_layout(lse2, gl.SliceLayout(1, o_layout)), 0, out_ptr, lse_ptr, row0, r0,
                                n_rows, True, o_layout, end > 0, kv_ring.index((it - 1) % mla._STAGES),
                                kv_empty.index((it - 1) % mla._STAGES))

    @gluon.jit
    def _prefill_value_warpgroup(kv_ring, p_smem, scale_smem, tile_info, tile_ready, tile_free, kv_ready, kv_empty,
                                 p_ready, p_free, out_ptr, lse_ptr, qo_ptr, batch, T_rows, T, H, kv_scale_ptr,
                                 KV_SCALED: gl.constexpr):
        o_layout: gl.constexpr = mla.O_LAYOUT
        v_scale = mla.kv_scale(kv_scale_ptr, KV_SCALED)
        if not _rows_ok(qo_ptr, batch, T_rows, WARPGROUP):
            _poison_tiles(256, out_ptr, lse_ptr, T, T_rows * H, False, o_layout)
        else:
            i = 0
            it = 0
            npm = 0
            claim = 0
            while claim < T:
                claim, row0, r0, q_len, kv_len, _, end = _receive_tile(i, tile_info, tile_ready, tile_free)
                i += 1
                if (claim < T) & (r0 < q_len * H):
                    o, inv_l, it, npm = mla.value_tiles(it, npm, 0, end, kv_len, kv_ring, p_smem, scale_smem, kv_ready,
                                                        kv_empty, p_ready, p_free, o_layout, True)
                    _store_rows(o, inv_l * v_scale, inv_l, 256, out_ptr, lse_ptr, row0, r0, q_len * H, False, o_layout,
                                end > 0, kv_ring.index((it - 1) % mla._STAGES), kv_empty.index((it - 1) % mla._STAGES))

    @gluon.jit
    def _paged_varlen_sm90_kernel(
        q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, seqlens_ptr, qo_ptr, out_ptr, lse_ptr, counter, err_ptr,
        T, H, batch, T_rows, qk_scale, stride_btb, max_pages, num_pages, kv_scale_ptr,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, SEARCH_STEPS: gl.constexpr, KV_SCALED: gl.constexpr,
    ):
        (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, p_ready, p_free, kv_ready,
         kv_empty, page_flags) = mla.mla_buffers(q_desc, q_pe_desc, q_desc.dtype)
        tile_info = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        tile_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for s in gl.static_range(2):
            mbarrier.init(tile_ready.index(s), count=1)
            mbarrier.init(tile_free.index(s), count=2)  # one arrive per warpgroup
        capacity = max_pages * PAGE
        gl.warp_specialize(
            [(_prefill_softmax_warpgroup, (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, tile_info,
                                           tile_ready, tile_free, q_ready, q_free, kv_ready, kv_empty, p_ready, p_free,
                                           page_flags, out_ptr, lse_ptr, qo_ptr, err_ptr, batch, T_rows, T, H,
                                           qk_scale, kv_scale_ptr, CAUSAL, KV_SCALED)),
             (_prefill_value_warpgroup, (kv_ring, p_smem, scale_smem, tile_info, tile_ready, tile_free, kv_ready,
                                         kv_empty, p_ready, p_free, out_ptr, lse_ptr, qo_ptr, batch, T_rows, T, H,
                                         kv_scale_ptr, KV_SCALED)),
             (_prefill_loader, (q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, seqlens_ptr, qo_ptr,
                                counter, T, H, batch, T_rows, capacity, num_pages, q_smem, q_pe_smem, kv_ring,
                                kv_pe_ring, tile_info, tile_ready, tile_free, q_ready, q_free, kv_ready, kv_empty,
                                page_flags, CAUSAL, PAGE, SEARCH_STEPS))],
            worker_num_warps=[4, 1],
            worker_num_regs=[232, 32],
        )

    _MAIN = CachedKernel(_paged_varlen_sm90_kernel)


def _main_args(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               qo_indptr: torch.Tensor, softmax_scale: float, causal: bool, out: torch.Tensor, lse: torch.Tensor,
               counter: torch.Tensor, programs: int | None, kv_scale: torch.Tensor | None) -> tuple:
    """(grid, args, options) of the kernel's launch, for ``_MAIN.launch`` or ``_MAIN.bind``."""
    t, h, d = q.shape
    batch = qo_indptr.shape[0] - 1
    tiles = (t * h) // BLOCK_M + batch
    grid = (min(tiles, sm_count(q.device), programs or tiles),)
    args = (*mla_descriptors(tma_rows(q.reshape(t * h, d)), k_cache.view(-1, d)),
            block_table, cache_seqlens, qo_indptr, out, lse, counter, errors.error_word(q.device),
            tiles, h, batch, t, softmax_scale * LOG2E, block_table.stride(0), block_table.shape[1], k_cache.shape[0],
            kv_scale)
    options = dict(KV_SCALED=kv_scale is not None, CAUSAL=bool(causal), PAGE=k_cache.shape[1],
                   SEARCH_STEPS=max(1, batch.bit_length()), num_warps=4)
    return grid, args, options


def paged_varlen_sm90(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                       cache_seqlens: torch.Tensor, qo_indptr: torch.Tensor, softmax_scale: float, causal: bool,
                       out: torch.Tensor, lse: torch.Tensor, programs: int | None = None,
                       kv_scale: torch.Tensor | None = None) -> None:
    """Launch on checked inputs (``paged_varlen_attention`` checks them): q [T, H, 576], out [T, H, 512]
    contiguous, lse [T, H] float32; requires ``sm90_supported(q, k_cache, 512)``. kv_scale: float32 [1] the
    cache rows' common scale, read on the device (value = row x kv_scale), or None. One program per SM
    (``programs``, if given, caps the grid: tests use it to make each program run many tiles). Each call
    zeroes its own tile counter (one small memset on the stream), so concurrent calls on other streams and
    CUDA-graph replays do not share it."""
    if not sm90_supported(q, k_cache, D_V):
        raise ValueError("config: use_sm90 needs an sm_90 GPU, Triton's Gluon, bf16/fp16 q and cache, head dims "
                         "576/512, pages a multiple of 64 and a contiguous cache")
    t, h, d = q.shape
    batch = qo_indptr.shape[0] - 1
    tiles = (t * h) // BLOCK_M + batch
    if t * h >= 2 ** 31 or tiles >= MAX_TILES:
        raise ValueError(f"q: {t} tokens x {h} heads over {batch} requests; the Hopper kernel's row and tile "
                         f"arithmetic is int32 (fewer than 2**31 rows and {MAX_TILES} tiles; the portable kernel "
                         "has no such limit)")
    if programs is not None and programs < 1:
        raise ValueError(f"programs: expected at least 1, got {programs}")
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    grid, args, options = _main_args(q, k_cache, block_table, cache_seqlens, qo_indptr, softmax_scale, causal, out,
                                     lse, counter, programs, kv_scale)
    _MAIN.launch(q.device, grid, *args, **options)


def bind_paged_varlen_sm90(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, qo_indptr: torch.Tensor, softmax_scale: float, causal: bool,
                           out: torch.Tensor, lse: torch.Tensor) -> tuple | None:
    """``paged_varlen_sm90``'s launch (16-bit cache, all SMs) bound for calls shaped like this one, whose
    checks it has passed: (BoundLaunch, grid), for ``launch_bound_paged_varlen_sm90``; None where binding does
    not apply (q rows that ``tma_rows`` would copy, off CUDA, another Triton)."""
    if not q.is_contiguous() or q.data_ptr() % 16:
        return None
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    grid, args, options = _main_args(q, k_cache, block_table, cache_seqlens, qo_indptr, softmax_scale, causal, out,
                                     lse, counter, None, None)
    bound = _MAIN.bind(q.device, grid, *args, **options)
    return None if bound is None else (bound, (*grid, 1, 1))


def launch_bound_paged_varlen_sm90(bound: tuple, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                                   cache_seqlens: torch.Tensor, qo_indptr: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor) -> None:
    """Launch a ``bind_paged_varlen_sm90`` result on tensors shaped, strided and typed as the bound call's,
    with 16-byte aligned addresses (what its kernel was compiled for; the caller checks): the launch with
    addresses as integers and cached tensor maps, no descriptor objects or specialisation key."""
    launch, grid = bound
    dev = q.device
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    qp, kp = q.data_ptr(), k_cache.data_ptr()
    ptrs = (block_table.data_ptr(), cache_seqlens.data_ptr(), qo_indptr.data_ptr(), out.data_ptr(), lse.data_ptr(),
            counter.data_ptr(), errors.error_word(dev).data_ptr())
    launch.launch(grid, current_stream(dev.index), ptrs, (qp, qp, kp, kp))
