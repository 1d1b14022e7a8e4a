"""Triton variable-q-length paged absorbed MLA attention (prefill over a cached prefix, unequal verify).

Every request has q_len new tokens, the last q_len positions of its kv_len-long latent history, and one
KV head shared by all H query heads. The (token, head) pairs of a request form q_len * H rows, heads
fastest, tiled BLOCK_M at a time: a 2000-token extend fills many full tiles (compute-bound MMAs, as in
prefill) and a 1-token one still fills a tile with its heads (as in decode). Each program streams the
request's pages once, BLOCK_N latent rows per step, and uses every row twice: all 576 columns as the key
(512 + 64, two MMAs) and the first 512 as the value. Causal masks are bottom-right aligned per token.

The grid needs no host synchronisation: request b's tiles start at ``qo_indptr[b] * H // BLOCK_M + b``
(a bound that leaves each request at least as many tiles as it needs), so ``T * H // BLOCK_M + b``
programs cover any qo_indptr; each program finds its request by binary search and exits if idle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla import checks, errors
from pagedmla.device import sm90_available, triton_interpreting
from pagedmla.kernels.triton.common import (
    BLOCK_TABLE,
    INTERPRETER_TILES,
    LOG2E,
    QUERY_INDPTR,
    PrefillConfig,
    checked_length,
    checked_page,
    finish_rows,
    fp8_nan_fixup,
    indptr_is_partition,
    kv_format_args,
    kv_format_width,
    report,
    store_nan,
)
from pagedmla.kernels.triton.launch import unaligned_mask
from pagedmla.kernels.triton.rows import DEQUANT_MAX_WIDTH, dequantize_pages
from pagedmla.kernels.triton.sm90.mla import BLOCK_N as SM90_BLOCK_N
from pagedmla.kernels.triton.sm90.mla import D_QK, D_V, sm90_supported
from pagedmla.kernels.triton.sm90.paged_varlen import (
    bind_paged_varlen_sm90,
    launch_bound_paged_varlen_sm90,
    paged_varlen_sm90,
)
from pagedmla.kernels.triton.steps import key_scores, load_split, paged_tile, softmax_step, store_rows
from pagedmla.kernels.triton.varlen import check_dtype, last_dim_contiguous, split_head_dim


@triton.jit
def _paged_tile(
    acc, l_i, m_i, bad, q1, q2, KV, bt_row, stride_slot,
    lo, hi, row_limit, kv_len, num_pages, qk_scale,
    PAGE_SIZE: tl.constexpr, DK: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, KV_FMT: tl.constexpr,
    NAN_FIXUP: tl.constexpr,
):
    """Online-softmax update over latent rows [lo, hi) of one request. MASKED tiles apply the length
    and per-row causal limits (row_limit: last visible key per row) and never read slots past kv_len.
    ``bad`` accumulates whether a page id was outside the cache (page 0 is read instead). FP8 rows (KV_FMT >
    0) are read as ``key_scores`` loads them (fp8_e4m3's scale is folded in by the caller)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        n_ok = n < kv_len  # all set on unmasked tiles (read there only by the FP8 rope part's column mask)
        if MASKED:
            page, page_bad = checked_page(tl.load(bt_row + n // PAGE_SIZE, mask=n_ok, other=0), num_pages)
        else:
            page, page_bad = checked_page(tl.load(bt_row + n // PAGE_SIZE), num_pages)
        bad = bad | (tl.max(page_bad.to(tl.int32), 0) > 0)
        rows = KV + (page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE)[:, None] * stride_slot
        s, kv1 = key_scores(q1, q2, rows, n_ok, DK, BLOCK_D1, BLOCK_D2, MASKED, DOT_PREC, KV_FMT, NAN_FIXUP)
        p, alpha, m_new = softmax_step(s, m_i, n_ok[None, :] & (n[None, :] <= row_limit[:, None]), qk_scale, MASKED)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # The value is the key tile's first BLOCK_D1 columns (512 of 576): no second load. Columns past
        # head_dim_v, if any, only feed accumulator columns that are never stored.
        acc = tl.dot(p.to(kv1.dtype), kv1, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i, bad


@triton.jit
def _paged_varlen_kernel(
    Q, KV, O, LSE, block_table, cache_seqlens, qo_indptr, err_ptr, scale_ptr,
    stride_qt, stride_qh, stride_slot, stride_bt, stride_ot, stride_oh,
    num_heads, batch, total_q, num_pages, max_pages, qk_scale,
    PAGE_SIZE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SEARCH_STEPS: tl.constexpr, DOT_PREC: tl.constexpr, KV_FMT: tl.constexpr,
    NAN_FIXUP: tl.constexpr,
):
    """One program: BLOCK_M (token, head) rows of one request over the keys they see."""
    # Later tiles hold later tokens, which see more keys: launch them first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    d1 = tl.arange(0, BLOCK_D1)
    k_scale = 1.0
    if KV_FMT == 1:
        # fp8_e4m3: keys and values are fp8 x k_scale; the tiles hold the fp8 values, the scale goes here.
        k_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * k_scale
    if not indptr_is_partition(qo_indptr, batch, total_q, tl.arange(0, 1024)):
        # The tiles' request search and row offsets need a partition of the rows: without one, every row of
        # the call is NaN, tile pid covering flat (token, head) rows pid * BLOCK_M .. (there are at least
        # total_q * H / BLOCK_M tiles).
        flat = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = flat < tl.cast(total_q, tl.int64) * num_heads
        o_rows = O + (flat // num_heads)[:, None] * stride_ot + (flat % num_heads)[:, None] * stride_oh
        store_nan(o_rows + d1[None, :], LSE + flat, ok, d1 < DV)
        if pid == 0:
            report(err_ptr, QUERY_INDPTR)
        return
    b, q_start, q_len, r0 = paged_tile(pid, qo_indptr, num_heads, batch, BLOCK_M, SEARCH_STEPS)
    n_rows = q_len * num_heads
    if r0 >= n_rows:
        return
    kv_len, bits = checked_length(tl.load(cache_seqlens + b), max_pages * PAGE_SIZE)

    r = r0 + tl.arange(0, BLOCK_M)
    row_ok = r < n_rows
    tok = r // num_heads
    head = r % num_heads
    q_rows = Q + (q_start.to(tl.int64) + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q1, q2 = load_split(q_rows, row_ok, DK, BLOCK_D1, BLOCK_D2)
    bt_row = block_table + b.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if CAUSAL:
        # Token t (0-based among the request's q_len) sees keys 0 .. kv_len - q_len + t.
        row_limit = kv_len - q_len + tok
        first_tok = r0 // num_heads
        last_tok = (tl.minimum(r0 + BLOCK_M, n_rows) - 1) // num_heads
        full_end = (tl.minimum(tl.maximum(kv_len - q_len + first_tok + 1, 0), kv_len) // BLOCK_N) * BLOCK_N
        end = tl.maximum(tl.minimum(kv_len, kv_len - q_len + last_tok + 1), full_end)
    else:
        row_limit = tl.full([BLOCK_M], 2**30, dtype=tl.int32)
        full_end = (kv_len // BLOCK_N) * BLOCK_N
        end = kv_len
    bad = bits < 0  # page ids outside the cache, accumulated over the tiles
    # The unmasked softmax takes the row max before scaling, which needs qk_scale > 0: with fp8_e4m3's
    # k_scale folded in (any sign the caller gave), every tile takes the masked path, which scales first.
    acc, l_i, m_i, bad = _paged_tile(acc, l_i, m_i, bad, q1, q2, KV, bt_row, stride_slot, 0, full_end, row_limit,
                                     kv_len, num_pages, qk_scale, PAGE_SIZE, DK, BLOCK_D1, BLOCK_D2,
                                     BLOCK_N, KV_FMT == 1, DOT_PREC, KV_FMT, NAN_FIXUP)
    acc, l_i, m_i, bad = _paged_tile(acc, l_i, m_i, bad, q1, q2, KV, bt_row, stride_slot, full_end, end, row_limit,
                                     kv_len, num_pages, qk_scale, PAGE_SIZE, DK, BLOCK_D1, BLOCK_D2,
                                     BLOCK_N, True, DOT_PREC, KV_FMT, NAN_FIXUP)
    bits = bits | tl.where(bad, BLOCK_TABLE, 0)
    report(err_ptr, bits)
    inv_l, lse2 = finish_rows(l_i, m_i, bits != 0)
    if KV_FMT == 1:
        inv_l = inv_l * k_scale
    store_rows(O + (q_start.to(tl.int64) + tok)[:, None] * stride_ot + head[:, None] * stride_oh, acc, inv_l, lse2,
               LSE, q_start, tok, num_heads, head, row_ok, d1, DV)


_FP32_TILES = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
_TILES = PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)


def default_config(dtype: torch.dtype) -> PrefillConfig:
    """The portable kernel's tiles: small under the interpreter (exercise multi-tile paths on small tests);
    on the H200 64 rows x 64 latent rows with 8 warps (two warpgroups split the 512-wide accumulator)."""
    if triton_interpreting():
        return INTERPRETER_TILES
    return _FP32_TILES if dtype == torch.float32 else _TILES


# Most bytes an FP8 call's dequantised pages may take (``dequantize_first``): 1 GiB is ~930 K bf16 rows.
DEQUANT_MAX_BYTES = 1 << 30


def dequantize_first(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, head_dim_v: int,
                     num_kv_pages: int | None = None) -> bool:
    """Whether an FP8 call runs the Hopper kernel over its pages dequantised first (``rows.dequantize_pages``:
    one workspace page per block-table entry, or with ``num_kv_pages`` from the host one per page the requests'
    lengths span) instead of the portable kernel: on sm_90 for bf16/fp16 q, head dims 576 / 512 and pages a
    multiple of 64, when that workspace holds at least one page (a TMA descriptor needs one), no more pages
    than the cache and at most ``DEQUANT_MAX_BYTES``. Why: the absorbed prefill is compute bound (8 x 1024
    tokens over 4096 at 128 heads: 10.5 TFLOP against 47 MB of bf16 pages, ~0.1% of its time to write and read
    them back), so the Hopper bf16 kernel's rate over dequantised pages beats the portable kernel dequantising
    each tile as it loads it (~0.3x: benchmarks/NOTES.md, FP8). Without ``num_kv_pages`` a table much wider
    than most of its requests need (one long request among short ones, or an engine's table over the longest
    context) can fail the size rules and run the portable kernel."""
    b, width = block_table.shape
    page = k_cache.shape[1]
    ws_pages = b * width if num_kv_pages is None else num_kv_pages
    ws_bytes = ws_pages * page * D_QK * q.element_size()
    return (sm90_available(q.device) and k_cache.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] == D_QK and head_dim_v == D_V and page % SM90_BLOCK_N == 0 and width <= DEQUANT_MAX_WIDTH
            and 0 < ws_pages <= k_cache.shape[0] and ws_bytes <= DEQUANT_MAX_BYTES)


# Bound Hopper launches of 16-bit calls by call shape (None where binding does not apply).
_sm90_bound: dict[tuple, tuple | None] = {}


def _launch_bound(bound: tuple, q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v: int):
    """(out, lse) of a bound launch, or None when q or the cache (the tensor maps' bases) is not 16-byte aligned,
    or the tensors' device is not the current one (the bound launch does not switch devices): the caller then
    takes the full path. The other pointers' alignment is part of the bound launch's key."""
    if (q.data_ptr() | k_cache.data_ptr()) & 15 or q.get_device() != torch.cuda.current_device():
        return None
    t, h, _ = q.shape
    out = torch.empty(t, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    launch_bound_paged_varlen_sm90(bound, q, k_cache, block_table, cache_seqlens, qo_indptr, out, lse)
    return out, lse


def paged_varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    qo_indptr: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    max_q_len: int | None = None,
    *,
    config: PrefillConfig | None = None,
    kv_format: str | None = None,
    k_scale: torch.Tensor | None = None,
    kv_page_indptr: torch.Tensor | None = None,
    num_kv_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention with per-request q lengths over a paged latent cache (``paged_varlen`` op).

    q: [T, H, D] (D = 576), request b's tokens at rows qo_indptr[b] .. qo_indptr[b+1]-1, the last tokens
    of its KV; k_cache: [num_pages, page_size, 1, D] (page_size a power of two), same dtype as q
    (float16/bfloat16/float32); block_table: int32 [b, max_pages]; cache_seqlens: int32 [b], KV length
    including the new tokens; qo_indptr: int32 [b + 1]; head_dim_v: the value width, the first columns of
    each latent row (512; at most the power-of-two part of D). causal: bottom-right per token. max_q_len is not
    needed: the grid is sized from T, so nothing is read back from the device. ``config`` overrides the
    tile shape (benchmarks). FP8 caches (``kv_format`` "fp8_e4m3" with ``k_scale`` float32 [1], or
    "fp8_ds_mla" [num_pages, page_size, 1, 656] bytes; ``pagedmla.kv_format``) run the Hopper kernel over
    their pages dequantised first where ``dequantize_first`` holds, else the portable kernel, which dequantises
    each tile as it loads it; ``kv_page_indptr`` (int32 [b + 1]: request b's length spans kv_page_indptr[b + 1] -
    kv_page_indptr[b] pages) with ``num_kv_pages`` (its last value, on the host), where the caller knows the
    lengths on the host, sizes that workspace by the pages the lengths span (``rows.dequantize_pages``); a
    16-bit cache ignores them. Without ``config`` an sm_90 GPU runs the Hopper kernel (``sm90/paged_varlen.py``)
    where it applies (bf16/fp16, 576/512, pages a multiple of 64, contiguous cache); a ``PrefillConfig`` runs it
    when its ``use_sm90`` is set, else the portable kernel.
    Returns out [T, H, head_dim_v] q.dtype and lse [T, H] float32 (natural log; rows that see no key give 0
    and -inf). A 16-bit call shaped like an earlier one that ran the Hopper kernel on its own tensors goes
    straight to that kernel's bound launch (``sm90/paged_varlen.py``: no checks, descriptors or specialisation
    key on the host), unless an address is not 16-byte aligned. Long for its checks, one per argument with its
    own message, and that fast path ahead of the dispatch.
    """
    # A 16-bit call shaped like an earlier one that bound the Hopper launch (every tensor's shape, strides, dtype
    # and device in the key: what the checks below and the launch depend on) skips straight to it.
    key = None if config is not None or kv_format is not None else (
        q.shape, q.stride(), q.dtype, q.get_device(), k_cache.shape, k_cache.stride(), k_cache.dtype,
        k_cache.get_device(), block_table.shape, block_table.stride(), block_table.dtype, block_table.get_device(),
        cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device(),
        qo_indptr.shape, qo_indptr.stride(), qo_indptr.dtype, qo_indptr.get_device(),
        # With their types: 512 == 512.0 and 1.0 == True must not share a valid call's launch.
        head_dim_v.__class__, head_dim_v, softmax_scale.__class__, softmax_scale, causal.__class__, causal,
        # Triton specialises each pointer on its 16-byte alignment: a slice cache_seqlens[1:] gets its own launch.
        unaligned_mask((block_table.data_ptr(), cache_seqlens.data_ptr(), qo_indptr.data_ptr())))
    bound = _sm90_bound.get(key) if key is not None else None
    if bound is not None:
        checks.page_layout(kv_page_indptr, num_kv_pages, qo_indptr.shape[0] - 1, q.device)
        result = _launch_bound(bound, q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v)
        if result is not None:
            return result
    softmax_scale = checks.positive_scale(softmax_scale)
    config = PrefillConfig.checked(config)
    check_dtype(q, "q")
    if kv_format is None and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} differs from q's {q.dtype}")
    width = kv_format_width(kv_format, q.shape[-1])
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != width:
        raise ValueError(f"k_cache: expected [num_pages, page_size, 1, {width}], got {tuple(k_cache.shape)}")
    t, h, d = q.shape
    if d < 16:
        raise ValueError(f"q: the triton kernel needs a head dim >= 16, got {d}")
    page_size = k_cache.shape[1]
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"k_cache: page size must be a power of two, got {page_size}")
    d1, d2 = split_head_dim(d)
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int) or not 0 < head_dim_v <= d1:
        raise ValueError(f"head_dim_v: the triton kernel needs 1 <= head_dim_v <= {d1} (the power-of-two part "
                         f"of D = {d}), got {head_dim_v!r}")
    for name, x in (("block_table", block_table), ("cache_seqlens", cache_seqlens), ("qo_indptr", qo_indptr)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"{name}: expected an int32 tensor on {q.device}")
    batch = qo_indptr.shape[0] - 1
    if block_table.dim() != 2 or block_table.shape[0] != batch or cache_seqlens.shape != (batch,):
        raise ValueError(f"block_table: expected [{batch}, max_pages] with cache_seqlens [{batch}]")
    out = torch.empty(t, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0 or h == 0 or batch <= 0:
        return out, lse
    given = (q, block_table, cache_seqlens, qo_indptr)
    q = last_dim_contiguous(q)
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    # The kernel indexes these 1-D tensors as dense arrays (a no-op when they already are).
    cache_seqlens, qo_indptr = cache_seqlens.contiguous(), qo_indptr.contiguous()
    own = all(a is b for a, b in zip(given, (q, block_table, cache_seqlens, qo_indptr)))
    checks.page_layout(kv_page_indptr, num_kv_pages, batch, q.device)
    dequant = kv_format is not None and dequantize_first(q, k_cache, block_table, head_dim_v, num_kv_pages)
    if config is None:
        cfg = default_config(q.dtype)
        if kv_format is None:
            use_sm90 = d == D_QK and head_dim_v == D_V and sm90_supported(q, k_cache, head_dim_v)
        else:
            use_sm90 = dequant
    else:
        cfg, use_sm90 = config.over(default_config(q.dtype)), config.use_sm90
    if use_sm90 and kv_format is not None:
        if not dequant:
            raise ValueError(f"config: use_sm90 over a {kv_format} cache needs its pages dequantised first, which "
                             "this call does not allow (see paged_varlen.dequantize_first)")
        ws, ws_table = dequantize_pages(k_cache, block_table, cache_seqlens, kv_format, q.dtype, kv_page_indptr,
                                        num_kv_pages)
        paged_varlen_sm90(q, ws, ws_table, cache_seqlens, qo_indptr, softmax_scale, causal, out, lse,
                          kv_scale=k_scale if kv_format == "fp8_e4m3" else None)
        return out, lse
    if use_sm90:
        if d != 576 or head_dim_v != 512:
            raise ValueError(f"config: use_sm90 needs head dims 576 / 512, got {d} / head_dim_v {head_dim_v}")
        paged_varlen_sm90(q, k_cache, block_table, cache_seqlens, qo_indptr, softmax_scale, causal,
                           out, lse)
        # Bind once the launch has passed its own checks, from a call that ran on the caller's tensors (not on
        # copies made above: later calls' addresses stand for the bound call's).
        if key is not None and key not in _sm90_bound and q.is_cuda and own:
            if len(_sm90_bound) > 1024:  # shapes vary with the batch: keep the table bounded
                _sm90_bound.clear()
            _sm90_bound[key] = bind_paged_varlen_sm90(q, k_cache, block_table, cache_seqlens, qo_indptr,
                                                      softmax_scale, causal, out, lse)
        return out, lse
    # The portable kernel reads the cache as flat rows (a copy only for a cache whose pages are not dense).
    kv, scale_arg, fmt_id = kv_format_args(last_dim_contiguous(k_cache.reshape(-1, width)), kv_format, k_scale)
    grid = ((t * h) // cfg.block_m + batch,)
    _paged_varlen_kernel[grid](
        q, kv, out, lse, block_table, cache_seqlens, qo_indptr, errors.error_word(q.device), scale_arg,
        q.stride(0), q.stride(1), kv.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        h, batch, t, k_cache.shape[0], block_table.shape[1], softmax_scale * LOG2E,
        PAGE_SIZE=page_size, DK=d, DV=head_dim_v, BLOCK_D1=d1, BLOCK_D2=d2,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
        SEARCH_STEPS=max(1, batch.bit_length()), DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FMT=fmt_id, NAN_FIXUP=fmt_id > 0 and fp8_nan_fixup(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse

