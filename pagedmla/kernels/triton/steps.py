"""The steps the portable prefill kernels (``varlen.py``, ``paged_varlen.py``) share: a row block's columns
loaded in the two power-of-two parts of the head dim, the scores of one key tile, the online-softmax update
in the log2 domain, the store of a row block's result, and the work-tile search of the paged kernels (the
Hopper ``sm90/paged_varlen.py`` calls it too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedmla.kernels.triton.common import _LN2, fp8_cols


@triton.jit
def load_cols(ptrs, col0: tl.constexpr, WIDTH: tl.constexpr, row_ok, DK: tl.constexpr, MASKED: tl.constexpr):
    """Columns col0 .. col0 + WIDTH - 1 of the rows ``ptrs`` [R, 1] points at: columns >= DK read as 0, and
    with MASKED rows outside ``row_ok`` [R] too (they are never read)."""
    cols = col0 + tl.arange(0, WIDTH)
    if MASKED:
        x = tl.load(ptrs + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < DK), other=0.0)
    elif col0 + WIDTH > DK:
        x = tl.load(ptrs + cols[None, :], mask=cols[None, :] < DK, other=0.0)
    else:
        x = tl.load(ptrs + cols[None, :])
    return x


@triton.jit
def load_split(ptrs, row_ok, DK: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr):
    """(columns 0 .. BLOCK_D1 - 1, columns BLOCK_D1 .. BLOCK_D1 + BLOCK_D2 - 1) of the rows ``ptrs`` [R, 1]
    points at (``split_head_dim``'s parts of a DK-wide head; the first part again when BLOCK_D2 is 0); rows
    outside ``row_ok`` and columns >= DK read as 0."""
    x1 = load_cols(ptrs, 0, BLOCK_D1, row_ok, DK, True)
    if BLOCK_D2 > 0:
        x2 = load_cols(ptrs, BLOCK_D1, BLOCK_D2, row_ok, DK, True)
    else:
        x2 = x1
    return x1, x2


@triton.jit
def key_scores(q1, q2, k_rows, n_ok, DK: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
               MASKED: tl.constexpr, DOT_PREC: tl.constexpr, KV_FMT: tl.constexpr = 0,
               NAN_FIXUP: tl.constexpr = False):
    """(raw scores Q K^T [M, N], the key tile's first BLOCK_D1 columns) of the keys ``k_rows`` [N, 1] points
    at, for queries in ``load_split``'s parts q1 / q2; with MASKED keys outside ``n_ok`` [N] read as 0 (unused
    cache slots may hold NaN: no such value reaches an MMA). Keys are of q's dtype unless KV_FMT > 0: rows of
    an FP8 cache (``common.fp8_cols``: k_rows uint8 pointers, and ``NAN_FIXUP``), read as that gives them
    (fp8_e4m3 without its scale, which the caller folds in) and cast to q's dtype for the dots."""
    if KV_FMT > 0:
        # Through float32: fp8_e4m3's fp16 values cast to bf16 directly took 19% longer (H200, paged prefill).
        k1 = fp8_cols(k_rows, 0, n_ok[:, None], BLOCK_D1, KV_FMT, False, MASKED, NAN_FIXUP).to(tl.float32).to(q1.dtype)
    else:
        k1 = load_cols(k_rows, 0, BLOCK_D1, n_ok, DK, MASKED)
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    if BLOCK_D2 > 0:
        if KV_FMT > 0:
            # The FP8 rope part, always masked: the tile's columns past DK (a non-power-of-two remainder).
            cols = BLOCK_D1 + tl.arange(0, BLOCK_D2)
            k2 = fp8_cols(k_rows, BLOCK_D1, n_ok[:, None] & (cols[None, :] < DK), BLOCK_D2, KV_FMT, True,
                          True, NAN_FIXUP).to(tl.float32).to(q1.dtype)
        else:
            k2 = load_cols(k_rows, BLOCK_D1, BLOCK_D2, n_ok, DK, MASKED)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
    return s, k1


@triton.jit
def softmax_step(s, m_i, valid, qk_scale, MASKED: tl.constexpr):
    """(P, rescale factor of the running sums, new row max) of raw scores ``s`` [M, N] against the running
    row max ``m_i`` [M] (log2 units, scores scaled by ``qk_scale``). MASKED tiles drop the scores outside
    ``valid``; unmasked ones must have every key visible to every row."""
    if MASKED:
        s = tl.where(valid, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        # Every row of an unmasked tile sees all its keys, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new


@triton.jit
def store_rows(o_rows, acc, inv_l, lse2, LSE, q_start, tok, heads, head, row_ok, cols, DV: tl.constexpr):
    """A row block's result (``finish_rows``' 1 / l and log2 LSE of accumulator ``acc`` [M, C]), rows
    ``row_ok`` [M] only: the normalised output at columns ``cols`` [C] (< DV) of the rows ``o_rows`` [M, 1]
    points at, the natural-log LSE at LSE[(q_start + tok) * heads + head] (LSE [tokens, heads])."""
    tl.store(o_rows + cols[None, :], (acc * inv_l[:, None]).to(o_rows.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < DV))
    tl.store(LSE + (q_start.to(tl.int64) + tok) * heads + head, lse2 * _LN2, mask=row_ok)


@triton.jit
def paged_tile(tile, qo_indptr, heads, batch, BLOCK_M: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """(request b, its first q token, its q_len, the tile's first row r0 among b's q_len * heads (token,
    head) rows) of work tile ``tile``: request b's tiles start at tile_start(b) = qo_indptr[b] * heads //
    BLOCK_M + b, an increasing function of b (binary search in SEARCH_STEPS >= log2(batch) steps). Needs
    qo_indptr to be a partition of the rows (the caller checks); r0 >= q_len * heads marks an idle tile."""
    # Largest b with tile_start(b) <= tile.
    lo = tile * 0
    hi = lo + batch - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        start_mid = (tl.load(qo_indptr + mid).to(tl.int64) * heads) // BLOCK_M + mid
        go_up = start_mid <= tile
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    b = lo
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    r0 = (tile - ((q_start.to(tl.int64) * heads) // BLOCK_M + b)).to(tl.int32) * BLOCK_M
    return b, q_start, q_len, r0
