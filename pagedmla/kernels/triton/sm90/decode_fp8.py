"""Hopper (sm_90a) MLA decode main kernel over an FP8 latent cache (``fp8_e4m3`` or ``fp8_ds_mla``).

``decode.py``'s kernel with one more partition: its two MMA warpgroups run unchanged on a 16-bit (fp16) KV
ring, and a two-warp converter fills that ring from the FP8 bytes the loader warp's TMA brings, so the cache
is read at its own size and widened once per tile, in shared memory, between the TMA load and the MMAs. Two
warps, not four: past 12 warps Triton caps every thread at 128 registers (the kernel's 65536 / 16 warps) and
the MMA warpgroups' 64 x 256 accumulators no longer compile (the narrow form's, below, do: it has four).

Why in place: the 16-bit kernel already uses 229 KB of the SM's 227 KiB (Q 72 KB, two 72 KB ring slots, P)
and leaves no room for an FP8 staging ring. So the loader's TMA writes a tile's FP8 bytes into the upper
half of the 16-bit slot it will become (latent: bytes 32 K .. 64 K of the [64, 512] slot; fp8_e4m3's rope:
bytes 4 K .. 8 K of the [64, 64] one; fp8_ds_mla's bf16 rope: the whole rope slot), and the converter widens
the latent in 128-column boxes: boxes 0 and 1 land below the FP8 bytes, boxes 2 and 3 over FP8 bytes already
read (every warp has read them: one barrier before those stores). The widening:
- fp8_e4m3: each byte to fp16, exact (``cvt.rn.f16x2.e4m3x2``: every e4m3 value is an fp16 normal); the
  layer's ``k_scale`` multiplies the scores and the outputs instead (``mla.kv_scale``; its sign goes into
  Q, so that the scores' scale stays positive, as the softmax's unscaled row maxima need);
- fp8_ds_mla: each byte to fp16 times its 128-column tile's scale in fp16 (exact for the format's
  power-of-two scales, 2^-13 and up; another float32 scale is rounded to fp16 first), the bf16 rope to fp16
  (exact below 65504 in magnitude and above 2^-14, rounded to fp16's subnormals below).
Q comes by TMA in q's dtype (bf16 / fp16) and is converted in place to fp16 once per request and 64-row
tile, times one power of two that takes the tile's largest magnitude to just below 2^15
(``common.fp16_row_scale``: a tile's rows share it, since fp16 keeps values down to 2^-24 of that largest
magnitude at an absolute error far below bf16's own rounding); the scores take its inverse. Padding rows
past the request's (the next requests' rows, or TMA's zeros) do not enter the maximum.

Narrow form (requests of up to 32 query rows: 16 / 32 heads at q_len 1, 16 heads at q_len 2, the
memory-bound cells an FP8 cache exists for; ``split_plan.NARROW_ROWS`` per format): the Q tile holds 16 or 32 rows
and the warpgroups run ``mla.py``'s ``TRANSPOSED`` steps, S^T = K Q^T [64 keys, rows] and O^T = V^T P^T
[512, rows], the keys being every MMA's 64-row M. The 64-row form pads such a request to 64 query rows:
per tile 36 m64n64k16 and 8 m64n256k16 (8.9 MFLOP, ~2.5 us on the H200 at the one-softmax kernel's rate),
more than the tile's 36 KB of FP8 take to stream (~1.2 us at an SM's share of the bandwidth); the narrow
form issues 36 m64nRk16 for S^T and 2 x 16 for O^T (2.2 / 4.5 MFLOP at 16 / 32 rows), and its converter
has four warps, not two (``_converter_warps``). Loader, ring and guards are the same; the rows of a 16- or
32-row tile past the request's (the next request's q, or TMA's zeros) are computed and never stored.

Barriers beyond ``decode.py``'s: the TMA completes ``q_landed`` / ``kv_landed`` (the loader's), the converter
arrives on ``q_ready`` / ``kv_ready``, which the MMA warpgroups wait on as before; both still free a slot
through ``kv_empty`` before the loader refills it. Unused cache slots of a sequence's last tile are converted
as they are (NaN bytes stay NaN) and zeroed by the warpgroups as in ``decode.py``. Page ids, lengths and the
schedule are guarded as there.

Requirements (``sm90_fp8_supported``): CUDA capability 9.0, Triton with Gluon, q bf16 / fp16 with head dims
576 / 512, an FP8 cache of 576 (fp8_e4m3) or 656 (fp8_ds_mla) bytes per row, page size a multiple of 64, a
contiguous cache with a 16-byte aligned base.
"""

