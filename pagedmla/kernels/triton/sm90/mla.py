"""The absorbed-MLA steps the Hopper (sm_90a) decode and paged-prefill kernels share (576 / 512 head dims).

Both run FlashMLA's structure over 64 query rows: a loader warp streams Q and the [64, 576] KV tiles through a
two-stage shared-memory ring (TMA; block shapes must be powers of two, so each tile is a [64, 512] and a
[64, 64] copy, which Gluon splits into 64-column boxes); warpgroup 0 computes S = Q K^T for the whole 64 x 64
tile (36 wgmma k-steps), the online softmax, writes P and the per-row rescale factor to shared memory and
accumulates O[:, :256] += P V[:, :256]; warpgroup 1 accumulates O[:, 256:] += P V[:, 256:] from the same P.
The kernels differ in their work (``decode.py``: SM parts of the split plan; ``paged_varlen.py``: persistent
tiles of 64 (token, head) rows) and in where results go.

With ``TRANSPOSED`` the same steps compute S^T = K Q^T and O^T = V^T P^T for a Q tile of 16 or 32 rows (``R``,
the N of every MMA): the keys are the MMAs' 64-row M and nothing is padded to 64 query rows, the shape of
the narrow form of ``decode.py`` and ``decode_fp8.py`` (requests of up to 32 query rows, memory bound; the
default there: ``split_plan.NARROW_ROWS``). Per-row vectors (row maxima, sums, rescale factors) then run
along dimension 1 of S and O instead of dimension 0; the keys lie across the warpgroup's four warps, so the
row sums stay per key slot until a request's last tile (a sum per tile was a shared-memory round trip).

Requirements (``sm90_supported`` checks them): CUDA capability 9.0, Triton with Gluon, q and cache bf16 or
fp16, head dims 576 / 512, page size a multiple of 64, a contiguous cache.
"""

from __future__ import annotations

import torch

from pagedmla.device import sm90_available
from pagedmla.kernels.triton.common import checked_page, finish_rows
from pagedmla.kernels.triton.sm90.pipeline import HAVE_GLUON, descriptor, shared_layout
from pagedmla.split_plan import BLOCK_N as SCHED_BLOCK_N

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

    from pagedmla.kernels.triton.sm90.pipeline import free_phase, phase, zero_tail_rows

D_QK, D_V = 576, 512
BLOCK_M = 64
BLOCK_N = SCHED_BLOCK_N  # one KV tile per schedule block (64 tokens)
STAGES = 2
if HAVE_GLUON:  # the same values as compile-time constants for the kernels
    _DV = gl.constexpr(D_V)
    _DR = gl.constexpr(D_QK - D_V)  # the rope columns
    _BM = gl.constexpr(BLOCK_M)
    _BN = gl.constexpr(BLOCK_N)
    _STAGES = gl.constexpr(STAGES)
    # Register layouts of the MLA warpgroups' wgmma results: S (64 x 64 keys) and their half of O (64 x 256).
    S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16]))
    O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 256, 16]))

    @gluon.constexpr_function
    def transposed_layout(rows):
        """The register layout of S^T [64 keys, rows] and of a warpgroup's O^T [256, rows] (``TRANSPOSED``)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, 16])

    @gluon.constexpr_function
    def key_dim(transposed):
        """The dimension of S (and O) that is not the query rows': per-row vectors are sliced along it."""
        return 0 if transposed else 1


