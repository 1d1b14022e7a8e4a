"""Hopper (sm_90a) variable-q-length paged absorbed attention in Gluon: the decode kernel's structure for
prefill over a cached prefix.

Contract and grid as ``paged_prefill.py`` (request b's tiles start at ``qo_indptr[b] * H // 64 + b``; each
program finds its request by binary search, later tiles first); the work of one program is one 64-row
(token, head) tile of one request over all the keys its rows may see, with the decode kernel's partitions
and steps (``decode_sm90.py``): a TMA loader warp, warpgroup 0 computing S once per 64-key tile and the
online softmax, both warpgroups accumulating half of the 512 value columns from the shared P. No split
of the keys, so no partials: each program writes its rows' output and LSE directly.

The default for ``paged_varlen_attention`` on sm_90 where it applies (measured on the H200: benchmarks/NOTES.md,
Prefill); ``config={"HOPPER": False}`` runs the portable kernel instead.
"""

from __future__ import annotations

import torch

from pagedmla.kernels.triton.decode_sm90 import (
    BLOCK_M,
    BLOCK_N,
    D_QK,
    D_V,
    HAVE_GLUON,
    descriptor,
    sm90_supported,
    tma_rows,
)
from pagedmla.kernels.triton.launch import CachedKernel

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from pagedmla.kernels.triton.decode_sm90 import (
        _BM,
        _BN,
        _DV,
        _O_LAYOUT,
        _S_LAYOUT,
        _load_kv_tile,
        _load_q,
        _mla_buffers,
        _softmax_finish,
        _softmax_tile,
        _tile_layout,
        _value_finish,
        _value_tile,
    )

_LOG2E = 1.4426950408889634

if HAVE_GLUON:

    @gluon.jit
    def _tile_work(qo_ptr, seqlens_ptr, H, batch, CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        """This program's tile: (request, its first q row, rows r0 .. r0 + 63 of its q_len * H, q_len * H,
        kv_len, first key some row cannot see, end of the keys any row sees)."""
        pid = gl.num_programs(0) - 1 - gl.program_id(0)
        # Largest b with tile_start(b) = qo_indptr[b] * H // 64 + b <= pid (tile_start is increasing).
        lo = gl.program_id(0) * 0
        hi = lo + batch - 1
        for _ in gl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            start_mid = (gl.load(qo_ptr + mid).to(gl.int64) * H) // _BM + mid
            go_up = start_mid <= pid
            lo = gl.where(go_up, mid, lo)
            hi = gl.where(go_up, hi, mid - 1)
        b = lo
        q_start = gl.load(qo_ptr + b)
        q_len = gl.load(qo_ptr + b + 1) - q_start
        r0 = (pid - ((q_start.to(gl.int64) * H) // _BM + b)).to(gl.int32) * _BM
        n_rows = q_len * H
        kv_len = gl.load(seqlens_ptr + b)
        if CAUSAL:
            # Token t of the request sees keys 0 .. kv_len - q_len + t.
            last_tok = (gl.minimum(r0 + _BM, n_rows) - 1) // H
            first_masked = gl.minimum(gl.maximum(kv_len - q_len + r0 // H + 1, 0), kv_len)
            end = gl.maximum(gl.minimum(kv_len, kv_len - q_len + last_tok + 1), 0)
        else:
            first_masked = kv_len
            end = kv_len
        return b, q_start * H, r0, n_rows, q_len, kv_len, first_masked, end

    @gluon.jit
    def _store_rows(o, scale, lse2, col0, out_ptr, lse_ptr, row0, r0, n_rows, WRITE_LSE: gl.constexpr,
                    layout: gl.constexpr):
        """Columns col0 .. col0 + 255 of rows r0 .. r0 + 63 (of n_rows), normalised, at flat rows row0 + r of
        out [T * H, 512]; with WRITE_LSE the natural-log LSE at lse[row0 + r]."""
        r = r0 + gl.arange(0, _BM, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, layout))
        flat = row0.to(gl.int64) + r
        ok = r < n_rows
        gl.store(out_ptr + flat[:, None] * _DV + cols[None, :], (o * scale[:, None]).to(out_ptr.dtype.element_ty),
                 mask=ok[:, None])
        if WRITE_LSE:
            gl.store(lse_ptr + flat, lse2 * 0.6931471805599453, mask=ok)

    @gluon.jit
    def _prefill_loader(q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, seqlens_ptr, qo_ptr, H, batch,
                        q_smem, q_pe_smem, kv_ring, kv_pe_ring, q_ready, kv_ready, kv_empty,
                        CAUSAL: gl.constexpr, PAGE: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        b, row0, r0, n_rows, _, _, _, end = _tile_work(qo_ptr, seqlens_ptr, H, batch, CAUSAL, SEARCH_STEPS)
        if r0 < n_rows:
            _load_q(q_desc, q_pe_desc, row0 + r0, q_smem, q_pe_smem, q_ready)
            bt_row = bt_ptr + b.to(gl.int64) * stride_btb
            for n0 in range(0, end, _BN):
                _load_kv_tile(kv_desc, kv_pe_desc, bt_row, n0, n0 // _BN, kv_ring, kv_pe_ring, kv_ready, kv_empty,
                              PAGE)

    @gluon.jit
    def _prefill_softmax_warpgroup(
        q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, kv_ready, kv_empty, p_ready,
        p_free, seqlens_ptr, qo_ptr, out_ptr, lse_ptr, H, batch, qk_scale,
        CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr,
    ):
        s_layout: gl.constexpr = _S_LAYOUT
        o_layout: gl.constexpr = _O_LAYOUT
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        b, row0, r0, n_rows, q_len, kv_len, first_masked, end = _tile_work(qo_ptr, seqlens_ptr, H, batch, CAUSAL,
                                                                           SEARCH_STEPS)
        if r0 < n_rows:
            tok = (r0 + gl.arange(0, _BM, layout=row_l)) // H
            if CAUSAL:
                lim = gl.minimum(kv_len - q_len + 1 + tok, kv_len)
            else:
                lim = gl.zeros([_BM], dtype=gl.int32, layout=row_l) + kv_len
            m_i = gl.full([_BM], float("-inf"), dtype=gl.float32, layout=row_l)
            l_i = gl.zeros([_BM], dtype=gl.float32, layout=row_l)
            o = gl.zeros([_BM, 256], dtype=gl.float32, layout=o_layout)
            mbarrier.wait(q_ready, 0)
            for n0 in range(0, end, _BN):
                # One tile per program: Q is never reloaded, so "Q free" is never signalled (release_q False).
                o, m_i, l_i = _softmax_tile(o, m_i, l_i, n0 // _BN, n0 // _BN, n0, first_masked, lim, kv_len,
                                            False, qk_scale, q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem,
                                            scale_smem, q_free, kv_ready, kv_empty, p_ready, p_free, s_layout,
                                            o_layout)
            inv_l, lse2 = _softmax_finish(m_i, l_i, qk_scale, gl.cdiv(end, _BN), scale_smem, p_ready, p_free)
            _store_rows(o, gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)),
                        gl.convert_layout(lse2, gl.SliceLayout(1, o_layout)), 0, out_ptr, lse_ptr, row0, r0, n_rows,
                        True, o_layout)

    @gluon.jit
    def _prefill_value_warpgroup(kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free, seqlens_ptr,
                                 qo_ptr, out_ptr, lse_ptr, H, batch, CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        o_layout: gl.constexpr = _O_LAYOUT
        _, row0, r0, n_rows, _, kv_len, _, end = _tile_work(qo_ptr, seqlens_ptr, H, batch, CAUSAL, SEARCH_STEPS)
        if r0 < n_rows:
            o = gl.zeros([_BM, 256], dtype=gl.float32, layout=o_layout)
            for n0 in range(0, end, _BN):
                o = _value_tile(o, n0 // _BN, n0 // _BN, n0, kv_len, kv_ring, p_smem, scale_smem, kv_ready, kv_empty,
                                p_ready, p_free, o_layout)
            inv_l = _value_finish(gl.cdiv(end, _BN), scale_smem, p_ready, p_free, o_layout)
            _store_rows(o, inv_l, inv_l, 256, out_ptr, lse_ptr, row0, r0, n_rows, False, o_layout)

    @gluon.jit
    def _paged_prefill_sm90_kernel(
        q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, seqlens_ptr, qo_ptr, out_ptr, lse_ptr,
        H, batch, qk_scale, stride_btb,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, SEARCH_STEPS: gl.constexpr,
    ):
        # q_free is allocated but never arrived on: one tile per program, Q is never reloaded.
        (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, p_ready, p_free, kv_ready,
         kv_empty) = _mla_buffers(q_desc, q_pe_desc, kv_desc, kv_pe_desc)
        gl.warp_specialize(
            [(_prefill_softmax_warpgroup, (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready,
                                           q_free, kv_ready, kv_empty, p_ready, p_free, seqlens_ptr, qo_ptr, out_ptr,
                                           lse_ptr, H, batch, qk_scale, CAUSAL, SEARCH_STEPS)),
             (_prefill_value_warpgroup, (kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free,
                                         seqlens_ptr, qo_ptr, out_ptr, lse_ptr, H, batch, CAUSAL, SEARCH_STEPS)),
             (_prefill_loader, (q_desc, q_pe_desc, kv_desc, kv_pe_desc, bt_ptr, stride_btb, seqlens_ptr, qo_ptr, H,
                                batch, q_smem, q_pe_smem, kv_ring, kv_pe_ring, q_ready, kv_ready, kv_empty, CAUSAL,
                                PAGE, SEARCH_STEPS))],
            worker_num_warps=[4, 1],
            worker_num_regs=[232, 24],
        )

    _MAIN = CachedKernel(_paged_prefill_sm90_kernel)


def paged_prefill_sm90(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                       cache_seqlens: torch.Tensor, qo_indptr: torch.Tensor, softmax_scale: float, causal: bool,
                       out: torch.Tensor, lse: torch.Tensor) -> None:
    """Launch on checked inputs (``paged_varlen_attention`` checks them): q [T, H, 576], out [T, H, 512]
    contiguous, lse [T, H] float32; requires ``sm90_supported(q, k_cache, 512)``."""
    if not sm90_supported(q, k_cache, D_V):
        raise ValueError("config: HOPPER needs an sm_90 GPU, Triton's Gluon, bf16/fp16 q and cache, head dims "
                         "576/512, pages a multiple of 64 and a contiguous cache")
    t, h, d = q.shape
    batch = qo_indptr.shape[0] - 1
    nope, pe = _tile_layout(D_V, q.dtype), _tile_layout(D_QK - D_V, q.dtype)
    q_flat = tma_rows(q.reshape(t * h, d))
    kv_flat = k_cache.view(-1, d)
    _MAIN.launch(
        q.device, ((t * h) // BLOCK_M + batch,),
        descriptor(q_flat, [BLOCK_M, D_V], nope), descriptor(q_flat, [BLOCK_M, D_QK - D_V], pe),
        descriptor(kv_flat, [BLOCK_N, D_V], nope), descriptor(kv_flat, [BLOCK_N, D_QK - D_V], pe),
        block_table, cache_seqlens, qo_indptr, out, lse,
        h, batch, softmax_scale * _LOG2E, block_table.stride(0),
        CAUSAL=bool(causal), PAGE=k_cache.shape[1], SEARCH_STEPS=max(1, batch.bit_length()),
        num_warps=4,
    )
