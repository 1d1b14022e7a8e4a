"""Hopper (sm_90a) MLA decode main kernel in Gluon: TMA loads, warp specialisation, warpgroup MMAs.

Same contract, metadata, work split and partial format as the portable kernel in ``decode.py`` (whose
combine kernel finishes the split requests); this one replaces its main kernel on sm_90 GPUs for 64-row
tiles, where the portable kernel reaches only 29-38% of the tensor-core peak (benchmarks/NOTES.md).

Structure per program (64 query rows x one SM part), FlashMLA's (the steps are ``mla.py``'s):
- a loader warp streams each request's Q tile and its [64, 576] KV tiles through a two-stage shared-memory
  ring (TMA; block shapes must be powers of two, so each tile is a [64, 512] and a [64, 64] copy, which
  Gluon splits into 64-column boxes; at L2 evict-first, put into the PTX by ``pipeline.tma_loads_evict_first``);
- warpgroup 0 computes S = Q K^T for the whole 64 x 64 tile (36 wgmma k-steps), the online softmax, writes
  P (bf16/fp16) and the per-row rescale factor to shared memory, and accumulates O[:, :256] += P V[:, :256];
- warpgroup 1 accumulates O[:, 256:] += P V[:, 256:] from the same shared P, so S is computed once and
  warpgroup 1's MMAs run while warpgroup 0 computes the next S and softmax.
Each KV tile is the key (576 columns) and the value (its first 512) of one load. The last tile of a
sequence may hold unused cache slots (NaN-poisoned in the tests): their scores are masked and their value
rows are zeroed in shared memory before P V (0 * NaN would poison the output).

The decode plan runs it for requests of fewer than ``seesaw.SEESAW_MIN_ROWS`` (128) query rows, the
memory-bound ones; from 128 rows ``seesaw.py``'s kernel, where each warpgroup's softmax overlaps the other's
MMAs, is faster (benchmarks/NOTES.md, decode v18).

``TRANSPOSED`` (the narrow form, ``DecodeConfig(block_m=16 | 32, use_sm90=True)``) runs ``mla.py``'s transposed
steps over a Q tile of 16 or 32 rows for requests of at most that many: no MMA padded to 64 query rows. It is
the default for requests of up to 32 rows (``split_plan.NARROW_ROWS``), one part per SM: on an H100 it beat
the portable kernel's two 16-row programs per SM by 1-6% and the 64-row tiles at 17-32 rows by 1-2%
(benchmarks/NOTES.md, "The narrow form").

Over an FP8 cache ``decode_fp8.py`` runs the same two warpgroups (``KV_FMT`` > 0: its scales enter the
scores and the outputs) on a ring its converter fills.

Requirements (``mla.sm90_supported`` checks them): CUDA capability 9.0, Triton with Gluon, q and cache bf16 or
fp16, head dims 576 / 512, page size a multiple of 64, a contiguous cache, 64-row tiles (16 or 32 in the
narrow form).
"""

from __future__ import annotations

from pagedmla.kernels.triton.common import (
    _LN2,
    BLOCK_TABLE,
    LOG2E,
    PARTIALS_EVICTION,
    SCHEDULE,
    partials_views,
    report,
    wait_prior_options,
)
from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.kernels.triton.metadata import part_bounds, request_span, schedule_matches
from pagedmla.kernels.triton.sm90 import mla
from pagedmla.kernels.triton.sm90.mla import BLOCK_M, D_QK, mla_descriptors
from pagedmla.kernels.triton.sm90.pipeline import HAVE_GLUON, tma_loads_evict_first
from pagedmla.split_plan import METADATA_WIDTH

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from pagedmla.kernels.triton.sm90.pipeline import (
        WARPGROUP,
        free_phase,
        launch_dependents,
        phase,
        wait_prior_grids,
    )