def sm90_supported(q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether the Gluon MLA kernels can run this call (see the module docstring)."""
    if not (sm90_available(q.device) and k_cache.is_cuda):
        return False
    page = k_cache.shape[1]
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and q.shape[-1] == D_QK and head_dim_v == D_V and k_cache.shape[2] == 1
            and page % BLOCK_N == 0 and k_cache.is_contiguous() and k_cache.data_ptr() % 16 == 0)


def row_descriptors(x: torch.Tensor, rows: int) -> tuple:
    """TMA descriptors of 16-bit rows [n, 576] (q from ``tma_rows``, or cache rows): a 512-column (value) and a
    64-column (rope) box of ``rows`` rows."""
    nope, pe = shared_layout(rows, D_V, x.dtype), shared_layout(rows, D_QK - D_V, x.dtype)
    return descriptor(x, [rows, D_V], nope), descriptor(x, [rows, D_QK - D_V], pe)


def mla_descriptors(q_rows: torch.Tensor, kv_flat: torch.Tensor, q_block: int = BLOCK_M) -> tuple:
    """The four TMA descriptors of the MLA kernels: q rows [n, 576] (from ``tma_rows``) in tiles of ``q_block``
    rows and the cache rows [slots, 576] (``row_descriptors``)."""
    return (*row_descriptors(q_rows, q_block), *row_descriptors(kv_flat, BLOCK_N))


if HAVE_GLUON:

    @gluon.jit
    def pages_ok(flag):
        """Warpgroup side of the page check: whether the loader found every page id of the request (or tile)
        it last loaded into ``flag``'s slot inside the cache. Read after the wait for that request's last KV
        tile, which the loader signalled after writing the flag: the check costs the warpgroups no global
        load in their tile loop."""
        return gl.max(flag.load(gl.BlockedLayout([1], [32], [4], [0])), axis=0) == 0

    @gluon.jit
    def load_q(q_desc, q_pe_desc, q_row, q_smem, q_pe_smem, q_ready):
        mbarrier.expect(q_ready, q_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready, q_smem)
        tma.async_copy_global_to_shared(q_pe_desc, [q_row, _DV], q_ready, q_pe_smem)

    @gluon.jit
    def next_kv_page(bt_row, n0, tok_hi, bad, flag, num_pages, PAGE: gl.constexpr):
        """Loader step over a request's KV tokens n0 .. n0 + 63 (tok_hi its end, bad whether any page so far
        was outside the cache): (the next tile's checked page id, bad with it). Page ids are read one tile
        ahead, so no refill waits on a block-table read (the last tile's look-ahead re-reads its own entry:
        inside the row, tok_hi <= the row's capacity); before the last tile the request's page check goes
        into ``flag`` (``pages_ok``)."""
        next_page, next_bad = checked_page(gl.load(bt_row + gl.minimum(n0 + _BN, tok_hi - 1) // PAGE), num_pages)
        if n0 + _BN >= tok_hi:
            flag.store(gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [1], [0])) + bad.to(gl.int32))
            gl.thread_barrier()  # the whole warp's store before the one thread that signals the tile
        return next_page, bad | next_bad

    @gluon.jit
    def load_kv_tiles(kv_desc, kv_pe_desc, bt_row, first_page, tok_lo, tok_hi, it, kv_ring, kv_pe_ring, kv_ready,
                       kv_empty, flag, num_pages, PAGE: gl.constexpr):
        """Loader: KV tokens tok_lo .. tok_hi - 1 of one request (tok_lo a multiple of 64, tok_lo < tok_hi,
        tok_hi within the block-table row's capacity) into the ring from slot it on, 64 per slot; first_page
        is the block-table entry of tok_lo, already loaded. Each tile's page id is loaded one tile ahead, so
        no refill waits on a block-table read; a page id outside the cache reads page 0, and whether any did
        goes into ``flag`` (an int32 [1] shared-memory slot) before the last tile is signalled, for warpgroup
        0 to poison the request (``pages_ok``). Returns the ring position after the last tile."""
        page_id, bad = checked_page(first_page, num_pages)
        for n0 in range(tok_lo, tok_hi, _BN):
            next_page, bad = next_kv_page(bt_row, n0, tok_hi, bad, flag, num_pages, PAGE)
            s = it % _STAGES
            mbarrier.wait(kv_empty.index(s), free_phase(it, _STAGES))
            row = page_id * PAGE + n0 % PAGE
            ready = kv_ready.index(s)
            mbarrier.expect(ready, kv_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kv_desc, [row, 0], ready, kv_ring.index(s))
            tma.async_copy_global_to_shared(kv_pe_desc, [row, _DV], ready, kv_pe_ring.index(s))
            page_id = next_page
            it += 1
        return it

    @gluon.jit
    def softmax_tile(o, m_i, l_i, it, npm, n0, first_masked, lim, seqlen, release_q, qk_scale,
                      q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_free, kv_ready, kv_empty,
                      p_ready, p_free, s_layout: gl.constexpr, o_layout: gl.constexpr, KEEP_LAST: gl.constexpr,
                      TRANSPOSED: gl.constexpr = False):
        """Warpgroup 0's step over KV tokens n0 .. n0 + 63 (ring slot it, P message npm): S = Q K^T, the
        online softmax (scores of keys >= lim masked once the tile reaches first_masked), P and the rescale
        factor to shared memory for warpgroup 1, O[:, :256] += P V[:, :256]. ``release_q`` marks the last
        tile, whose slot ``KEEP_LAST`` keeps (the caller stages its output there). Returns (o, m_i, l_i).
        ``TRANSPOSED``: S^T = K Q^T, P^T and O^T[:256] += V[:, :256]^T P^T (see the module docstring), and l_i
        holds the row sums per key slot, [64 keys, R] in S^T's layout (``softmax_tiles`` adds them up)."""
        KD: gl.constexpr = key_dim(TRANSPOSED)
        s = it % _STAGES
        kv = kv_ring.index(s)
        kv_pe = kv_pe_ring.index(s)
        mbarrier.wait(kv_ready.index(s), phase(it, _STAGES))
        if TRANSPOSED:
            R: gl.constexpr = q_smem.shape[0]
            zero_s = gl.zeros([_BN, R], dtype=gl.float32, layout=s_layout)
            acc = warpgroup_mma(kv, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(kv_pe, q_pe_smem.permute((1, 0)), acc, is_async=True)
        else:
            zero_s = gl.zeros([_BM, _BN], dtype=gl.float32, layout=s_layout)
            acc = warpgroup_mma(q_smem, kv.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(q_pe_smem, kv_pe.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, q_smem, q_pe_smem, kv, kv_pe))[0]
        if release_q:
            mbarrier.arrive(q_free, count=1)
        if n0 + _BN > first_masked:
            keys = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(1 - KD, s_layout))
            acc = gl.where(gl.expand_dims(keys, 1 - KD) < gl.expand_dims(lim, KD), acc, float("-inf"))
        if n0 + _BN > seqlen:
            zero_tail_rows(kv, 0, seqlen - n0, 4, 4)
        # The row max is kept unscaled (qk_scale > 0) so that the scale folds into one FMA per score.
        m_new = gl.maximum(m_i, gl.max(acc, axis=KD))
        # A row with no visible key yet keeps max -inf: subtract 0 instead so exp2 gives 0, not NaN.
        m_sc = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.exp2(m_i * qk_scale - m_sc)
        p = gl.exp2(acc * qk_scale - gl.expand_dims(m_sc, KD))
        if TRANSPOSED:
            # Summed once per request (``softmax_tiles``; module docstring): FP8 narrow tiles 3-10% faster.
            l_i = l_i * gl.expand_dims(alpha, KD) + p
        else:
            l_i = l_i * alpha + gl.sum(p, axis=KD)
        # Warpgroup 1 has finished reading the previous P and scale.
        mbarrier.wait(p_free, free_phase(npm, 1))
        p_smem.store(p.to(p_smem.dtype))
        scale_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(KD, o_layout)), KD)
        if TRANSPOSED:
            o = warpgroup_mma(kv.slice(0, 256, dim=1).permute((1, 0)), p_smem, o, is_async=True)
        else:
            o = warpgroup_mma(p_smem, kv.slice(0, 256, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_smem, kv))[0]
        if KEEP_LAST:
            if not release_q:
                mbarrier.arrive(kv_empty.index(s), count=1)
        else:
            mbarrier.arrive(kv_empty.index(s), count=1)
        return o, m_new, l_i

    @gluon.jit
    def softmax_tiles(it, npm, lo, hi, first_masked, lim, seqlen, qk_scale, q_smem, q_pe_smem, kv_ring, kv_pe_ring,
                      p_smem, scale_smem, q_free, kv_ready, kv_empty, p_ready, p_free, s_layout: gl.constexpr,
                      o_layout: gl.constexpr, KEEP_LAST: gl.constexpr, TRANSPOSED: gl.constexpr = False):
        """Warpgroup 0's ``softmax_tile`` steps over one request's (tile's) KV tokens lo .. hi - 1 (Q loaded):
        ring slots from it, P messages from npm; the last S hands Q back to the loader; with ``KEEP_LAST`` the
        last slot stays held (the caller frees it after its output). Returns (o, m_i, l_i, it, npm) after the
        last step."""
        row_l: gl.constexpr = gl.SliceLayout(key_dim(TRANSPOSED), s_layout)
        R: gl.constexpr = q_smem.shape[0]
        m_i = gl.full([R], float("-inf"), dtype=gl.float32, layout=row_l)
        if TRANSPOSED:
            l_i = gl.zeros([_BN, R], dtype=gl.float32, layout=s_layout)
            o = gl.zeros([256, R], dtype=gl.float32, layout=o_layout)
        else:
            l_i = gl.zeros([R], dtype=gl.float32, layout=row_l)
            o = gl.zeros([R, 256], dtype=gl.float32, layout=o_layout)
        for n0 in range(lo, hi, _BN):
            o, m_i, l_i = softmax_tile(o, m_i, l_i, it, npm, n0, first_masked, lim, seqlen, n0 + _BN >= hi, qk_scale,
                                       q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_free, kv_ready,
                                       kv_empty, p_ready, p_free, s_layout, o_layout, KEEP_LAST, TRANSPOSED)
            npm += 1
            it += 1
        if TRANSPOSED:
            l_i = gl.sum(l_i, axis=0)
        return o, m_i, l_i, it, npm

    @gluon.jit
    def softmax_finish(m_i, l_i, qk_scale, bad, npm, scale_smem, p_ready, p_free):
        """(1 / l, log2 LSE) of warpgroup 0's rows (m_i unscaled, as ``softmax_tile`` keeps it; both NaN when
        ``bad``, see ``finish_rows``); sends 1 / l to warpgroup 1 as message npm, so a poisoned request's
        other half is poisoned too."""
        inv_l, lse2 = finish_rows(l_i, m_i * qk_scale, bad)
        # The final message to warpgroup 1 carries 1 / l instead of a rescale factor.
        mbarrier.wait(p_free, free_phase(npm, 1))
        scale_smem.store(inv_l)
        mbarrier.arrive(p_ready, count=1)
        return inv_l, lse2

    @gluon.jit
    def value_tile(o, it, npm, n0, seqlen, last, kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free,
                    o_layout: gl.constexpr, KEEP_LAST: gl.constexpr, TRANSPOSED: gl.constexpr = False):
        """Warpgroup 1's step: O[:, 256:] = O[:, 256:] * rescale + P V[:, 256:] for ring slot it (the
        ``last`` tile's slot kept with ``KEEP_LAST``); ``TRANSPOSED``: O^T[256:] from P^T."""
        KD: gl.constexpr = key_dim(TRANSPOSED)
        s = it % _STAGES
        kv = kv_ring.index(s)
        mbarrier.wait(kv_ready.index(s), phase(it, _STAGES))
        if n0 + _BN > seqlen:
            # Warpgroup 0's S may still be reading these bytes as keys: only scores of keys past seqlen
            # change, and those are replaced by -inf (a select, not a multiply).
            zero_tail_rows(kv, 256, seqlen - n0, 4, 4)
        mbarrier.wait(p_ready, phase(npm, 1))
        o = o * gl.expand_dims(scale_smem.load(gl.SliceLayout(KD, o_layout)), KD)
        if TRANSPOSED:
            o = warpgroup_mma(kv.slice(256, 256, dim=1).permute((1, 0)), p_smem, o, is_async=True)
        else:
            o = warpgroup_mma(p_smem, kv.slice(256, 256, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_smem, kv))[0]
        mbarrier.arrive(p_free, count=1)
        if KEEP_LAST:
            if not last:
                mbarrier.arrive(kv_empty.index(s), count=1)
        else:
            mbarrier.arrive(kv_empty.index(s), count=1)
        return o

    @gluon.jit
    def value_tiles(it, npm, lo, hi, seqlen, kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free,
                    o_layout: gl.constexpr, KEEP_LAST: gl.constexpr, TRANSPOSED: gl.constexpr = False):
        """Warpgroup 1's ``value_tile`` steps over one request's (tile's) KV tokens lo .. hi - 1 (ring slots
        from it, P messages from npm), then its 1 / l from warpgroup 0 (NaN for a request warpgroup 0 found
        bad); with ``KEEP_LAST`` the last slot stays held (the caller frees it after its output). Returns (o,
        1 / l, it, npm) after the last message."""
        if TRANSPOSED:
            R: gl.constexpr = p_smem.shape[1]
            o = gl.zeros([256, R], dtype=gl.float32, layout=o_layout)
        else:
            o = gl.zeros([_BM, 256], dtype=gl.float32, layout=o_layout)
        for n0 in range(lo, hi, _BN):
            o = value_tile(o, it, npm, n0, seqlen, n0 + _BN >= hi, kv_ring, p_smem, scale_smem, kv_ready, kv_empty,
                           p_ready, p_free, o_layout, KEEP_LAST, TRANSPOSED)
            npm += 1
            it += 1
        inv_l = value_finish(npm, scale_smem, p_ready, p_free, o_layout, TRANSPOSED)
        return o, inv_l, it, npm + 1

    @gluon.jit
    def value_finish(npm, scale_smem, p_ready, p_free, o_layout: gl.constexpr, TRANSPOSED: gl.constexpr = False):
        """Warpgroup 1 receives 1 / l (message npm)."""
        mbarrier.wait(p_ready, phase(npm, 1))
        inv_l = scale_smem.load(gl.SliceLayout(key_dim(TRANSPOSED), o_layout))
        mbarrier.arrive(p_free, count=1)
        return inv_l

    @gluon.jit
    def kv_scale(kv_scale_ptr, KV_SCALED: gl.constexpr):
        """The cache's value scale: 1, or with KV_SCALED the float32 at ``kv_scale_ptr`` (an fp8_e4m3 cache whose
        rows reach the MMAs without it: the paged prefill's dequantised pages, ``rows.dequantize_pages``, and
        the FP8 decode's converted tiles; scores and outputs take it here, so that the dots see exact values)."""
        if KV_SCALED:
            return gl.load(kv_scale_ptr)
        return 1.0

    @gluon.jit
    def mla_buffers(q_desc, q_pe_desc, dtype: gl.constexpr, TRANSPOSED: gl.constexpr = False):
        """Shared memory and barriers of the MLA kernels: Q (q_desc's type), the two-stage KV ring and P in
        ``dtype`` (the MMAs' operand type: q's, or fp16 for an FP8 cache's converted tiles, ``decode_fp8.py``),
        P's per-row scale; ready/free barriers for Q, each ring slot (freed by both warpgroups) and P; the
        page-check flags. ``TRANSPOSED``: P^T [64 keys, Q's rows]."""
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, _DV], dtype)
        kv_pe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, _DR], dtype)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        q_pe_smem = gl.allocate_shared_memory(q_desc.dtype, q_pe_desc.block_type.shape, q_pe_desc.layout)
        kv_ring = gl.allocate_shared_memory(dtype, [_STAGES, _BN, _DV], kv_layout)
        kv_pe_ring = gl.allocate_shared_memory(dtype, [_STAGES, _BN, _DR], kv_pe_layout)
        R: gl.constexpr = q_desc.block_type.shape[0]
        if TRANSPOSED:
            pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, R], dtype)
            p_smem = gl.allocate_shared_memory(dtype, [_BN, R], pt_layout)
        else:
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, _BN], dtype)
            p_smem = gl.allocate_shared_memory(dtype, [R, _BN], p_layout)
        scale_smem = gl.allocate_shared_memory(gl.float32, [R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
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