from __future__ import annotations

import functools

import torch

from pagedmla.device import sm90_available
from pagedmla.kernels.triton.common import LOG2E, fp16_row_scale, kv_format_width, wait_prior_options
from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.kernels.triton.metadata import part_bounds, request_span
from pagedmla.kernels.triton.sm90 import decode as hopper_decode
from pagedmla.kernels.triton.sm90 import mla
from pagedmla.kernels.triton.sm90.mla import BLOCK_M, BLOCK_N, D_QK, D_V
from pagedmla.kernels.triton.sm90.pipeline import HAVE_GLUON, descriptor, shared_layout, tma_loads_evict_first
from pagedmla.kv_format import DS_ROPE_OFFSET, DS_SCALES_OFFSET, DS_TILE, DS_TILES, ROPE_DIM
from pagedmla.split_plan import METADATA_WIDTH

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from pagedmla.kernels.triton.common import checked_page
    from pagedmla.kernels.triton.sm90.pipeline import free_phase, launch_dependents, phase, wait_prior_grids

_FORMAT_IDS = {"fp8_e4m3": 1, "fp8_ds_mla": 2}

if HAVE_GLUON:
    _DS_SC_COL = gl.constexpr(DS_SCALES_OFFSET // 4)  # fp8_ds_mla's scales, in float32 columns of a row
    _DS_PE_COL = gl.constexpr(DS_ROPE_OFFSET // 2)  # its rope, in bf16 columns
    _DS_TILE = gl.constexpr(DS_TILE)
    _DS_TILES = gl.constexpr(DS_TILES)
    _PE = gl.constexpr(ROPE_DIM)

    @gluon.constexpr_function
    def _converter_warps(transposed):
        """The converter's warps: two beside the 64-row form's MMA warpgroups (past 12 warps Triton caps every
        thread at 128 registers, and their 64 x 256 accumulators no longer compile), four beside the narrow
        form's, whose O^T halves are 256 x 16 / 32 (its MMAs wait on the conversion otherwise)."""
        return 4 if transposed else 2

    @gluon.constexpr_function
    def _worker_regs(transposed):
        """Registers per thread of the value warpgroup, the loader and the converter (spills by budget:
        benchmarks/NOTES.md, FP8, "The Hopper FP8 decode" and "The narrow form")."""
        return [128, 24, 96] if transposed else [168, 24, 96]

    @gluon.constexpr_function
    def _bytes_layout(warps):
        """Converter register tile: 16 consecutive bytes (one 16-byte shared load) of a 128-column latent box
        per thread, 8 threads to a box row."""
        return gl.BlockedLayout([1, 16], [4, 8], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _halves_layout(warps):
        """Converter register tile: 8 consecutive 16-bit values of a 64-column Q / rope box per thread."""
        return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])

@functools.cache
def _fp8_layout(rows: int, width: int):
    return gl.NVMMASharedLayout.get_default_for([rows, width], gl.float8e4nv)


@functools.cache
def _scales_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_N, DS_TILES], gl.float32)


def sm90_fp8_supported(q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int, kv_fmt: str | None) -> bool:
    """Whether this kernel can run the call (see the module docstring)."""
    if kv_fmt not in _FORMAT_IDS or not (sm90_available(q.device) and k_cache.is_cuda):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == D_QK and head_dim_v == D_V
            and k_cache.element_size() == 1 and k_cache.shape[-1] == kv_format_width(kv_fmt, D_QK)
            and k_cache.shape[2] == 1 and k_cache.shape[1] % BLOCK_N == 0 and k_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0)


