"""Hopper (sm_90a) MLA decode main kernel with a seesaw schedule (FlashMLA's idea, written here for Gluon).

Same arguments, metadata, work split, guards and results as ``decode.py``'s kernel (the bound launch passes
the same addresses); what differs is how the two warpgroups share a part's KV tiles. A request's tiles go in
pairs (A, B) = (tile 2j, tile 2j + 1), A in slot 0 and B in slot 1. Warpgroup 0 holds O_L = O[:, :256] and
warpgroup 1 O_R = O[:, 256:]; each computes S and the softmax of one tile of the pair and both add their
half of P V for both tiles, m being the running row max:

- 0: S_A = Q K_A^T, m_A = max(m, rowmax S_A), P_A = exp(S_A - m_A) (to shared memory, with m_A);
  O_L = O_L e^(m - m_A) + P_A V_A,L
- 1: S_B = Q K_B^T (queued after S_A, so that it runs beside 0's softmax); O_R = O_R e^(m - m_A) + P_A V_A,R
  (behind S_B on the tensor cores); m_B = max(m_A, rowmax S_B), P_B = exp(S_B - m_B) (to shared memory, with
  m_B) beside 0's P_A V_A,L;
  O_R = O_R e^(m_A - m_B) + P_B V_B,R
- 0: O_L = O_L e^(m_A - m_B) + P_B V_B,L

so each warpgroup's softmax runs beside MMAs of the other, where ``decode.py``'s schedule (one warpgroup
computes every S and softmax) leaves the tensor cores idle during each softmax. Each warpgroup sums the P
it computed (rescaled like its O half); the two shares are added at the end of a request. On the H200 it is
1.4-6.7% faster than ``decode.py``'s kernel as CUDA graphs on 128-row requests (128 heads, or 64 x q_len 2)
and 1-5% slower on memory-bound 32-64-row ones (benchmarks/NOTES.md, decode v18): ``SEESAW_MIN_ROWS``.

Shared memory (232112 of the 232448 bytes a CTA may have): Q as two [64, 256] halves and its [64, 64] rope
part, each KV slot as two [64, 256] halves and its rope part, P_A and the per-row statistics. P_B lives in
Q's rope buffer: both warpgroups copy the rope part into registers at a request's start (the rope part of S
is an MMA with A in registers), and the loader brings the next request's Q once both are done. The loader
warp fills each half of a slot once the warpgroups that read it are done with it (slot 0's left half after
0's P_A V_A,L, its right half after 0's S_A and 1's P_A V_A,R; slot 1's right half after 1's P_B V_B,R, its
left half after 1's S_B and 0's P_B V_B,L), and each S starts on the half freed first.

Three things Triton 3.6 and its ptxas need spelled out (measured, benchmarks/NOTES.md decode v18, v25):
buffer indices that vary with the tile loop (constant ones let it hoist every wgmma descriptor out of the
loop: 540 bytes of spills), shared-memory views taken separately in each branch that reads them (one view
shared by an if and its else let it reuse, in the else, descriptor registers set only in the if: wrong P V
results), and an explicit wgmma wait naming O before warpgroup 1 rescales it with S_B in flight (without
it ptxas injects a wait for every MMA there; ``compile_report.py`` counts such waits).
"""

from __future__ import annotations

from pagedmla.kernels.triton.common import (
    BLOCK_TABLE,
    LOG2E,
    checked_page,
    finish_rows,
    report,
    wait_prior_options,
)
from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.kernels.triton.metadata import part_bounds, request_span
from pagedmla.kernels.triton.sm90.mla import BLOCK_M, D_QK, D_V
from pagedmla.kernels.triton.sm90.pipeline import HAVE_GLUON, descriptor, shared_layout, tma_loads_evict_first
from pagedmla.split_plan import METADATA_WIDTH

