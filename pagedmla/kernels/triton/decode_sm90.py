"""Hopper (sm_90a) MLA decode main kernel in Gluon: TMA loads, warp specialisation, warpgroup MMAs.

Same contract, metadata, work split and partial format as the portable kernel in ``decode.py`` (whose
combine kernel finishes the split requests); this one replaces its main kernel on sm_90 GPUs for 64-row
tiles, where the portable kernel reaches only 30-38% of the tensor-core peak (benchmarks/NOTES.md).

Structure per program (64 query rows x one SM part), FlashMLA's:
- a loader warp streams each request's Q tile and its [64, 576] KV tiles through a two-stage shared-memory
  ring (TMA; block shapes must be powers of two, so each tile is a [64, 512] and a [64, 64] copy, which
  Gluon splits into 64-column boxes);
- warpgroup 0 computes S = Q K^T for the whole 64 x 64 tile (36 wgmma k-steps), the online softmax, writes
  P (bf16/fp16) and the per-row rescale factor to shared memory, and accumulates O[:, :256] += P V[:, :256];
- warpgroup 1 accumulates O[:, 256:] += P V[:, 256:] from the same shared P, so S is computed once and
  warpgroup 1's MMAs run while warpgroup 0 computes the next S and softmax.
Each KV tile is the key (576 columns) and the value (its first 512) of one load. The last tile of a
sequence may hold unused cache slots (NaN-poisoned in the tests): their scores are masked and their value
rows are zeroed in shared memory before P V (0 * NaN would poison the output).

Requirements (``sm90_supported`` checks them): CUDA capability 9.0, Triton with Gluon, q and cache bf16 or
fp16, head dims 576 / 512, page size a multiple of 64, a contiguous cache, 64-row tiles.
"""

from __future__ import annotations

import functools

import torch

from pagedmla.device import hopper_available
from pagedmla.kernels.triton.common import BLOCK_TABLE, LN2, LOG2E, SCHEDULE, checked_page, finish_rows, report
from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.kernels.triton.metadata import part_bounds, request_span, schedule_matches
from pagedmla.split_plan import BLOCK_N as SCHED_BLOCK_N
from pagedmla.split_plan import METADATA_WIDTH

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # an older or newer Triton without this Gluon API: the portable kernel runs instead
    HAVE_GLUON = False

D_QK, D_V = 576, 512
BLOCK_M = 64
BLOCK_N = SCHED_BLOCK_N  # one KV tile per schedule block (64 tokens)
STAGES = 2
if HAVE_GLUON:  # the same values as compile-time constants for the kernels
    _DV = gl.constexpr(D_V)
    _BM = gl.constexpr(BLOCK_M)
    _BN = gl.constexpr(BLOCK_N)
    _STAGES = gl.constexpr(STAGES)
    _LN2 = gl.constexpr(LN2)
    # Register layouts of the MLA warpgroups' wgmma results: S (64 x 64 keys) and their half of O (64 x 256).
    _S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16]))
    _O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16]))


# The persistent kernels' tile counters and tile ids are int32, and the programs' last claims run past the
# tile count by up to the number of programs: 2**20 of headroom.
MAX_TILES = 2 ** 31 - 2 ** 20