def fp8_descriptors(k_cache: torch.Tensor, kv_fmt: str) -> tuple:
    """The cache's three TMA descriptors, in kernel order: latent bytes [64, 512], rope (fp8_e4m3: bytes [64,
    64] at byte 512; fp8_ds_mla: bf16 [64, 64] at byte 528), fp8_ds_mla's scales float32 [64, 4] at byte 512
    (None for fp8_e4m3)."""
    rows = k_cache.view(torch.float8_e4m3fn).view(-1, k_cache.shape[-1])
    latent = descriptor(rows, [BLOCK_N, D_V], _fp8_layout(BLOCK_N, D_V))
    if kv_fmt == "fp8_e4m3":
        return latent, descriptor(rows, [BLOCK_N, ROPE_DIM], _fp8_layout(BLOCK_N, ROPE_DIM)), None
    rope = descriptor(rows.view(torch.bfloat16), [BLOCK_N, ROPE_DIM], shared_layout(BLOCK_N, ROPE_DIM, torch.bfloat16))
    return latent, rope, descriptor(rows.view(torch.float32), [BLOCK_N, DS_TILES], _scales_layout())


if HAVE_GLUON:

    @gluon.jit
    def _fp8_views(kv_ring, kv_pe_ring, lat_desc, pe_desc, KV_FMT: gl.constexpr):
        """The ring's slots as the TMA fills them: (latent bytes [2 * STAGES, 64, 512], slot s's upper half at
        2 s + 1; rope [2 * STAGES, 64, 64] bytes for fp8_e4m3, upper half at 2 s + 1, or [STAGES, 64, 64]
        bf16 for fp8_ds_mla, the whole slot s)."""
        lat8 = kv_ring._reinterpret(gl.float8e4nv, [2 * mla._STAGES, mla._BN, mla._DV], lat_desc.layout)
        if KV_FMT == 1:
            pe_in = kv_pe_ring._reinterpret(gl.float8e4nv, [2 * mla._STAGES, mla._BN, _PE], pe_desc.layout)
        else:
            pe_in = kv_pe_ring._reinterpret(gl.bfloat16, [mla._STAGES, mla._BN, _PE], pe_desc.layout)
        return lat8, pe_in

    @gluon.jit
    def _load_fp8_tiles(lat_desc, pe_desc, sc_desc, bt_row, first_page, tok_lo, tok_hi, it, lat8, pe_in, sc_ring,
                        kv_landed, kv_empty, flag, num_pages, PAGE: gl.constexpr, KV_FMT: gl.constexpr):
        """Loader: ``mla.load_kv_tiles`` for FP8 rows (the same page checks, one tile of look-ahead): each
        tile's bytes into the upper halves of its ring slot (``_fp8_views``), completing ``kv_landed``."""
        page_id, bad = checked_page(first_page, num_pages)
        for n0 in range(tok_lo, tok_hi, mla._BN):
            next_page, bad = mla.next_kv_page(bt_row, n0, tok_hi, bad, flag, num_pages, PAGE)
            s = it % mla._STAGES
            mbarrier.wait(kv_empty.index(s), free_phase(it, mla._STAGES))
            row = page_id * PAGE + n0 % PAGE
            landed = kv_landed.index(s)
            if KV_FMT == 1:
                mbarrier.expect(landed, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(lat_desc, [row, 0], landed, lat8.index(2 * s + 1))
                tma.async_copy_global_to_shared(pe_desc, [row, mla._DV], landed, pe_in.index(2 * s + 1))
            else:
                mbarrier.expect(landed, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes
                                + sc_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(lat_desc, [row, 0], landed, lat8.index(2 * s + 1))
                tma.async_copy_global_to_shared(pe_desc, [row, _DS_PE_COL], landed, pe_in.index(s))
                tma.async_copy_global_to_shared(sc_desc, [row, _DS_SC_COL], landed, sc_ring.index(s))
            page_id = next_page
            it += 1
        return it

    @gluon.jit
    def _fp8_loader(q_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, bt_ptr, stride_btb, CAPACITY, num_pages,
                    seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_smem, q_pe_smem,
                    kv_ring, kv_pe_ring, sc_ring, q_landed, q_free, kv_landed, kv_empty, page_flags,
                    PAGE: gl.constexpr, META_W: gl.constexpr, KV_FMT: gl.constexpr):
        lat8, pe_in = _fp8_views(kv_ring, kv_pe_ring, lat_desc, pe_desc, KV_FMT)
        q_row0 = gl.program_id(0) * q_smem.shape[0]
        begin_req, begin_blk, end_req, end_blk, _ = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        it = 0
        nq = 0
        for b in range(begin_req, end_req + 1):
            bt_row, first_page, tok_lo, tok_hi = hopper_decode.slice_start(bt_ptr, stride_btb, seqlens_ptr, b,
                                                                           begin_req, begin_blk, end_req, end_blk,
                                                                           CAPACITY, PAGE)
            if tok_lo < tok_hi:
                mbarrier.wait(q_free, free_phase(nq, 1))
                mla.load_q(q_desc, q_pe_desc, b * ROWS + q_row0, q_smem, q_pe_smem, q_landed)
                it = _load_fp8_tiles(lat_desc, pe_desc, sc_desc, bt_row, first_page, tok_lo, tok_hi, it, lat8, pe_in,
                                     sc_ring, kv_landed, kv_empty, page_flags.index(nq % 2), num_pages, PAGE, KV_FMT)
                nq += 1
        hopper_decode.schedule_verdict(seqlens_ptr, meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS)

    @gluon.jit
    def _convert_q(q_smem, q_pe_smem, q16, q_pe16, q_scale_smem, valid_rows, q_sign, CW: gl.constexpr):
        """Q of one request's row tile (64 rows, or the narrow form's 16 / 32), in place, to fp16 times the
        power of two of its rows below ``valid_rows`` and ``q_sign`` (+-1: fp8_e4m3's k_scale may be negative,
        and the softmax needs a positive score scale); the inverse power of two goes to ``q_scale_smem`` for
        the softmax warpgroup. Each thread rewrites the elements it read (the same layout both times), so no
        barrier sits between reads and writes."""
        _HALVES: gl.constexpr = _halves_layout(CW)
        rows = gl.arange(0, q_smem.shape[0], layout=gl.SliceLayout(1, _HALVES))
        amax = gl.max(gl.abs(q_pe_smem.load(_HALVES).to(gl.float32)), axis=1)
        for c in gl.static_range(mla._DV // 64):
            amax = gl.maximum(amax, gl.max(gl.abs(q_smem.slice(64 * c, 64, dim=1).load(_HALVES).to(gl.float32)),
                                           axis=1))
        q_mul, q_inv = fp16_row_scale(gl.max(gl.where(rows < valid_rows, amax, 0.0), axis=0))
        q_mul = q_mul * q_sign
        for c in gl.static_range(mla._DV // 64):
            x = q_smem.slice(64 * c, 64, dim=1).load(_HALVES)
            q16.slice(64 * c, 64, dim=1).store((x.to(gl.float32) * q_mul).to(gl.float16))
        x = q_pe_smem.load(_HALVES)
        q_pe16.store((x.to(gl.float32) * q_mul).to(gl.float16))
        q_scale_smem.store(gl.full([1], 0.0, gl.float32, gl.BlockedLayout([1], [32], [CW], [0])) + q_inv)

    @gluon.jit
    def _widen(x, sc, c: gl.constexpr, KV_FMT: gl.constexpr):
        """A latent box's bytes [64, 128] as fp16 values (fp8_ds_mla: times its rows' scale of tile c)."""
        y = x.to(gl.float16)
        if KV_FMT == 2:
            y = y * sc.slice(c, 1, dim=1).load(x.type.layout).to(gl.float16)
        return y

    @gluon.jit
    def _convert_tile(kv16, lat8, pe16, pe_in, sc, KV_FMT: gl.constexpr, CW: gl.constexpr):
        """One ring slot from its FP8 bytes to fp16: latent box c's 128 fp16 columns go to bytes 16 K c ..
        16 K c + 16 K of the slot, and its FP8 bytes lie at 32 K + 8 K c, so boxes 2 and 3 overwrite boxes 0
        to 3's bytes: each waits until every warp has read those (the rope, rewritten over its own bytes, too)."""
        _BYTES: gl.constexpr = _bytes_layout(CW)
        for c in gl.static_range(2):
            x = lat8.slice(_DS_TILE * c, _DS_TILE, dim=1).load(_BYTES)
            kv16.slice(_DS_TILE * c, _DS_TILE, dim=1).store(_widen(x, sc, c, KV_FMT))
        x = lat8.slice(2 * _DS_TILE, _DS_TILE, dim=1).load(_BYTES)
        gl.thread_barrier()
        kv16.slice(2 * _DS_TILE, _DS_TILE, dim=1).store(_widen(x, sc, 2, KV_FMT))
        x = lat8.slice(3 * _DS_TILE, _DS_TILE, dim=1).load(_BYTES)
        pe = pe_in.load(_halves_layout(CW))
        gl.thread_barrier()
        kv16.slice(3 * _DS_TILE, _DS_TILE, dim=1).store(_widen(x, sc, 3, KV_FMT))
        pe16.store(pe.to(gl.float16))

    @gluon.jit
    def _signal(bar):
        """The converter's stores of a Q tile or KV slot visible to the MMAs (async proxy), then one arrive."""
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _converter(q_smem, q_pe_smem, kv_ring, kv_pe_ring, sc_ring, q_scale_smem, q_landed, q_ready, kv_landed,
                   kv_ready, lat_desc, pe_desc, seqlens_ptr, meta_ptr, kv_scale_ptr, B, ROWS, CAPACITY,
                   META_W: gl.constexpr, KV_FMT: gl.constexpr, CW: gl.constexpr):
        lat8, pe_in = _fp8_views(kv_ring, kv_pe_ring, lat_desc, pe_desc, KV_FMT)
        q_sign = 1.0
        if KV_FMT == 1:
            q_sign = gl.where(gl.load(kv_scale_ptr) < 0, -1.0, 1.0)
        q16 = q_smem._reinterpret(gl.float16, q_smem.shape, q_smem.layout)
        q_pe16 = q_pe_smem._reinterpret(gl.float16, q_pe_smem.shape, q_pe_smem.layout)
        valid_rows = ROWS - gl.program_id(0) * q_smem.shape[0]
        begin_req, begin_blk, end_req, end_blk, _ = part_bounds(meta_ptr, gl.program_id(1), B - 1, META_W)
        it = 0
        nq = 0
        for b in range(begin_req, end_req + 1):
            _, tok_lo, tok_hi, _ = request_span(seqlens_ptr, b, begin_req, begin_blk, end_req, end_blk, CAPACITY,
                                                mla._BN)
            if tok_lo < tok_hi:
                mbarrier.wait(q_landed, phase(nq, 1))
                _convert_q(q_smem, q_pe_smem, q16, q_pe16, q_scale_smem, valid_rows, q_sign, CW)
                _signal(q_ready)
                nq += 1
                for _ in range(tok_lo, tok_hi, mla._BN):
                    s = it % mla._STAGES
                    mbarrier.wait(kv_landed.index(s), phase(it, mla._STAGES))
                    if KV_FMT == 1:
                        _convert_tile(kv_ring.index(s), lat8.index(2 * s + 1), kv_pe_ring.index(s),
                                      pe_in.index(2 * s + 1), sc_ring, KV_FMT, CW)
                    else:
                        _convert_tile(kv_ring.index(s), lat8.index(2 * s + 1), kv_pe_ring.index(s), pe_in.index(s),
                                      sc_ring.index(s), KV_FMT, CW)
                    _signal(kv_ready.index(s))
                    it += 1

    @gluon.jit
    def _decode_sm90_fp8_kernel(
        q_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
        out_ptr, lse_ptr, partials_ptr, err_ptr, kv_scale_ptr,
        B, PARTS, H, Q_LEN, ROWS, qk_scale, stride_btb, PIECES, CAPACITY, num_pages, stride_ob, stride_ot, stride_oh,
        CAUSAL: gl.constexpr, PAGE: gl.constexpr, META_W: gl.constexpr, PDL: gl.constexpr,
        WAIT_PRIOR: gl.constexpr, KV_FMT: gl.constexpr, TRANSPOSED: gl.constexpr,
    ):
        if WAIT_PRIOR:
            wait_prior_grids()
        if PDL:
            launch_dependents()  # after the wait, as decode.py's kernel
        CW: gl.constexpr = _converter_warps(TRANSPOSED)
        (q_smem, q_pe_smem, kv_ring, kv_pe_ring, p_smem, scale_smem, q_ready, q_free, p_ready, p_free, kv_ready,
         kv_empty, page_flags) = mla.mla_buffers(q_desc, q_pe_desc, gl.float16, TRANSPOSED)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_landed = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        kv_landed = gl.allocate_shared_memory(gl.int64, [mla._STAGES, 1], bar_layout)
        q_scale_smem = gl.allocate_shared_memory(gl.float32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if KV_FMT == 2:
            sc_ring = gl.allocate_shared_memory(gl.float32, [mla._STAGES, mla._BN, _DS_TILES], sc_desc.layout)
        else:
            sc_ring = q_scale_smem  # fp8_e4m3 rows carry no scales: never read
        mbarrier.init(q_landed, count=1)
        for i in gl.static_range(mla._STAGES):
            mbarrier.init(kv_landed.index(i), count=1)
        gl.warp_specialize(
            [(hopper_decode._softmax_warpgroup,
              (q_smem._reinterpret(gl.float16, q_smem.shape, q_smem.layout),
               q_pe_smem._reinterpret(gl.float16, q_pe_smem.shape, q_pe_smem.layout), kv_ring, kv_pe_ring, p_smem,
               scale_smem, q_ready, q_free, kv_ready, kv_empty, p_ready, p_free, page_flags, PIECES, CAPACITY,
               seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, err_ptr, B, PARTS, H, Q_LEN, ROWS,
               qk_scale, stride_ob, stride_ot, stride_oh, kv_scale_ptr, q_scale_smem, CAUSAL, PAGE, META_W,
               KV_FMT, TRANSPOSED)),
             (hopper_decode._value_warpgroup,
              (kv_ring, p_smem, scale_smem, kv_ready, kv_empty, p_ready, p_free, PIECES, CAPACITY, seqlens_ptr,
               meta_ptr, splits_ptr, out_ptr, lse_ptr, partials_ptr, B, PARTS, H, Q_LEN, ROWS, stride_ob, stride_ot,
               stride_oh, kv_scale_ptr, PAGE, META_W, KV_FMT, TRANSPOSED)),
             (_fp8_loader,
              (q_desc, q_pe_desc, lat_desc, pe_desc, sc_desc, bt_ptr, stride_btb, CAPACITY, num_pages, seqlens_ptr,
               meta_ptr, splits_ptr, partials_ptr, err_ptr, B, PARTS, ROWS, q_smem, q_pe_smem, kv_ring, kv_pe_ring,
               sc_ring, q_landed, q_free, kv_landed, kv_empty, page_flags, PAGE, META_W, KV_FMT)),
             (_converter,
              (q_smem, q_pe_smem, kv_ring, kv_pe_ring, sc_ring, q_scale_smem, q_landed, q_ready, kv_landed,
               kv_ready, lat_desc, pe_desc, seqlens_ptr, meta_ptr, kv_scale_ptr, B, ROWS, CAPACITY, META_W,
               KV_FMT, CW))],
            worker_num_warps=[4, 1, CW],
            worker_num_regs=_worker_regs(TRANSPOSED),
        )


_MAIN = CachedKernel(_decode_sm90_fp8_kernel, ptx_pass=tma_loads_evict_first) if HAVE_GLUON else None


def sm90_fp8_main_args(q_rows, k_cache, kv_fmt, k_scale, block_table, cache_seqlens, metadata, num_splits,
                       softmax_scale, causal, out, lse, partials, err, pdl: bool = False, wait_prior: bool = False,
                       block_m: int = BLOCK_M):
    """``decode.sm90_main_args`` for an FP8 cache (``sm90_fp8_supported``): k_cache its raw rows
    [num_pages, page_size, 1, 576 | 656] (float8_e4m3fn or uint8), kv_fmt "fp8_e4m3" (k_scale float32 [1],
    read on the device) or "fp8_ds_mla" (k_scale None); ``block_m`` the Q tile: 64 rows, or the narrow
    kernel's 16 / 32 (``split_plan.narrow_block``: every request's rows in one tile, S^T = K Q^T)."""
    b, q_len, h, _ = out.shape
    rows = q_len * h
    parts = metadata.shape[0]
    args = (*mla.row_descriptors(q_rows, block_m), *fp8_descriptors(k_cache, kv_fmt), block_table, cache_seqlens,
            metadata, num_splits, out, lse, partials, err, k_scale if kv_fmt == "fp8_e4m3" else None,
            b, parts, h, q_len, rows, softmax_scale * LOG2E, block_table.stride(0), b + parts,
            block_table.shape[1] * k_cache.shape[1], k_cache.shape[0],
            out.stride(0), out.stride(1), out.stride(2))
    options = dict(CAUSAL=bool(causal), PAGE=k_cache.shape[1], META_W=METADATA_WIDTH, PDL=pdl,
                   KV_FMT=_FORMAT_IDS[kv_fmt], TRANSPOSED=block_m < BLOCK_M, num_warps=4,
                   **wait_prior_options(wait_prior))
    return _MAIN, (-(-rows // block_m), parts, 1), args, options