if HAVE_GLUON:

    @gluon.jit
    def _piece(splits_ptr, b, begin_req, begin_split, PIECES):
        """(whether request b is in one piece, so its result goes straight to out; the partial row of this
        part's piece of it, clamped into the PIECES rows) from ``num_splits`` and the part's first split."""
        s_lo = gl.load(splits_ptr + b)
        is_direct = gl.load(splits_ptr + b + 1) - s_lo == 1
        return is_direct, gl.minimum(s_lo + gl.where(b == begin_req, begin_split, 0), PIECES - 1)

    @gluon.jit
    def _store_half(o, scale, lse2, col0, is_direct, out_ptr, lse_ptr, partials_ptr, PIECES, b, piece, pid_m,
                    H, Q_LEN, ROWS, stride_ob, stride_ot, stride_oh, WRITE_LSE: gl.constexpr,
                    layout: gl.constexpr, TRANSPOSED: gl.constexpr = False, OUT_TYPED: gl.constexpr = False):
        """Columns col0 .. col0 + 255 of the tile's result: normalised into ``out`` (and LSE, natural log)
        when the request is in one piece, else into the partial row ``piece`` (and log2 LSE) of the partials
        buffer (``common.partials_views``): fp32 values, or with ``OUT_TYPED`` out's 16-bit type (half the
        bytes for the combine to read; 7-11% slower at batch 1-8, benchmarks/NOTES.md decode v22, so the plan
        takes it for many requests only). ``TRANSPOSED``: o is O^T [256, rows] (``mla.py``); a store then
        writes 8 consecutive columns of 4 rows, whole 32-byte sectors of the fp32 partials."""
        KD: gl.constexpr = mla.key_dim(TRANSPOSED)
        R: gl.constexpr = o.shape[1 - KD]
        rows = pid_m * R + gl.arange(0, R, layout=gl.SliceLayout(KD, layout))
        cols = gl.expand_dims(col0 + gl.arange(0, 256, layout=gl.SliceLayout(1 - KD, layout)), 1 - KD)
        row_ok = rows < ROWS
        o = o * gl.expand_dims(scale, KD)
        if is_direct:
            t = rows // H
            h = rows % H
            o_row = b.to(gl.int64) * stride_ob + t.to(gl.int64) * stride_ot + h * stride_oh
            gl.store(out_ptr + gl.expand_dims(o_row, KD) + cols, o.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(row_ok, KD))
            if WRITE_LSE:
                gl.store(lse_ptr + b.to(gl.int64) * ROWS + h * Q_LEN + t, lse2 * _LN2, mask=row_ok)
        else:
            _, pval_ptr, plse_ptr = partials_views(partials_ptr, out_ptr, PIECES, ROWS, mla._DV, OUT_TYPED)
            p_row = piece.to(gl.int64) * ROWS + rows
            gl.store(pval_ptr + gl.expand_dims(p_row, KD) * mla._DV + cols, o.to(pval_ptr.dtype.element_ty),
                     mask=gl.expand_dims(row_ok, KD), eviction_policy=PARTIALS_EVICTION)
            if WRITE_LSE:
                gl.store(plse_ptr + p_row, lse2, mask=row_ok, eviction_policy=PARTIALS_EVICTION)

    @gluon.jit
    def slice_start(bt_ptr, stride_btb, seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk, CAPACITY,
                    PAGE: gl.constexpr):
        """Loader: (block-table row, first page id, first token, end token) of request b's slice of a part.
        The first page id does not depend on the length: it loads alongside it (masked: an empty slice may
        start past the row's last entry)."""
        bt_row = bt_ptr + b.to(gl.int64) * stride_btb
        first = gl.where(b == begin_req, begin_blk, 0) * mla._BN // PAGE
        first_page = gl.load(bt_row + first, mask=first * PAGE < CAPACITY, other=0)
        _, tok_lo, tok_hi, _ = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk, CAPACITY,
                                            mla._BN)
        return bt_row, first_page, tok_lo, tok_hi

    @gluon.jit
    def schedule_verdict(seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS):
        """Loader of (m-tile 0, part 0), once its loads are issued (it has nothing else to do while the
        warpgroups finish): whether the metadata describes these lengths, into the partials buffer's verdict
        word (``common.partials_views``) for the combine, and the error word."""
        if (gl.program_id(0) == 0) & (gl.program_id(1) == 0):
            lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
            ok = schedule_matches(seqlens_ptr, meta_ptr, splits_ptr, B, PARTS, lanes, mla._BN)
            gl.store(partials_ptr, gl.where(ok, 1.0, 0.0))
            report(err_ptr, gl.where(ok, 0, SCHEDULE))

    @gluon.jit
    def _loader(q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, CAPACITY, num_pages, seqlens_ptr,
                meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_smem, q_pe_smem, kv_ring, kv_pe_ring,
                q_ready, q_free, kv_ready, kv_empty, page_flags, PAGE: gl.constexpr, META_W: gl.constexpr):
        q_row0 = gl.program_id(0) * q_smem.shape[0]
        begin_req, begin_blk, end_req, end_blk, _ = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        it = 0
        nq = 0
        for b in range(begin_req, end_req + 1):
            bt_row, first_page, tok_lo, tok_hi = slice_start(bt_ptr, stride_btb, seqlens_ptr, b, begin_req,
                                                             begin_blk, end_req, end_blk, CAPACITY, PAGE)
            if tok_lo < tok_hi:
                # Q of the previous request stays until warpgroup 0's last S of it is done.
                mbarrier.wait(q_free, free_phase(nq, 1))
                mla.load_q(q_desc, q_pe_desc, b * ROWS + q_row0, q_smem, q_pe_smem, q_ready)
                it = mla.load_kv_tiles(kv_desc, kv_pe_desc, bt_row, first_page, tok_lo, tok_hi, it, kv_ring,
                                       kv_pe_ring, kv_ready, kv_empty, page_flags.index(nq % 2), num_pages, PAGE)
                nq += 1
        schedule_verdict(seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS)

    @gluon.jit
    def _softmax_warpgroup(
        q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, kv_ready, kv_empty,
        p_ready, p_free, page_flags, PIECES, CAPACITY, seqlens_ptr, meta_ptr, splits_ptr, out_ptr,
        lse_ptr, partials_ptr, err_ptr, B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_ob, stride_ot, stride_oh,
        kv_scale_ptr, q_scale_smem, CAUSAL: gl.constexpr, PAGE: gl.constexpr, META_W: gl.constexpr,
        KV_FMT: gl.constexpr, TRANSPOSED: gl.constexpr = False, OUT_TYPED: gl.constexpr = False,
    ):
        # An FP8 cache (KV_FMT > 0, ``decode_fp8.py``): the power of two that took each Q tile into fp16
        # (``q_scale_smem``) and fp8_e4m3's |scale| multiply the scores; the scale multiplies the outputs.
        # TRANSPOSED: S^T and O^T over a Q tile of 16 or 32 rows (``mla.py``), one tile per request.
        v_scale = mla.kv_scale(kv_scale_ptr, KV_FMT == 1)
        R: gl.constexpr = q_smem.shape[0]
        if TRANSPOSED:
            s_layout: gl.constexpr = mla.transposed_layout(R)
            o_layout: gl.constexpr = mla.transposed_layout(R)
        else:
            s_layout: gl.constexpr = mla.S_LAYOUT
            o_layout: gl.constexpr = mla.O_LAYOUT
        row_l: gl.constexpr = gl.SliceLayout(mla.key_dim(TRANSPOSED), s_layout)
        pid_m = gl.program_id(0)
        begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        rows = pid_m * R + gl.arange(0, R, layout=row_l)
        t = rows // H
        it = 0
        nq = 0
        npm = 0
        for b in range(begin_req, end_req + 1):
            seqlen, tok_lo, tok_hi, bits = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk,
                                                        CAPACITY, mla._BN)
            if tok_lo < tok_hi:
                # Keys row r may see: [0, lim); with causal, query t of Q_LEN sees keys 0 .. seqlen - Q_LEN + t.
                if CAUSAL:
                    first_masked = seqlen - Q_LEN + 1
                    lim = gl.minimum(first_masked + t, seqlen)
                else:
                    first_masked = seqlen
                    lim = gl.zeros([R], dtype=gl.int32, layout=row_l) + seqlen
                mbarrier.wait(q_ready, phase(nq, 1))
                qk = qk_scale
                if KV_FMT > 0:
                    qk = qk_scale * gl.max(q_scale_smem.load(WARPGROUP), axis=0)
                if KV_FMT == 1:
                    # The converter gave q k_scale's sign: the scores' scale stays positive, as the unscaled
                    # row maxima of ``mla.softmax_tile`` need.
                    qk = qk * gl.abs(v_scale)
                o, m_i, l_i, it, npm = mla.softmax_tiles(it, npm, tok_lo, tok_hi, first_masked, lim, seqlen, qk,
                                                         q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem,
                                                         q_free, kv_ready, kv_empty, p_ready, p_free, s_layout,
                                                         o_layout, False, TRANSPOSED)
                bits = bits | gl.where(mla.pages_ok(page_flags.index(nq % 2)), 0, BLOCK_TABLE)
                report(err_ptr, bits)
                inv_l, lse2 = mla.softmax_finish(m_i, l_i, qk, bits != 0, npm, scale_smem, p_ready, p_free)
                npm += 1
                nq += 1
                is_direct, piece = _piece(splits_ptr, b, begin_req, begin_split, PIECES)
                o_row_l: gl.constexpr = gl.SliceLayout(mla.key_dim(TRANSPOSED), o_layout)
                _store_half(o, gl.convert_layout(inv_l, o_row_l) * v_scale, gl.convert_layout(lse2, o_row_l), 0,
                            is_direct, out_ptr, lse_ptr, partials_ptr, PIECES, b, piece, pid_m, H, Q_LEN, ROWS,
                            stride_ob, stride_ot, stride_oh, True, o_layout, TRANSPOSED, OUT_TYPED)

    @gluon.jit
    def _value_warpgroup(
        kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free, PIECES, CAPACITY, seqlens_ptr, meta_ptr,
        splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS, H, Q_LEN, ROWS, stride_ob, stride_ot, stride_oh,
        kv_scale_ptr, PAGE: gl.constexpr, META_W: gl.constexpr, KV_FMT: gl.constexpr,
        TRANSPOSED: gl.constexpr = False, OUT_TYPED: gl.constexpr = False,
    ):
        v_scale = mla.kv_scale(kv_scale_ptr, KV_FMT == 1)
        if TRANSPOSED:
            o_layout: gl.constexpr = mla.transposed_layout(p_smem.shape[1])
        else:
            o_layout: gl.constexpr = mla.O_LAYOUT
        pid_m = gl.program_id(0)
        begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        it = 0
        npm = 0
        for b in range(begin_req, end_req + 1):
            seqlen, tok_lo, tok_hi, _ = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk,
                                                     CAPACITY, mla._BN)
            if tok_lo < tok_hi:
                o, inv_l, it, npm = mla.value_tiles(it, npm, tok_lo, tok_hi, seqlen, kv_ring, p_smem, scale_smem,
                                                    kv_ready, kv_empty, p_ready, p_free, o_layout, False, TRANSPOSED)
                is_direct, piece = _piece(splits_ptr, b, begin_req, begin_split, PIECES)
                _store_half(o, inv_l * v_scale, inv_l, 256, is_direct, out_ptr, lse_ptr, partials_ptr, PIECES, b, piece,
                            pid_m, H, Q_LEN, ROWS, stride_ob, stride_ot, stride_oh, False, o_layout, TRANSPOSED,
                            OUT_TYPED)

    @gluon.jit
    def _decode_sm90_kernel(
        q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
        out_ptr, lse_ptr, partials_ptr, err_ptr,
        B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_btb, PIECES, CAPACITY, num_pages, stride_ob, stride_ot, stride_oh,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, META_W: gl.constexpr, PDL: gl.constexpr,
        WAIT_PRIOR: gl.constexpr, TRANSPOSED: gl.constexpr = False, OUT_TYPED: gl.constexpr = False,
    ):
        if WAIT_PRIOR:
            wait_prior_grids()
        if PDL:
            # One program per SM part, all resident at once: let the combine kernel's programs be scheduled
            # now, after the wait above (they read the schedule and the lengths before waiting for this grid).
            launch_dependents()
        (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, p_ready, p_free, kv_ready,
         kv_empty, page_flags) = mla.mla_buffers(q_desc, q_pe_desc, q_desc.dtype, TRANSPOSED)
        gl.warp_specialize(
            [(_softmax_warpgroup, (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free,
                                   kv_ready, kv_empty, p_ready, p_free, page_flags, PIECES, CAPACITY,
                                   seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, err_ptr, B,
                                   PARTS, H, Q_LEN, ROWS, qk_scale, stride_ob, stride_ot, stride_oh, None, None,
                                   CAUSAL, PAGE, META_W, 0, TRANSPOSED, OUT_TYPED)),
             (_value_warpgroup, (kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free, PIECES, CAPACITY,
                                 seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS, H,
                                 Q_LEN, ROWS, stride_ob, stride_ot, stride_oh, None, PAGE, META_W, 0, TRANSPOSED,
                                 OUT_TYPED)),
             (_loader, (q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, CAPACITY, num_pages,
                        seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_smem, q_pe_smem,
                        kv_ring, kv_pe_ring, q_ready, q_free, kv_ready, kv_empty, page_flags, PAGE, META_W))],
            worker_num_warps=[4, 1],
            worker_num_regs=[232, 32],
        )