def sm90_supported(q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether the Gluon kernel can run this call (see the module docstring)."""
    if not (hopper_available(q.device) and k_cache.is_cuda):
        return False
    page = k_cache.shape[1]
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and q.shape[-1] == D_QK and head_dim_v == D_V and k_cache.shape[2] == 1
            and page % BLOCK_N == 0 and k_cache.is_contiguous() and k_cache.data_ptr() % 16 == 0)


if HAVE_GLUON:

    @gluon.jit
    def pages_ok(flag):
        """Warpgroup side of the page check: whether the loader found every page id of the request (or tile)
        it last loaded into ``flag``'s slot inside the cache. Read after the wait for that request's last KV
        tile, which the loader signalled after writing the flag: the check costs the warpgroups no global
        load in their tile loop."""
        return gl.max(flag.load(gl.BlockedLayout([1], [32], [4], [0])), axis=0) == 0

    @gluon.jit
    def _zero_tail_rows(kv, col0, valid, CHUNKS: gl.constexpr, num_warps: gl.constexpr):
        """Zero rows valid .. of columns col0 .. col0 + 64 * CHUNKS - 1 of a value tile in shared memory."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = gl.arange(0, kv.shape[0], layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(CHUNKS):
            part = kv.slice(col0 + 64 * c, 64, dim=1)
            x = part.load(layout)
            part.store(gl.where(rows[:, None] < valid, x, gl.zeros_like(x)))
        fence_async_shared()

    @gluon.jit
    def _store_half(o, scale, lse2, col0, is_direct, out_ptr, lse_ptr, partials_ptr, PIECES, b, piece, pid_m,
                    H, Q_LEN, ROWS, stride_ob, stride_ot, stride_oh, WRITE_LSE: gl.constexpr,
                    layout: gl.constexpr):
        """Columns col0 .. col0 + 255 of the tile's result: normalised into ``out`` (and LSE, natural log)
        when the request is in one piece, else into the fp32 partial row ``piece`` (and log2 LSE) of the
        partials buffer (decode.py's layout: PIECES x ROWS x 512 values, then the LSEs)."""
        rows = pid_m * _BM + gl.arange(0, _BM, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, layout))
        row_ok = rows < ROWS
        o = o * scale[:, None]
        if is_direct:
            t = rows // H
            h = rows % H
            o_row = b.to(gl.int64) * stride_ob + t.to(gl.int64) * stride_ot + h * stride_oh
            gl.store(out_ptr + o_row[:, None] + cols[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
            if WRITE_LSE:
                gl.store(lse_ptr + b.to(gl.int64) * ROWS + h * Q_LEN + t, lse2 * _LN2, mask=row_ok)
        else:
            p_row = piece.to(gl.int64) * ROWS + rows
            gl.store(partials_ptr + p_row[:, None] * _DV + cols[None, :], o, mask=row_ok[:, None])
            if WRITE_LSE:
                gl.store(partials_ptr + PIECES.to(gl.int64) * ROWS * _DV + p_row, lse2, mask=row_ok)

    @gluon.jit
    def _load_q(q_desc, q_pe_desc, q_row, q_smem, q_pe_smem, q_ready):
        mbarrier.expect(q_ready, q_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready, q_smem)
        tma.async_copy_global_to_shared(q_pe_desc, [q_row, _DV], q_ready, q_pe_smem)

    @gluon.jit
    def _load_kv_tiles(kv_desc, kv_pe_desc, bt_row, first_page, tok_lo, tok_hi, it, kv_ring, kv_pe_ring, kv_ready,
                       kv_empty, flag, num_pages, PAGE: gl.constexpr):
        """Loader: KV tokens tok_lo .. tok_hi - 1 of one request (tok_lo a multiple of 64, tok_lo < tok_hi,
        tok_hi within the block-table row's capacity) into the ring from slot it on, 64 per slot; first_page
        is the block-table entry of tok_lo, already loaded. Each tile's page id is loaded one tile ahead, so
        no refill waits on a block-table read; a page id outside the cache reads page 0, and whether any did
        goes into ``flag`` (an int32 [1] shared-memory slot) before the last tile is signalled, for warpgroup
        0 to poison the request (``pages_ok``). Returns the ring position after the last tile."""
        page_id, bad = checked_page(first_page, num_pages)
        for n0 in range(tok_lo, tok_hi, _BN):
            # The last tile's look-ahead re-reads its own entry (inside the row: tok_hi <= the row's capacity).
            next_page, next_bad = checked_page(gl.load(bt_row + gl.minimum(n0 + _BN, tok_hi - 1) // PAGE),
                                               num_pages)
            if n0 + _BN >= tok_hi:
                flag.store(gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [1], [0])) + bad.to(gl.int32))
                gl.thread_barrier()  # the whole warp's store before the one thread that signals the tile
            bad = bad | next_bad
            s = it % _STAGES
            mbarrier.wait(kv_empty.index(s), ((it // _STAGES) & 1) ^ 1)
            row = page_id * PAGE + n0 % PAGE
            ready = kv_ready.index(s)
            mbarrier.expect(ready, kv_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kv_desc, [row, 0], ready, kv_ring.index(s))
            tma.async_copy_global_to_shared(kv_pe_desc, [row, _DV], ready, kv_pe_ring.index(s))
            page_id = next_page
            it += 1
        return it

    @gluon.jit
    def _softmax_tile(o, m_i, l_i, it, npm, n0, first_masked, lim, seqlen, release_q, qk_scale,
                      q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_free, kv_ready, kv_empty,
                      p_ready, p_free, s_layout: gl.constexpr, o_layout: gl.constexpr):
        """Warpgroup 0's step over KV tokens n0 .. n0 + 63 (ring slot it, P message npm): S = Q K^T, the
        online softmax (scores of keys >= lim masked once the tile reaches first_masked), P and the rescale
        factor to shared memory for warpgroup 1, O[:, :256] += P V[:, :256]. Returns (o, m_i, l_i)."""
        s = it % _STAGES
        kv = kv_ring.index(s)
        kv_pe = kv_pe_ring.index(s)
        mbarrier.wait(kv_ready.index(s), (it // _STAGES) & 1)
        zero_s = gl.zeros([_BM, _BN], dtype=gl.float32, layout=s_layout)
        acc = warpgroup_mma(q_smem, kv.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(q_pe_smem, kv_pe.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, q_smem, q_pe_smem, kv, kv_pe))[0]
        if release_q:
            mbarrier.arrive(q_free, count=1)
        if n0 + _BN > first_masked:
            cols = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(0, s_layout))
            acc = gl.where(cols[None, :] < lim[:, None], acc, float("-inf"))
        if n0 + _BN > seqlen:
            _zero_tail_rows(kv, 0, seqlen - n0, 4, 4)
        # The row max is kept unscaled (qk_scale > 0) so that the scale folds into one FMA per score.
        m_new = gl.maximum(m_i, gl.max(acc, axis=1))
        # A row with no visible key yet keeps max -inf: subtract 0 instead so exp2 gives 0, not NaN.
        m_sc = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.exp2(m_i * qk_scale - m_sc)
        p = gl.exp2(acc * qk_scale - m_sc[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        # Warpgroup 1 has finished reading the previous P and scale.
        mbarrier.wait(p_free, (npm & 1) ^ 1)
        p_smem.store(p.to(p_smem.dtype))
        scale_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_smem, kv.slice(0, 256, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_smem, kv))[0]
        mbarrier.arrive(kv_empty.index(s), count=1)
        return o, m_new, l_i

    @gluon.jit
    def _softmax_finish(m_i, l_i, qk_scale, bad, npm, scale_smem, p_ready, p_free):
        """(1 / l, log2 LSE) of warpgroup 0's rows (m_i unscaled, as ``_softmax_tile`` keeps it; both NaN when
        ``bad``, see ``finish_rows``); sends 1 / l to warpgroup 1 as message npm, so a poisoned request's
        other half is poisoned too."""
        inv_l, lse2 = finish_rows(l_i, m_i * qk_scale, bad)
        # The final message to warpgroup 1 carries 1 / l instead of a rescale factor.
        mbarrier.wait(p_free, (npm & 1) ^ 1)
        scale_smem.store(inv_l)
        mbarrier.arrive(p_ready, count=1)
        return inv_l, lse2

    @gluon.jit
    def _value_tile(o, it, npm, n0, seqlen, kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free,
                    o_layout: gl.constexpr):
        """Warpgroup 1's step: O[:, 256:] = O[:, 256:] * rescale + P V[:, 256:] for ring slot it."""
        s = it % _STAGES
        kv = kv_ring.index(s)
        mbarrier.wait(kv_ready.index(s), (it // _STAGES) & 1)
        if n0 + _BN > seqlen:
            # Warpgroup 0's S may still be reading these bytes as keys: only scores of keys past seqlen
            # change, and those are replaced by -inf (a select, not a multiply).
            _zero_tail_rows(kv, 256, seqlen - n0, 4, 4)
        mbarrier.wait(p_ready, npm & 1)
        o = o * scale_smem.load(gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_smem, kv.slice(256, 256, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_smem, kv))[0]
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)
        return o

    @gluon.jit
    def _value_finish(npm, scale_smem, p_ready, p_free, o_layout: gl.constexpr):
        """Warpgroup 1 receives 1 / l (message npm)."""
        mbarrier.wait(p_ready, npm & 1)
        inv_l = scale_smem.load(gl.SliceLayout(1, o_layout))
        mbarrier.arrive(p_free, count=1)
        return inv_l

    @gluon.jit
    def _loader(q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, PIECES, CAPACITY, num_pages, seqlens_ptr,
                meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_smem, q_pe_smem, kv_ring, kv_pe_ring,
                q_ready, q_free, kv_ready, kv_empty, page_flags, PAGE: gl.constexpr, META_W: gl.constexpr):
        pid_m = gl.program_id(0)
        part = gl.program_id(1)
        begin_req, begin_blk, end_req, end_blk, _ = part_bounds(meta_ptr, part, B - 1, META_W)
        it = 0
        nq = 0
        for b in range(begin_req, end_req + 1):
            bt_row = bt_ptr + b.to(gl.int64) * stride_btb
            # The slice's first page id does not depend on the length: it loads alongside it (masked: an
            # empty slice may start past the row's last entry).
            first = gl.where(b == begin_req, begin_blk, 0) * _BN // PAGE
            first_page = gl.load(bt_row + first, mask=first * PAGE < CAPACITY, other=0)
            seqlen, tok_lo, tok_hi, _ = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk,
                                                     CAPACITY, _BN)
            if tok_lo < tok_hi:
                # Q of the previous request stays until warpgroup 0's last S of it is done.
                mbarrier.wait(q_free, (nq & 1) ^ 1)
                _load_q(q_desc, q_pe_desc, b * ROWS + pid_m * _BM, q_smem, q_pe_smem, q_ready)
                it = _load_kv_tiles(kv_desc, kv_pe_desc, bt_row, first_page, tok_lo, tok_hi, it, kv_ring, kv_pe_ring,
                                    kv_ready, kv_empty, page_flags.index(nq % 2), num_pages, PAGE)
                nq += 1
        if (pid_m == 0) & (part == 0):
            # The schedule verdict (decode.py's partials layout), once the loads are issued: the loader has
            # nothing else to do while the warpgroups finish.
            lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
            ok = schedule_matches(seqlens_ptr, meta_ptr, splits_ptr, B, PARTS, lanes, _BN)
            gl.store(partials_ptr + PIECES.to(gl.int64) * ROWS * (_DV + 1), gl.where(ok, 1.0, 0.0))
            report(err_ptr, gl.where(ok, 0, SCHEDULE))

    @gluon.jit
    def _softmax_warpgroup(
        q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, kv_ready, kv_empty,
        p_ready, p_free, page_flags, PIECES, CAPACITY, seqlens_ptr, meta_ptr, splits_ptr, out_ptr,
        lse_ptr, partials_ptr, err_ptr, B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_ob, stride_ot, stride_oh,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, META_W: gl.constexpr,
    ):
        s_layout: gl.constexpr = _S_LAYOUT
        o_layout: gl.constexpr = _O_LAYOUT
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        pid_m = gl.program_id(0)
        begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        rows = pid_m * _BM + gl.arange(0, _BM, layout=row_l)
        t = rows // H
        it = 0
        nq = 0
        npm = 0
        for b in range(begin_req, end_req + 1):
            seqlen, tok_lo, tok_hi, bits = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk,
                                                        CAPACITY, _BN)
            if tok_lo < tok_hi:
                # Keys row r may see: [0, lim); with causal, query t of Q_LEN sees keys 0 .. seqlen - Q_LEN + t.
                if CAUSAL:
                    first_masked = seqlen - Q_LEN + 1
                    lim = gl.minimum(first_masked + t, seqlen)
                else:
                    first_masked = seqlen
                    lim = gl.zeros([_BM], dtype=gl.int32, layout=row_l) + seqlen
                m_i = gl.full([_BM], float("-inf"), dtype=gl.float32, layout=row_l)
                l_i = gl.zeros([_BM], dtype=gl.float32, layout=row_l)
                o = gl.zeros([_BM, 256], dtype=gl.float32, layout=o_layout)
                mbarrier.wait(q_ready, nq & 1)
                for n0 in range(tok_lo, tok_hi, _BN):
                    o, m_i, l_i = _softmax_tile(o, m_i, l_i, it, npm, n0, first_masked, lim, seqlen,
                                                n0 + _BN >= tok_hi, qk_scale, q_smem, q_pe_smem, kv_ring,
                                                kv_pe_ring, p_smem, scale_smem, q_free, kv_ready, kv_empty,
                                                p_ready, p_free, s_layout, o_layout)
                    npm += 1
                    it += 1
                bits = bits | gl.where(pages_ok(page_flags.index(nq % 2)), 0, BLOCK_TABLE)
                report(err_ptr, bits)
                inv_l, lse2 = _softmax_finish(m_i, l_i, qk_scale, bits != 0, npm, scale_smem, p_ready, p_free)
                npm += 1
                nq += 1
                s_lo = gl.load(splits_ptr + b)
                is_direct = gl.load(splits_ptr + b + 1) - s_lo == 1
                piece = gl.minimum(s_lo + gl.where(b == begin_req, begin_split, 0), PIECES - 1)
                _store_half(o, gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)),
                            gl.convert_layout(lse2, gl.SliceLayout(1, o_layout)), 0, is_direct,
                            out_ptr, lse_ptr, partials_ptr, PIECES, b, piece, pid_m, H, Q_LEN, ROWS,
                            stride_ob, stride_ot, stride_oh, True, o_layout)

    @gluon.jit
    def _value_warpgroup(
        kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free, PIECES, CAPACITY, seqlens_ptr, meta_ptr,
        splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS, H, Q_LEN, ROWS, stride_ob, stride_ot, stride_oh,
        PAGE: gl.constexpr, META_W: gl.constexpr,
    ):
        o_layout: gl.constexpr = _O_LAYOUT
        pid_m = gl.program_id(0)
        begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        it = 0
        npm = 0
        for b in range(begin_req, end_req + 1):
            seqlen, tok_lo, tok_hi, _ = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk,
                                                     CAPACITY, _BN)
            if tok_lo < tok_hi:
                o = gl.zeros([_BM, 256], dtype=gl.float32, layout=o_layout)
                for n0 in range(tok_lo, tok_hi, _BN):
                    o = _value_tile(o, it, npm, n0, seqlen, kv_ring, p_smem, scale_smem, kv_ready, kv_empty,
                                    p_ready, p_free, o_layout)
                    npm += 1
                    it += 1
                # 1 / l from warpgroup 0: NaN for a request it found bad.
                inv_l = _value_finish(npm, scale_smem, p_ready, p_free, o_layout)
                npm += 1
                s_lo = gl.load(splits_ptr + b)
                is_direct = gl.load(splits_ptr + b + 1) - s_lo == 1
                piece = gl.minimum(s_lo + gl.where(b == begin_req, begin_split, 0), PIECES - 1)
                _store_half(o, inv_l, inv_l, 256, is_direct, out_ptr, lse_ptr, partials_ptr, PIECES, b, piece,
                            pid_m, H, Q_LEN, ROWS, stride_ob, stride_ot, stride_oh, False, o_layout)

    @gluon.jit
    def _mla_buffers(q_desc, q_pe_desc, kv_desc, kv_pe_desc):
        """Shared memory and barriers of the MLA kernels: Q, the two-stage KV ring, P and its per-row scale;
        ready/free barriers for Q, each ring slot (freed by both warpgroups) and P; the page-check flags."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        q_pe_smem = gl.allocate_shared_memory(dtype, q_pe_desc.block_type.shape, q_pe_desc.layout)
        kv_ring = gl.allocate_shared_memory(dtype, [_STAGES] + kv_desc.block_type.shape, kv_desc.layout)
        kv_pe_ring = gl.allocate_shared_memory(dtype, [_STAGES] + kv_pe_desc.block_type.shape, kv_pe_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BM, _BN], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [_BM, _BN], p_layout)
        scale_smem = gl.allocate_shared_memory(gl.float32, [_BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        p_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        p_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_layout)
        # The loader's page-check result of the two requests (tiles) in flight, by Q-load parity.
        page_flags = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_free, count=1)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        for i in gl.static_range(_STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrive per warpgroup
        return (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, p_ready, p_free,
                kv_ready, kv_empty, page_flags)

    @gluon.jit
    def _decode_sm90_kernel(
        q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
        out_ptr, lse_ptr, partials_ptr, err_ptr,
        B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_btb, PIECES, CAPACITY, num_pages, stride_ob, stride_ot, stride_oh,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, META_W: gl.constexpr, PDL: gl.constexpr,
    ):
        if PDL:
            # One program per SM part, all resident at once: let the combine kernel's programs be scheduled
            # now (they wait for this grid's end before reading partials).
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, p_ready, p_free, kv_ready,
         kv_empty, page_flags) = _mla_buffers(q_desc, q_pe_desc, kv_desc, kv_pe_desc)
        gl.warp_specialize(
            [(_softmax_warpgroup, (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free,
                                   kv_ready, kv_empty, p_ready, p_free, page_flags, PIECES, CAPACITY,
                                   seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, err_ptr, B,
                                   PARTS, H, Q_LEN, ROWS, qk_scale, stride_ob, stride_ot, stride_oh, CAUSAL, PAGE,
                                   META_W)),
             (_value_warpgroup, (kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free, PIECES, CAPACITY,
                                 seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS, H,
                                 Q_LEN,
                                 ROWS, stride_ob, stride_ot, stride_oh, PAGE, META_W)),
             (_loader, (q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, PIECES, CAPACITY, num_pages,
                        seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_smem, q_pe_smem,
                        kv_ring, kv_pe_ring, q_ready, q_free, kv_ready, kv_empty, page_flags, PAGE, META_W))],
            worker_num_warps=[4, 1],
            worker_num_regs=[232, 32],
        )


_MAIN = CachedKernel(_decode_sm90_kernel) if HAVE_GLUON else None


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.cache
def _tile_layout(width: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, width], _gl_dtype(dtype))


def tma_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D row-major tensor with a 16-byte aligned base, copied only when it is not one already."""
    if x.data_ptr() % 16 or x.stride() != (x.shape[1], 1):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def descriptor(x: torch.Tensor, block_shape: list[int], layout) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor`` without its per-call validation, which was a third of this
    launcher's host time: ``x`` comes from ``tma_rows`` or a cache ``sm90_supported`` checked (aligned base,
    16-byte row stride, unit last stride); block shapes are the constants above."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = x, x.shape, x.stride()
    desc.block_shape, desc.layout, desc.padding = block_shape, layout, "zero"
    return desc


def sm90_main_args(q_rows, k_cache, block_table, cache_seqlens, metadata, num_splits, softmax_scale, causal,
                   out, lse, partials, err, pdl: bool = False):
    """(kernel, grid, args, options) of the main kernel over ``q_rows`` (q as [b * rows, 576] from
    ``tma_rows``): results of one-piece requests into out / lse, the rest into ``partials`` (decode.py's
    ``partials_size`` layout; the portable launcher allocates it and runs the combine kernel afterwards).
    softmax_scale > 0 (the softmax keeps unscaled row maxima; the public ops check it). ``pdl``: the combine
    kernel follows as a programmatic dependent launch."""
    b, q_len, h, _ = out.shape
    rows = q_len * h
    parts = metadata.shape[0]
    nope, pe = _tile_layout(D_V, q_rows.dtype), _tile_layout(D_QK - D_V, q_rows.dtype)
    kv_flat = k_cache.view(-1, D_QK)
    args = (descriptor(q_rows, [BLOCK_M, D_V], nope), descriptor(q_rows, [BLOCK_M, D_QK - D_V], pe),
            descriptor(kv_flat, [BLOCK_N, D_V], nope), descriptor(kv_flat, [BLOCK_N, D_QK - D_V], pe),
            block_table, cache_seqlens, metadata, num_splits, out, lse, partials, err,
            b, parts, h, q_len, rows, softmax_scale * LOG2E, block_table.stride(0), b + parts,
            block_table.shape[1] * k_cache.shape[1], k_cache.shape[0],
            out.stride(0), out.stride(1), out.stride(2))
    options = dict(CAUSAL=bool(causal), PAGE=k_cache.shape[1], META_W=METADATA_WIDTH, PDL=pdl, num_warps=4)
    return _MAIN, (-(-rows // BLOCK_M), metadata.shape[0], 1), args, options
