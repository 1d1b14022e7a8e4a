"""Split-KV MLA decode over the paged latent cache: a main kernel, a combine kernel and their launcher.

Work layout. The query rows of one request are its (token, head) pairs packed token-major
(row = t * H + h) into BLOCK_M-row tiles: a TP-sharded 16-head decode is one 16-row tile, 128 heads are
two 64-row tiles. The grid is (M tiles, SM parts); part p walks the (request, KV block) range that
``get_mla_metadata`` gave it (pagedmla/ops/schedule.py documents the metadata) and, for each request in
it, streams the KV blocks once: each [BLOCK_N, 576] tile is the key (all 576 columns) and the value
(its first 512) of the same load. A request covered by one part is normalised and written straight to
``out`` / ``lse``; a request cut across parts writes one fp32 partial (normalised output + log2 LSE) per
piece, and the combine kernel merges them. The combine kernel also writes the empty result (output 0,
LSE -inf) of requests with no KV.

Masking. Blocks that lie wholly before the first masked key (the sequence end, and with ``causal`` the
first key the earliest query row cannot see) run without masks; the last one or two blocks of a range
run masked: the loads past the sequence end are skipped (unused cache slots may hold anything, NaN
included) and masked scores become -inf before the exponential, so no such value reaches the output.

Launch parameters depend only on shapes and the metadata's shape (no host synchronisation), so the
metadata call, the main kernel and the combine kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pagedmla.ops.providers import register_impl
from pagedmla.ops.schedule import BLOCK_M as SCHED_BLOCK_M
from pagedmla.ops.schedule import BLOCK_N as SCHED_BLOCK_N
from pagedmla.ops.schedule import METADATA_WIDTH

_LOG2E = 1.4426950408889634
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Lazy rescaling keeps a row's running max until a block raises it by more than this (log2 units), so
# unnormalised probabilities stay below 2**8: exact in fp32, and bf16/fp16 hold them without overflow.
_RESCALE_THRESHOLD: tl.constexpr = tl.constexpr(8.0)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and pipelining of the main kernel (chosen per call from shapes by ``default_config``).

    block_m: query rows per tile (16, 32 or 64; tiles of 64 when q_len * heads > 64);
    block_n: KV tokens per step (divides the schedule's 64-token block); num_warps, num_stages: Triton's;
    use_tma: load KV tiles with tensor descriptors (CUDA, pages a multiple of block_n, contiguous cache);
    lazy_rescale: rescale the accumulator only when a row max grows by more than 2**8.
    """

    block_m: int
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = False
    lazy_rescale: bool = False