_MAIN = CachedKernel(_decode_sm90_kernel, ptx_pass=tma_loads_evict_first) if HAVE_GLUON else None


def sm90_main_args(q_rows, k_cache, block_table, cache_seqlens, metadata, num_splits, softmax_scale, causal,
                   out, lse, partials, err, pdl: bool = False, wait_prior: bool = False, block_m: int = BLOCK_M,
                   out_typed: bool = False):
    """(kernel, grid, args, options) of the main kernel over ``q_rows`` (q as [b * rows, 576] from
    ``tma_rows``): results of one-piece requests into out / lse, the rest into ``partials`` (decode.py's
    ``partials_size`` layout; the portable launcher allocates it and runs the combine kernel afterwards).
    softmax_scale > 0 (the softmax keeps unscaled row maxima; the public ops check it). ``pdl``: the combine
    kernel follows as a programmatic dependent launch; ``wait_prior``: this kernel is launched as one itself
    (``common.wait_prior_options``); ``block_m``: Q rows per tile, 64 or the transposed form's 16 / 32
    (requests of at most that many rows); ``out_typed``: partial values in out's dtype (``_store_half``)."""
    b, q_len, h, _ = out.shape
    rows = q_len * h
    parts = metadata.shape[0]
    args = (*mla_descriptors(q_rows, k_cache.view(-1, D_QK), block_m),
            block_table, cache_seqlens, metadata, num_splits, out, lse, partials, err,
            b, parts, h, q_len, rows, softmax_scale * LOG2E, block_table.stride(0), b + parts,
            block_table.shape[1] * k_cache.shape[1], k_cache.shape[0],
            out.stride(0), out.stride(1), out.stride(2))
    options = dict(CAUSAL=bool(causal), PAGE=k_cache.shape[1], META_W=METADATA_WIDTH, PDL=pdl, num_warps=4,
                   TRANSPOSED=block_m < BLOCK_M, OUT_TYPED=out_typed, **wait_prior_options(wait_prior))
    return _MAIN, (-(-rows // block_m), metadata.shape[0], 1), args, options