# Query rows per request (q_len x heads) from which the decode plan runs this kernel instead of decode.py's:
# two full 64-row tiles, where the cells are compute bound (benchmarks/NOTES.md, decode v18).
SEESAW_MIN_ROWS = 128

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from pagedmla.kernels.triton.sm90 import mla
    from pagedmla.kernels.triton.sm90.decode import _piece, _store_half, schedule_verdict, slice_start
    from pagedmla.kernels.triton.sm90.pipeline import (
        free_phase,
        launch_dependents,
        online_softmax,
        phase,
        wait_prior_grids,
        zero_tail_rows,
    )

    _H = gl.constexpr(256)  # columns of a value half
    _PE = gl.constexpr(64)  # rope columns
    # Rows of the per-row statistics buffer: running max, the two rescale factors, the two row-sum shares.
    _M, _SCALE_A, _SCALE_B = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
    _L0, _L1 = gl.constexpr(3), gl.constexpr(4)
    # Per-row vectors in S's and O's MMA layouts; A operands in registers (Q's rope part for S, P for P V).
    _ROW = gl.constexpr(gl.SliceLayout(1, mla.S_LAYOUT.value))
    _OROW = gl.constexpr(gl.SliceLayout(1, mla.O_LAYOUT.value))
    _PE_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=mla.S_LAYOUT.value, k_width=2))
    _P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=mla.O_LAYOUT.value, k_width=2))