def default_config(rows: int, page_size: int, device: torch.device) -> DecodeConfig:
    """Config for ``rows`` = q_len * heads query rows per request (measured on the H200: benchmarks/NOTES.md)."""
    block_m = SCHED_BLOCK_M if rows > SCHED_BLOCK_M else max(16, triton.next_power_of_2(rows))
    if block_m == 64:
        return DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    return DecodeConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _softmax_step(acc, m_i, l_i, q_nope, q_pe, kv_nope, kv_pe, valid, qk_scale,
                  HAS_PE: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a KV tile; the running max m_i is in log2 units of scaled scores."""
    s = tl.dot(q_nope, tl.trans(kv_nope), input_precision=PRECISION)
    if HAS_PE:
        s = tl.dot(q_pe, tl.trans(kv_pe), s, input_precision=PRECISION)
    s = s * qk_scale
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_blk = tl.max(s, 1)
    m_new = tl.maximum(m_i, m_blk)
    if LAZY:
        # Rescale only when some row's max grew past the threshold (a block-uniform decision).
        grow = tl.where(m_new > m_i, m_new - m_i, 0.0)
        if tl.max(grow, 0) > _RESCALE_THRESHOLD:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(s - m_use[:, None])
    else:
        # A row with no visible key yet keeps max -inf: subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _load_kv(kv_ptr, bt_row, desc_nope, desc_pe, n0, seqlen, stride_page, stride_tok,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
             HAS_PE: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_N, DV] value/key part and [BLOCK_N, DR] rope-key part of tokens n0 .. n0 + BLOCK_N - 1."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if USE_TMA:
        # Pages are a multiple of BLOCK_N tokens: the tile is BLOCK_N consecutive rows of the cache.
        page = tl.load(bt_row + n0 // PAGE)
        row = page * PAGE + n0 % PAGE
        kv_nope = desc_nope.load([row, 0])
        kv_pe = kv_nope
        if HAS_PE:
            kv_pe = desc_pe.load([row, DV])
    else:
        if PAGE >= BLOCK_N:
            page = tl.load(bt_row + n0 // PAGE).to(tl.int64)
            tok = page * stride_page + (n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_tok
        else:
            # Several pages per tile: one page-id lookup per token; past the end read page 0 (never used).
            pages = tl.load(bt_row + offs_n // PAGE, mask=offs_n < seqlen, other=0).to(tl.int64)
            tok = pages * stride_page + (offs_n % PAGE) * stride_tok
        ptrs = kv_ptr + tok[:, None] + tl.arange(0, DV)[None, :]
        if MASKED:
            in_seq = (offs_n < seqlen)[:, None]
            kv_nope = tl.load(ptrs, mask=in_seq, other=0.0)
        else:
            kv_nope = tl.load(ptrs)
        kv_pe = kv_nope
        if HAS_PE:
            pe_ptrs = kv_ptr + tok[:, None] + DV + tl.arange(0, DR)[None, :]
            if MASKED:
                kv_pe = tl.load(pe_ptrs, mask=in_seq, other=0.0)
            else:
                kv_pe = tl.load(pe_ptrs)
    if USE_TMA and MASKED:
        # TMA reads whole tiles: zero the rows past the sequence end (0 * NaN would poison P @ V).
        in_seq = (offs_n < seqlen)[:, None]
        kv_nope = tl.where(in_seq, kv_nope, 0.0)
        if HAS_PE:
            kv_pe = tl.where(in_seq, kv_pe, 0.0)
    return kv_nope, kv_pe


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, po_ptr, plse_ptr, desc_nope, desc_pe,
    H, Q_LEN, ROWS, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_page, stride_tok, stride_btb,
    stride_ob, stride_ot, stride_oh,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, SCHED_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, HAS_PE: tl.constexpr,
    META_W: tl.constexpr, USE_TMA: tl.constexpr, LAZY: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    part = tl.program_id(1)
    begin_req = tl.load(meta_ptr + part * META_W + 0)
    begin_blk = tl.load(meta_ptr + part * META_W + 1)
    end_req = tl.load(meta_ptr + part * META_W + 2)
    end_blk = tl.load(meta_ptr + part * META_W + 3)
    begin_split = tl.load(meta_ptr + part * META_W + 4)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    t = rows // H
    h = rows % H
    offs_dv = tl.arange(0, DV)
    offs_dr = tl.arange(0, DR)
    q_row = t.to(tl.int64) * stride_qt + h * stride_qh
    o_row = t.to(tl.int64) * stride_ot + h * stride_oh
    lse_row = h * Q_LEN + t

    for b in range(begin_req, end_req + 1):
        seqlen = tl.load(seqlens_ptr + b)
        n_sched = tl.cdiv(seqlen, SCHED_N)
        blk_lo = tl.where(b == begin_req, begin_blk, 0)
        blk_hi = tl.where(b == end_req, end_blk, n_sched)
        tok_lo = blk_lo * SCHED_N
        tok_hi = tl.minimum(blk_hi * SCHED_N, seqlen)
        if tok_lo < tok_hi:
            q_base = q_ptr + b.to(tl.int64) * stride_qb + q_row
            q_nope = tl.load(q_base[:, None] + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
            q_pe = q_nope
            if HAS_PE:
                q_pe = tl.load(q_base[:, None] + DV + offs_dr[None, :], mask=row_ok[:, None], other=0.0)
            bt_row = bt_ptr + b.to(tl.int64) * stride_btb
            # Keys a row may see: [0, lim); with causal, query t of Q_LEN sees keys 0 .. seqlen - Q_LEN + t.
            if CAUSAL:
                lim = seqlen - Q_LEN + 1 + t
                first_masked = seqlen - Q_LEN + 1
            else:
                lim = tl.zeros([BLOCK_M], dtype=tl.int32) + seqlen
                first_masked = seqlen
            n_full = tl.maximum(tl.minimum(tok_hi, first_masked) - tok_lo, 0) // BLOCK_N
            tok_mid = tok_lo + n_full * BLOCK_N

            acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            for n0 in range(tok_lo, tok_mid, BLOCK_N):
                kv_nope, kv_pe = _load_kv(kv_ptr, bt_row, desc_nope, desc_pe, n0, seqlen, stride_page, stride_tok,
                                          PAGE, BLOCK_N, DV, DR, HAS_PE, False, USE_TMA)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q_nope, q_pe, kv_nope, kv_pe, None, qk_scale,
                                              HAS_PE, False, LAZY, PRECISION)
            for n0 in range(tok_mid, tok_hi, BLOCK_N):
                kv_nope, kv_pe = _load_kv(kv_ptr, bt_row, desc_nope, desc_pe, n0, seqlen, stride_page, stride_tok,
                                          PAGE, BLOCK_N, DV, DR, HAS_PE, True, USE_TMA)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                valid = (offs_n[None, :] < lim[:, None]) & (offs_n[None, :] < tok_hi)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q_nope, q_pe, kv_nope, kv_pe, valid, qk_scale,
                                              HAS_PE, True, LAZY, PRECISION)

            has_key = l_i > 0.0
            inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0)
            o = acc * inv_l[:, None]
            lse2 = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
            s_lo = tl.load(splits_ptr + b)
            pieces = tl.load(splits_ptr + b + 1) - s_lo
            if pieces == 1:
                o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + o_row[:, None] + offs_dv[None, :]
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.store(lse_ptr + b.to(tl.int64) * ROWS + lse_row, lse2 * _LN2, mask=row_ok)
            else:
                piece = s_lo + tl.where(b == begin_req, begin_split, 0)
                p_row = piece.to(tl.int64) * ROWS + rows
                tl.store(po_ptr + p_row[:, None] * DV + offs_dv[None, :], o, mask=row_ok[:, None])
                tl.store(plse_ptr + p_row, lse2, mask=row_ok)


@triton.jit
def _decode_combine_kernel(
    out_ptr, lse_ptr, po_ptr, plse_ptr, splits_ptr,
    H, Q_LEN, ROWS,
    stride_ob, stride_ot, stride_oh,
    DV: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Merge the partials of request program_id(0) (rows of block program_id(1)); also writes empty requests."""
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    s_lo = tl.load(splits_ptr + b)
    s_hi = tl.load(splits_ptr + b + 1)
    if s_hi - s_lo != 1:
        offs_dv = tl.arange(0, DV)
        acc = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in range(s_lo, s_hi):
            p_row = s.to(tl.int64) * ROWS + rows
            ls = tl.load(plse_ptr + p_row, mask=row_ok, other=float("-inf"))
            os = tl.load(po_ptr + p_row[:, None] * DV + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
            m_new = tl.maximum(m, ls)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(ls - m_safe)
            acc = acc * alpha[:, None] + w[:, None] * os
            l = l * alpha + w
            m = m_new
        has_key = l > 0.0
        inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l, 1.0), 0.0)
        lse2 = tl.where(has_key, m + tl.log2(tl.where(has_key, l, 1.0)), float("-inf"))
        t = rows // H
        h = rows % H
        o_ptrs = (out_ptr + b.to(tl.int64) * stride_ob + (t.to(tl.int64) * stride_ot + h * stride_oh)[:, None]
                  + offs_dv[None, :])
        tl.store(o_ptrs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + b.to(tl.int64) * ROWS + h * Q_LEN + t, lse2 * _LN2, mask=row_ok)


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
    num_pages, page, _, _ = k_cache.shape
    return (cfg.use_tma and k_cache.is_cuda and page % cfg.block_n == 0 and k_cache.stride(1) == d
            and k_cache.stride(0) == page * d and k_cache.data_ptr() % 16 == 0 and (d * k_cache.element_size()) % 16 == 0)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode with the split-KV Triton kernels (the ``triton`` provider's ``paged_decode``).

    q: [b, q_len, h, D] fp16/bf16 (fp32 too, with exact fp32 dots); k_cache: [num_pages, page_size, 1, D],
    q's dtype; block_table: int32 [b, max_pages]; cache_seqlens: int32 [b], KV lengths including the q_len
    new tokens (0 allowed); tile_scheduler_metadata, num_splits: from ``get_mla_metadata(cache_seqlens,
    q_len * h, 1)`` (any ``num_sm_parts``); softmax_scale: multiplies q.k; causal: bottom-right aligned.
    Returns out [b, q_len, h, head_dim_v] in q's dtype and lse [b, h, q_len] float32 (natural log); a row
    with no visible key gets output 0 and LSE -inf. The value is the first head_dim_v columns of each row.
    No host synchronisation: capturable in a CUDA graph.
    """
    b, q_len, h, d = q.shape
    dr = _check_dims(d, head_dim_v)
    rows = q_len * h
    page = k_cache.shape[1]
    cfg = config or default_config(rows, page, q.device)
    if SCHED_BLOCK_N % cfg.block_n or (rows > SCHED_BLOCK_M and cfg.block_m != SCHED_BLOCK_M):
        raise ValueError(f"config: block_n must divide {SCHED_BLOCK_N} and block_m be {SCHED_BLOCK_M} when "
                         f"q_len * heads > {SCHED_BLOCK_M}, got {cfg}")
    out = torch.empty(b, q_len, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, q_len, dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    parts = tile_scheduler_metadata.shape[0]
    if tile_scheduler_metadata.shape[1] != METADATA_WIDTH:
        raise ValueError(f"tile_scheduler_metadata: expected {METADATA_WIDTH} columns, "
                         f"got shape {tuple(tile_scheduler_metadata.shape)}")
    # Each part boundary cuts at most one request in two: at most b + parts - 1 pieces in all.
    po = torch.empty(b + parts, rows, head_dim_v, dtype=torch.float32, device=q.device)
    plse = torch.empty(b + parts, rows, dtype=torch.float32, device=q.device)
    m_tiles = triton.cdiv(rows, cfg.block_m)
    use_tma = _tma_ok(cfg, k_cache, d)
    desc_nope = desc_pe = None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        flat = k_cache.view(-1, d)
        desc_nope = TensorDescriptor(flat, list(flat.shape), [d, 1], [cfg.block_n, head_dim_v])
        desc_pe = TensorDescriptor(flat, list(flat.shape), [d, 1], [cfg.block_n, max(dr, 16)])
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(m_tiles, parts)](
        q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
        out, lse, po, plse, desc_nope, desc_pe,
        h, q_len, rows, softmax_scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        CAUSAL=bool(causal), PAGE=page, SCHED_N=SCHED_BLOCK_N,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DV=head_dim_v, DR=max(dr, 16), HAS_PE=dr > 0,
        META_W=METADATA_WIDTH, USE_TMA=use_tma, LAZY=cfg.lazy_rescale, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    block_r = max(1, min(16, 4096 // head_dim_v, triton.next_power_of_2(rows)))
    _decode_combine_kernel[(b, triton.cdiv(rows, block_r))](
        out, lse, po, plse, num_splits, h, q_len, rows,
        out.stride(0), out.stride(1), out.stride(2),
        DV=head_dim_v, BLOCK_R=block_r, num_warps=4,
    )
    return out, lse


def _paged_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                  softmax_scale, causal):
    return paged_decode_triton(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits, softmax_scale, causal)


register_impl("paged_decode", "triton", _paged_decode)