if HAVE_GLUON:

    @gluon.jit
    def _load_half(desc, row, col, dst, ready, empty, fills):
        """One [64, 256] half of a KV slot (fill ``fills`` of that half)."""
        mbarrier.wait(empty, free_phase(fills, 1))
        mbarrier.expect(ready, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, col], ready, dst)

    @gluon.jit
    def _load_right(desc, pe_desc, row, dst, pe_dst, ready, empty, fills):
        """The right value half and the rope part of a KV slot: one barrier."""
        mbarrier.wait(empty, free_phase(fills, 1))
        mbarrier.expect(ready, desc.block_type.nbytes + pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, _H], ready, dst)
        tma.async_copy_global_to_shared(pe_desc, [row, 2 * _H], ready, pe_dst)

    @gluon.jit
    def _seesaw_loader(q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, CAPACITY, num_pages,
                       seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_h, q_pe,
                       kv_l, kv_r, kv_pe, q_ready, q_free, ready_l, ready_r, empty_l, empty_r, page_flags,
                       PAGE: gl.constexpr, META_W: gl.constexpr):
        pid_m = gl.program_id(0)
        begin_req, begin_blk, end_req, end_blk, _ = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        fills_a = 0
        fills_b = 0
        nq = 0
        for b in range(begin_req, end_req + 1):
            bt_row, first_page, tok_lo, tok_hi = slice_start(bt_ptr, stride_btb, seqlens_ptr, b, begin_req,
                                                             begin_blk, end_req, end_blk, CAPACITY, PAGE)
            if tok_lo < tok_hi:
                # Q (and P_B, which lives in its rope buffer) stays until both warpgroups end the previous request.
                mbarrier.wait(q_free, free_phase(nq, 1))
                mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
                q_row = b * ROWS + pid_m * mla._BM
                tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready, q_h.index(0))
                tma.async_copy_global_to_shared(q_desc, [q_row, _H], q_ready, q_h.index(1))
                tma.async_copy_global_to_shared(q_pe_desc, [q_row, 2 * _H], q_ready, q_pe.index(0))
                flag = page_flags.index(nq % 2)
                page_id, bad = checked_page(first_page, num_pages)
                for n0 in range(tok_lo, tok_hi, mla._BN):
                    # (The page check of the request goes into the flag before any half of its last tile.)
                    next_page, bad = mla.next_kv_page(bt_row, n0, tok_hi, bad, flag, num_pages, PAGE)
                    row = page_id * PAGE + n0 % PAGE
                    if ((n0 - tok_lo) // mla._BN) % 2 == 0:
                        # Tile A: its left half is freed first (warpgroup 0's P_A V_A,L).
                        _load_half(kv_desc, row, 0, kv_l.index(0), ready_l.index(0), empty_l.index(0), fills_a)
                        _load_right(kv_desc, kv_pe_desc, row, kv_r.index(0), kv_pe.index(0), ready_r.index(0),
                                    empty_r.index(0), fills_a)
                        fills_a += 1
                    else:
                        # Tile B: its right half is freed first (warpgroup 1's P_B V_B,R).
                        _load_right(kv_desc, kv_pe_desc, row, kv_r.index(1), kv_pe.index(1), ready_r.index(1),
                                    empty_r.index(1), fills_b)
                        _load_half(kv_desc, row, 0, kv_l.index(1), ready_l.index(1), empty_l.index(1), fills_b)
                        fills_b += 1
                    page_id = next_page
                nq += 1
        schedule_verdict(seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS)

    @gluon.jit
    def _publish(buf, x):
        """A per-row vector into the statistics buffer, every warp's part written before the caller signals."""
        buf.store(x)
        gl.thread_barrier()

    @gluon.jit
    def _request_rows(b, pid_m, H, Q_LEN, seqlens_ptr, begin_req, begin_blk, end_req, end_blk, CAPACITY,
                      CAUSAL: gl.constexpr):
        """(length, slice tokens, error bits, first masked key, per-row key limit) of request b's slice."""
        seqlen, tok_lo, tok_hi, bits = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk,
                                                    CAPACITY, mla._BN)
        t = (pid_m * mla._BM + gl.arange(0, mla._BM, layout=_ROW)) // H
        if CAUSAL:
            # Query t of Q_LEN sees keys 0 .. seqlen - Q_LEN + t.
            first_masked = seqlen - Q_LEN + 1
            lim = gl.minimum(first_masked + t, seqlen)
        else:
            first_masked = seqlen
            lim = gl.zeros([mla._BM], dtype=gl.int32, layout=_ROW) + seqlen
        return seqlen, tok_lo, tok_hi, bits, first_masked, lim

    @gluon.jit
    def _request_start(q_ready, q_pe, nq):
        """A warpgroup's start of its nq-th request: (Q's rope part in registers once the loader's Q is in,
        running max -inf, row-sum share 0, O half 0)."""
        mbarrier.wait(q_ready, phase(nq, 1))
        q_pe_op = q_pe.index(0).load(_PE_OP)
        return (q_pe_op, gl.full([mla._BM], float("-inf"), dtype=gl.float32, layout=_ROW),
                gl.zeros([mla._BM], dtype=gl.float32, layout=_ROW),
                gl.zeros([mla._BM, _H], dtype=gl.float32, layout=mla.O_LAYOUT))

    @gluon.jit
    def _finish_request(o, l_i, m2, my_l, other_l, fin, q_free, nq, bits, splits_ptr, b, begin_req, begin_split,
                        out_ptr, lse_ptr, partials_ptr, PIECES, pid_m, H, Q_LEN, ROWS, stride_ob, stride_ot,
                        stride_oh, COL0: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_TYPED: gl.constexpr):
        """A warpgroup's end of a request: the two row-sum shares added (in the same order by both, so both
        get the same l), Q handed back to the loader, the O half normalised and stored."""
        _publish(my_l, l_i)
        mbarrier.arrive(fin, count=1)
        mbarrier.wait(fin, phase(nq, 1))
        if COL0 == 0:
            l_i = l_i + other_l.load(_ROW)
        else:
            l_i = other_l.load(_ROW) + l_i
        # Both shares read: the loader may bring the next request's Q (and with it the next shares).
        gl.thread_barrier()
        mbarrier.arrive(q_free, count=1)
        inv_l, lse2 = finish_rows(l_i, m2, bits != 0)
        is_direct, piece = _piece(splits_ptr, b, begin_req, begin_split, PIECES)
        _store_half(o, gl.convert_layout(inv_l, _OROW), gl.convert_layout(lse2, _OROW), COL0, is_direct,
                    out_ptr, lse_ptr, partials_ptr, PIECES, b, piece, pid_m, H, Q_LEN, ROWS, stride_ob,
                    stride_ot, stride_oh, WRITE_LSE, mla.O_LAYOUT, False, OUT_TYPED)

    @gluon.jit
    def _wg0(q_h, q_pe, kv_l, kv_r, kv_pe, p_a, stats, q_ready, q_free, ready_l, ready_r, empty_l, empty_r,
             a_ready, a_issued, b_ready, pa_free, pb_free, pe_taken, fin, page_flags, PIECES, CAPACITY, seqlens_ptr,
             meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, err_ptr, B, PARTS, H, Q_LEN, ROWS, qk_scale,
             stride_ob, stride_ot, stride_oh, CAUSAL: gl.constexpr, META_W: gl.constexpr, OUT_TYPED: gl.constexpr):
        """Warpgroup 0: S and softmax of each pair's tile A, O[:, :256] over both tiles."""
        pid_m = gl.program_id(0)
        zero = gl.program_id(2)  # the grid has one z block
        begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        g = 0  # pairs (fills of slot 0)
        gb = 0  # pairs with a tile B (fills of slot 1)
        nq = 0
        for b in range(begin_req, end_req + 1):
            seqlen, tok_lo, tok_hi, bits, first_masked, lim = _request_rows(
                b, pid_m, H, Q_LEN, seqlens_ptr, begin_req, begin_blk, end_req, end_blk, CAPACITY, CAUSAL)
            if tok_lo < tok_hi:
                q_pe_op, m_i, l_i, o = _request_start(q_ready, q_pe, nq)
                # Warpgroup 1 writes P_B into the rope buffer only after this copy.
                gl.thread_barrier()
                mbarrier.arrive(pe_taken, count=1)
                for n0 in range(tok_lo, tok_hi, 2 * mla._BN):
                    # Slot and Q-half indices that are 0 / 1 but vary with the loop for the compiler: with constant
                    # ones it hoists every wgmma descriptor of the loop out of it (two registers each) and spills.
                    s0 = g & zero
                    q_l = q_h.index(s0)
                    q_r = q_h.index(s0 + 1)
                    ka = kv_l.index(s0)
                    zero_s = gl.zeros([mla._BM, mla._BN], dtype=gl.float32, layout=mla.S_LAYOUT)
                    mbarrier.wait(ready_l.index(0), phase(g, 1))
                    acc = warpgroup_mma(q_l, ka.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    mbarrier.wait(ready_r.index(0), phase(g, 1))
                    acc = warpgroup_mma(q_r, kv_r.index(s0).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma(q_pe_op, kv_pe.index(s0).permute((1, 0)), acc, is_async=True)
                    # Every warp's S_A is queued on its tensor core before warpgroup 1 queues S_B: S_A finishes
                    # first and this softmax runs beside S_B (issued together, the two would end together).
                    gl.thread_barrier()
                    mbarrier.arrive(a_issued, count=1)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, q_l, q_r, ka, kv_r.index(s0),
                                                                      kv_pe.index(s0)))[0]
                    mbarrier.arrive(empty_r.index(0), count=1)
                    p, scale_a, m_i, l_i = online_softmax(acc, m_i, l_i, n0, first_masked, lim, qk_scale, mla.S_LAYOUT)
                    p_bf = p.to(q_l.dtype)
                    # P_A (in m_A's reference), m_A and its rescale factor for warpgroup 1.
                    mbarrier.wait(pa_free, free_phase(g, 1))
                    p_a.index(s0).store(p_bf)
                    fence_async_shared()
                    stats.slice(_M * mla._BM, mla._BM).store(m_i)
                    _publish(stats.slice(_SCALE_A * mla._BM, mla._BM), scale_a)
                    mbarrier.arrive(a_ready, count=1)
                    if n0 + mla._BN > seqlen:
                        zero_tail_rows(ka, 0, seqlen - n0, 4, 4)
                    o = o * gl.convert_layout(scale_a, _OROW)[:, None]
                    p_op = gl.convert_layout(p_bf, _P_OP)
                    o = warpgroup_mma(p_op, ka, o, is_async=True)
                    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op, ka))[0]
                    mbarrier.arrive(empty_l.index(0), count=1)
                    if n0 + mla._BN < tok_hi:
                        kb = kv_l.index(s0 + 1)
                        # Warpgroup 1's softmax of tile B is done and P_B is in the rope buffer.
                        mbarrier.wait(b_ready, phase(gb, 1))
                        scale_b = stats.slice(_SCALE_B * mla._BM, mla._BM).load(_ROW)
                        m_i = stats.slice(_M * mla._BM, mla._BM).load(_ROW)
                        l_i = l_i * scale_b
                        o = o * gl.convert_layout(scale_b, _OROW)[:, None]
                        mbarrier.wait(ready_l.index(1), phase(gb, 1))
                        if n0 + 2 * mla._BN > seqlen:
                            zero_tail_rows(kb, 0, seqlen - n0 - mla._BN, 4, 4)
                        p_b = q_pe.index(s0)
                        o = warpgroup_mma(p_b, kb, o, is_async=True)
                        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_b, kb))[0]
                        mbarrier.arrive(empty_l.index(1), count=1)
                        mbarrier.arrive(pb_free, count=1)
                        gb += 1
                    g += 1
                bits = bits | gl.where(mla.pages_ok(page_flags.index(nq % 2)), 0, BLOCK_TABLE)
                report(err_ptr, bits)
                _finish_request(o, l_i, m_i * qk_scale, stats.slice(_L0 * mla._BM, mla._BM),
                                stats.slice(_L1 * mla._BM, mla._BM), fin, q_free, nq, bits, splits_ptr, b, begin_req,
                                begin_split, out_ptr, lse_ptr, partials_ptr, PIECES, pid_m, H, Q_LEN, ROWS, stride_ob,
                                stride_ot, stride_oh, 0, True, OUT_TYPED)
                nq += 1

    @gluon.jit
    def _wg1(q_h, q_pe, kv_l, kv_r, kv_pe, p_a, stats, q_ready, q_free, ready_l, ready_r, empty_l, empty_r,
             a_ready, a_issued, b_ready, pa_free, pb_free, pe_taken, fin, page_flags, PIECES, CAPACITY, seqlens_ptr,
             meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_ob,
             stride_ot, stride_oh, CAUSAL: gl.constexpr, META_W: gl.constexpr, OUT_TYPED: gl.constexpr):
        """Warpgroup 1: S and softmax of each pair's tile B, O[:, 256:] over both tiles."""
        pid_m = gl.program_id(0)
        zero = gl.program_id(2)  # the grid has one z block
        begin_req, begin_blk, end_req, end_blk, begin_split = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        g = 0
        gb = 0
        nq = 0
        for b in range(begin_req, end_req + 1):
            seqlen, tok_lo, tok_hi, bits, first_masked, lim = _request_rows(
                b, pid_m, H, Q_LEN, seqlens_ptr, begin_req, begin_blk, end_req, end_blk, CAPACITY, CAUSAL)
            if tok_lo < tok_hi:
                q_pe_op, m_i, l_i, o = _request_start(q_ready, q_pe, nq)
                for n0 in range(tok_lo, tok_hi, 2 * mla._BN):
                    s0 = g & zero  # see warpgroup 0's loop
                    q_l = q_h.index(s0)
                    q_r = q_h.index(s0 + 1)
                    if n0 + mla._BN < tok_hi:
                        # (Each branch takes its own views: one shared across both let the compiler reuse a
                        # descriptor computed in only one of them.)
                        ka = kv_r.index(s0)
                        kr = kv_r.index(s0 + 1)
                        zero_s = gl.zeros([mla._BM, mla._BN], dtype=gl.float32, layout=mla.S_LAYOUT)
                        mbarrier.wait(ready_r.index(1), phase(gb, 1))
                        # (Warpgroup 0 cannot be a pair further on: its next S_A needs slot 0's right half,
                        # which this warpgroup's P_A V_A,R below frees.)
                        mbarrier.wait(a_issued, phase(g, 1))
                        acc = warpgroup_mma(q_r, kr.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                        acc = warpgroup_mma(q_pe_op, kv_pe.index(s0 + 1).permute((1, 0)), acc, is_async=True)
                        mbarrier.wait(ready_l.index(1), phase(gb, 1))
                        acc = warpgroup_mma(q_l, kv_l.index(s0 + 1).permute((1, 0)), acc, is_async=True)
                        # Tile A's P and statistics (warpgroup 0's softmax ran beside this S): P_A V_A,R in m_A's
                        # reference goes behind S_B on the tensor cores.
                        mbarrier.wait(a_ready, phase(g, 1))
                        m_a = stats.slice(_M * mla._BM, mla._BM).load(_ROW)
                        scale_a = stats.slice(_SCALE_A * mla._BM, mla._BM).load(_ROW)
                        l_i = l_i * scale_a
                        # O's last MMA was waited for, but without this wait ptxas cannot tell O from S_B's
                        # accumulator and waits for S_B before the rescale (its C7517 note), so the rescale
                        # and P_A V_A,R's issue ran after S_B instead of beside it. One group may stay: S_B.
                        o = warpgroup_mma_wait(num_outstanding=1, deps=(o,))
                        o = o * gl.convert_layout(scale_a, _OROW)[:, None]
                        mbarrier.wait(ready_r.index(0), phase(g, 1))
                        pa = p_a.index(s0)
                        o = warpgroup_mma(pa, ka, o, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, q_l, q_r, kv_l.index(s0 + 1), kr,
                                                                          kv_pe.index(s0 + 1)))[0]
                        mbarrier.arrive(empty_l.index(1), count=1)
                        p, scale_b, m_i, l_i = online_softmax(acc, m_a, l_i, n0 + mla._BN, first_masked, lim, qk_scale,
                                                              mla.S_LAYOUT)
                        p_bf = p.to(q_l.dtype)
                        if n0 == tok_lo:
                            # P_B goes into Q's rope buffer: warpgroup 0 has its copy of this request's rope part.
                            mbarrier.wait(pe_taken, phase(nq, 1))
                        mbarrier.wait(pb_free, free_phase(gb, 1))
                        q_pe.index(s0).store(p_bf)
                        fence_async_shared()
                        stats.slice(_M * mla._BM, mla._BM).store(m_i)
                        _publish(stats.slice(_SCALE_B * mla._BM, mla._BM), scale_b)
                        mbarrier.arrive(b_ready, count=1)
                        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, pa, ka))[0]
                        mbarrier.arrive(empty_r.index(0), count=1)
                        mbarrier.arrive(pa_free, count=1)
                        o = o * gl.convert_layout(scale_b, _OROW)[:, None]
                        if n0 + 2 * mla._BN > seqlen:
                            zero_tail_rows(kr, 0, seqlen - n0 - mla._BN, 4, 4)
                        p_op = gl.convert_layout(p_bf, _P_OP)
                        o = warpgroup_mma(p_op, kr, o, is_async=True)
                        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op, kr))[0]
                        mbarrier.arrive(empty_r.index(1), count=1)
                        gb += 1
                    else:
                        ka = kv_r.index(s0)
                        mbarrier.wait(a_ready, phase(g, 1))
                        m_i = stats.slice(_M * mla._BM, mla._BM).load(_ROW)
                        scale_a = stats.slice(_SCALE_A * mla._BM, mla._BM).load(_ROW)
                        l_i = l_i * scale_a
                        o = o * gl.convert_layout(scale_a, _OROW)[:, None]
                        mbarrier.wait(ready_r.index(0), phase(g, 1))
                        if n0 + mla._BN > seqlen:
                            zero_tail_rows(ka, 0, seqlen - n0, 4, 4)
                        pa = p_a.index(s0)
                        o = warpgroup_mma(pa, ka, o, is_async=True)
                        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, pa, ka))[0]
                        mbarrier.arrive(empty_r.index(0), count=1)
                        mbarrier.arrive(pa_free, count=1)
                    g += 1
                bits = bits | gl.where(mla.pages_ok(page_flags.index(nq % 2)), 0, BLOCK_TABLE)
                _finish_request(o, l_i, m_i * qk_scale, stats.slice(_L1 * mla._BM, mla._BM),
                                stats.slice(_L0 * mla._BM, mla._BM), fin, q_free, nq, bits, splits_ptr, b, begin_req,
                                begin_split, out_ptr, lse_ptr, partials_ptr, PIECES, pid_m, H, Q_LEN, ROWS, stride_ob,
                                stride_ot, stride_oh, _H, False, OUT_TYPED)
                nq += 1

    @gluon.jit
    def _decode_seesaw_kernel(
        q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
        out_ptr, lse_ptr, partials_ptr, err_ptr,
        B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_btb, PIECES, CAPACITY, num_pages, stride_ob, stride_ot, stride_oh,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, META_W: gl.constexpr, PDL: gl.constexpr,
        WAIT_PRIOR: gl.constexpr, OUT_TYPED: gl.constexpr = False,
    ):
        if WAIT_PRIOR:
            wait_prior_grids()
        if PDL:
            launch_dependents()  # after the wait, as decode.py's kernel
        dtype: gl.constexpr = q_desc.dtype
        half_l: gl.constexpr = q_desc.layout
        pe_l: gl.constexpr = q_pe_desc.layout
        q_h = gl.allocate_shared_memory(dtype, [2, mla._BM, _H], half_l)
        # One-slot buffers: each branch that reads them takes its own ``.index`` view (module docstring).
        q_pe = gl.allocate_shared_memory(dtype, [1, mla._BM, _PE], pe_l)
        kv_l = gl.allocate_shared_memory(dtype, [2, mla._BN, _H], kv_desc.layout)
        kv_r = gl.allocate_shared_memory(dtype, [2, mla._BN, _H], kv_desc.layout)
        kv_pe = gl.allocate_shared_memory(dtype, [2, mla._BN, _PE], kv_pe_desc.layout)
        p_a = gl.allocate_shared_memory(dtype, [1, mla._BM, mla._BN], pe_l)
        # Five rows of statistics (_M .. _L1) in a power-of-two buffer.
        stats = gl.allocate_shared_memory(gl.float32, [8 * mla._BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        page_flags = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bar: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        q_free = gl.allocate_shared_memory(gl.int64, [1], bar)
        ready_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        ready_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        empty_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        a_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        a_issued = gl.allocate_shared_memory(gl.int64, [1], bar)
        b_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        pa_free = gl.allocate_shared_memory(gl.int64, [1], bar)
        pb_free = gl.allocate_shared_memory(gl.int64, [1], bar)
        pe_taken = gl.allocate_shared_memory(gl.int64, [1], bar)
        fin = gl.allocate_shared_memory(gl.int64, [1], bar)
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_free, count=2)
        for i in gl.static_range(2):
            mbarrier.init(ready_l.index(i), count=1)
            mbarrier.init(ready_r.index(i), count=1)
        # Readers of each half: slot 0 left 0 (S_A, P_A V_A,L), right 0 and 1; slot 1 left 1 and 0, right 1.
        mbarrier.init(empty_l.index(0), count=1)
        mbarrier.init(empty_r.index(0), count=2)
        mbarrier.init(empty_l.index(1), count=2)
        mbarrier.init(empty_r.index(1), count=1)
        mbarrier.init(a_ready, count=1)
        mbarrier.init(a_issued, count=1)
        mbarrier.init(b_ready, count=1)
        mbarrier.init(pa_free, count=1)
        mbarrier.init(pb_free, count=1)
        mbarrier.init(pe_taken, count=1)
        mbarrier.init(fin, count=2)
        gl.warp_specialize(
            [(_wg0, (q_h, q_pe, kv_l, kv_r, kv_pe, p_a, stats, q_ready, q_free, ready_l, ready_r, empty_l,
                     empty_r, a_ready, a_issued, b_ready, pa_free, pb_free, pe_taken, fin, page_flags,
                     PIECES, CAPACITY, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, err_ptr, B,
                     PARTS, H, Q_LEN, ROWS, qk_scale, stride_ob, stride_ot, stride_oh, CAUSAL, META_W, OUT_TYPED)),
             (_wg1, (q_h, q_pe, kv_l, kv_r, kv_pe, p_a, stats, q_ready, q_free, ready_l, ready_r, empty_l,
                     empty_r, a_ready, a_issued, b_ready, pa_free, pb_free, pe_taken, fin, page_flags,
                     PIECES, CAPACITY, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS,
                     H, Q_LEN, ROWS, qk_scale, stride_ob, stride_ot, stride_oh, CAUSAL, META_W, OUT_TYPED)),
             (_seesaw_loader, (q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, CAPACITY,
                               num_pages, seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS,
                               q_h, q_pe, kv_l, kv_r, kv_pe, q_ready, q_free, ready_l, ready_r, empty_l,
                               empty_r, page_flags, PAGE, META_W))],
            worker_num_warps=[4, 1],
            worker_num_regs=[232, 32],
        )


_SEESAW = CachedKernel(_decode_seesaw_kernel, ptx_pass=tma_loads_evict_first) if HAVE_GLUON else None


def seesaw_main_args(q_rows, k_cache, block_table, cache_seqlens, metadata, num_splits, softmax_scale, causal,
                     out, lse, partials, err, pdl: bool = False, wait_prior: bool = False, out_typed: bool = False):
    """``decode.sm90_main_args`` for the seesaw kernel: the same arguments and bound-launch address slots
    (q, q, cache, cache), with [64, 256] value-half and [64, 64] rope boxes."""
    b, q_len, h, _ = out.shape
    rows = q_len * h
    parts = metadata.shape[0]
    half_w, pe_w = D_V // 2, D_QK - D_V
    half, pe = shared_layout(BLOCK_M, half_w, q_rows.dtype), shared_layout(BLOCK_M, pe_w, q_rows.dtype)
    kv_flat = k_cache.view(-1, D_QK)
    args = (descriptor(q_rows, [BLOCK_M, half_w], half), descriptor(q_rows, [BLOCK_M, pe_w], pe),
            descriptor(kv_flat, [BLOCK_M, half_w], half), descriptor(kv_flat, [BLOCK_M, pe_w], pe),
            block_table, cache_seqlens, metadata, num_splits, out, lse, partials, err,
            b, parts, h, q_len, rows, softmax_scale * LOG2E, block_table.stride(0), b + parts,
            block_table.shape[1] * k_cache.shape[1], k_cache.shape[0],
            out.stride(0), out.stride(1), out.stride(2))
    options = dict(CAUSAL=bool(causal), PAGE=k_cache.shape[1], META_W=METADATA_WIDTH, PDL=pdl, num_warps=4,
                   OUT_TYPED=out_typed, **wait_prior_options(wait_prior))
    return _SEESAW, (-(-rows // BLOCK_M), parts, 1), args, options
