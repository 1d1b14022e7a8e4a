"""Public attention calls, FlashMLA / FlashAttention compatible, dispatched to a provider.

Conventions for every call: LSE is the natural log of the softmax denominator over scaled scores, in
float32 (float64 when the torch provider gets float64 inputs);
a query row that attends to no key returns output 0 and LSE -inf; with ``causal=True`` and several
query tokens per request the mask is bottom-right aligned (query i of q_len sees keys
0 .. seq_len - q_len + i). Shapes, dtypes and devices are checked on the host on every call; argument
values only where ``pagedmla.errors`` says (bad values otherwise give NaN rows and an error bit).

Host cost. Engines call these once per layer per step, so a call's own checks are memoised: the first
call with a given combination of shapes, dtypes, devices and scalar arguments runs every check and
resolves the provider; later calls with the same combination look it up (one tuple hash) and go straight
to the provider.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pagedmla import checks, errors
from pagedmla.ops.providers import resolve
from pagedmla.reference import lse_dtype

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _same_dtype(q: torch.Tensor, name: str, other: torch.Tensor) -> None:
    if other.dtype != q.dtype:
        raise ValueError(f"{name}: dtype {other.dtype} differs from q's {q.dtype}")


# Checked call signatures of flash_mla_with_kvcache -> (implementation, softmax scale, cache format).
_decode_signatures: dict[tuple, tuple] = {}


def _signature(*tensors: torch.Tensor) -> tuple:
    """What the host checks of a call depend on, per tensor: shape, dtype and device. The device itself, not
    ``get_device()``: that is -1 for a CPU and a meta tensor alike, so a meta tensor took the checks of a CPU
    call's signature and failed inside torch instead of with the ValueError naming it."""
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def _memoised(table: dict[tuple, tuple], tensors: tuple, scalars: tuple, provider: str | None,
              check: Callable[[], tuple]) -> tuple:
    """The entry of a checked call signature (the tensors' shapes, dtypes and devices, the scalars, the
    provider asked for and PAGEDMLA_PROVIDER): ``check()`` (which raises for a bad call) the first time.
    Arguments that are not tensors are never memoised: the full checks say which."""
    try:
        key = (_signature(*tensors), _scalars(*scalars), provider, os.environ.get("PAGEDMLA_PROVIDER"))
    except AttributeError:
        key = None
    entry = table.get(key)
    if entry is None:
        entry = check()
        if key is not None:
            if len(table) > 4096:  # shapes vary with the batch: keep the table bounded
                table.clear()
            table[key] = entry
    return entry


def _scalars(*values) -> tuple:
    """Scalar arguments as a memo key: with their types, since 32 == 32.0 == True-like values must not share
    the checks of a valid call."""
    return tuple((v.__class__, v) for v in values)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    k_scale: torch.Tensor | None = None,
    is_fp8_kvcache: bool = False,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache (FlashMLA's call).

    q: [b, q_len, h_q, D] (D = 576 for DeepSeek), bf16/fp16/fp32 (fp64 on the torch provider);
    k_cache: [num_pages, page_size, 1, W] in one of the cache formats (``pagedmla.kv_format``):
      q's dtype, W = D;
      fp8_e4m3: float8_e4m3fn, W = D, with k_scale (float32, one element: value = fp8 x k_scale);
      fp8_ds_mla (is_fp8_kvcache=True, FlashMLA's keyword): uint8 or float8_e4m3fn, W = 656 bytes, D = 576;
    FP8 rows are dequantised as they are read (only the rows a request reads);
    block_table: int32 [b, max_pages]; cache_seqlens: int32 [b], KV length including the q_len new tokens;
    head_dim_v: value width, the first head_dim_v columns of each row (512);
    tile_scheduler_metadata, num_splits: from ``get_mla_metadata(cache_seqlens, q_len * h_q, 1)``.
    softmax_scale defaults to D ** -0.5. Returns out [b, q_len, h_q, head_dim_v] (q's dtype) and
    lse [b, h_q, q_len] float32. A request whose length is negative or beyond its block-table row, or that
    reads a page id outside the cache, gets NaN rows; metadata made for other lengths makes every row NaN
    (``pagedmla.errors``).
    """
    if torch.compiler.is_dynamo_compiling():
        return torch.ops.pagedmla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                         tile_scheduler_metadata, num_splits, softmax_scale, causal,
                                                         provider, k_scale, is_fp8_kvcache)
    tensors = (q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)
    entry = _memoised(_decode_signatures, tensors if k_scale is None else (*tensors, k_scale),
                      (head_dim_v, softmax_scale, is_fp8_kvcache), provider, lambda: _check_decode(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale,
        provider, k_scale, is_fp8_kvcache))
    impl, scale, fmt = entry
    if errors.host_value_checks(q.device):
        checks.paged_values(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1])
    return impl(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, scale,
                bool(causal), kv_format=fmt, k_scale=k_scale)


def _check_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                  softmax_scale, provider, k_scale, is_fp8_kvcache) -> tuple:
    """Every host check of ``flash_mla_with_kvcache``; returns (implementation, softmax scale, cache format)."""
    checks.tensor(q, "q", ndim=4, dtypes=_KV_DTYPES)
    b, q_len, h_q, d = q.shape
    fmt = checks.paged_kv(k_cache, q, head_dim_v, k_scale, is_fp8_kvcache)
    checks.block_table_and_lens(block_table, cache_seqlens, b)
    checks.tensor(tile_scheduler_metadata, "tile_scheduler_metadata", ndim=2, dtypes=(torch.int32,))
    checks.dim_equals(tile_scheduler_metadata.shape[1], 8, "tile_scheduler_metadata: row width (dim 1)")
    checks.tensor(num_splits, "num_splits", ndim=1, dtypes=(torch.int32,))
    if num_splits.shape[0] != b + 1:
        raise ValueError(f"num_splits: expected {b + 1} entries (batch + 1), got {num_splits.shape[0]}")
    if q_len < 1 or h_q < 1:
        raise ValueError(f"q: q_len and h_q must be >= 1, got shape {tuple(q.shape)}")
    checks.same_device(q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                       tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
    scale = checks.softmax_scale(softmax_scale, d ** -0.5)
    _, impl = resolve("paged_decode", q.device, provider)
    return impl, scale, fmt


def flash_mla_varlen_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    qo_indptr: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    *,
    max_q_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    is_fp8_kvcache: bool = False,
    provider: str | None = None,
    kv_page_indptr: torch.Tensor | None = None,
    num_kv_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention with a different number of query tokens per request (prefill over a
    cached prefix, unequal verify batches, mixed prefill + decode).

    q: [T, h_q, D] packed; request b's tokens are rows qo_indptr[b] .. qo_indptr[b+1]-1 and are the
    last tokens of its KV (bottom-right causal); qo_indptr: int32 [b + 1], starting at 0, ending at T;
    k_cache (any cache format), k_scale, is_fp8_kvcache, block_table, cache_seqlens, head_dim_v as in
    ``flash_mla_with_kvcache``.
    max_q_len: the largest q length, when the caller knows it on the host (checked only with host value
    checks: the kernels do not need it).
    kv_page_indptr / num_kv_pages: where the caller knows the lengths on the host, the pages each request's
    length spans, int32 [b + 1] on q's device (request b: kv_page_indptr[b + 1] - kv_page_indptr[b] >=
    ceil(cache_seqlens[b] / page_size), from 0), and its last entry as a host int. Optional, for FP8 caches on
    sm_90: the pages are dequantised into a workspace of num_kv_pages pages rather than one per block-table
    entry, so that a table as wide as one long request among short ones keeps the Hopper path (elsewhere it is
    checked, not used). On that path a span shorter than its request's length makes that request's rows NaN, a
    layout that is not a partition of the num_kv_pages pages every request's; both set ``errors.PAGE_LAYOUT``
    (and ``BLOCK_TABLE``, from the unreadable pages). With host value checks either is a ValueError.
    Returns out [T, h_q, head_dim_v] (q's dtype) and lse [T, h_q] float32. Bad values (``pagedmla.errors``): a
    request with a length outside 0 .. its block-table row's capacity or a page id outside the cache gets NaN
    rows; a qo_indptr that is not a partition of the T rows makes every row NaN.
    """
    if torch.compiler.is_dynamo_compiling():
        return torch.ops.pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, block_table, cache_seqlens, qo_indptr,
                                                                head_dim_v, softmax_scale, causal, max_q_len, provider,
                                                                k_scale, is_fp8_kvcache, kv_page_indptr, num_kv_pages)
    if max_q_len is not None and (isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 0):
        raise ValueError(f"max_q_len: expected an int >= 0, got {max_q_len!r}")
    tensors = (q, k_cache, block_table, cache_seqlens, qo_indptr)
    entry = _memoised(_paged_varlen_signatures, tensors if k_scale is None else (*tensors, k_scale),
                      (head_dim_v, softmax_scale, is_fp8_kvcache), provider, lambda: _check_paged_varlen(
        q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, softmax_scale, provider, k_scale,
        is_fp8_kvcache))
    impl, scale, fmt = entry
    checks.page_layout(kv_page_indptr, num_kv_pages, qo_indptr.shape[0] - 1, q.device)
    if errors.host_value_checks(q.device):
        checks.indptr_values(qo_indptr, "qo_indptr", q.shape[0])
        if max_q_len is not None and qo_indptr.shape[0] > 1:
            longest = int((qo_indptr[1:] - qo_indptr[:-1]).max())
            if longest > max_q_len:
                raise ValueError(f"max_q_len: {max_q_len} is below the longest q length {longest}")
        checks.paged_values(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1])
        checks.page_layout_values(kv_page_indptr, num_kv_pages, cache_seqlens, k_cache.shape[1])
    return impl(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, scale, bool(causal), max_q_len,
                kv_format=fmt, k_scale=k_scale, kv_page_indptr=kv_page_indptr, num_kv_pages=num_kv_pages)


_paged_varlen_signatures: dict[tuple, tuple] = {}


def _check_paged_varlen(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, softmax_scale,
                        provider, k_scale, is_fp8_kvcache) -> tuple:
    """Every host check of ``flash_mla_varlen_with_kvcache``; returns (implementation, softmax scale, cache
    format)."""
    checks.tensor(q, "q", ndim=3, dtypes=_KV_DTYPES)
    t, h_q, d = q.shape
    fmt = checks.paged_kv(k_cache, q, head_dim_v, k_scale, is_fp8_kvcache)
    checks.tensor(qo_indptr, "qo_indptr", ndim=1, dtypes=(torch.int32,))
    b = qo_indptr.shape[0] - 1
    if b < 0:
        raise ValueError("qo_indptr: expected batch + 1 >= 1 entries, got 0")
    checks.block_table_and_lens(block_table, cache_seqlens, b)
    checks.same_device(q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens, qo_indptr=qo_indptr)
    checks.indptr_shape(qo_indptr, "qo_indptr", b + 1, t)
    scale = checks.softmax_scale(softmax_scale, d ** -0.5)
    _, impl = resolve("paged_varlen", q.device, provider)
    return impl, scale, fmt


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_attn_probs: bool = False,
    *,
    out: torch.Tensor | None = None,
    provider: str | None = None,
):
    """Ragged attention over packed variable-length sequences (FlashAttention's varlen call).

    q: [total_q, H, Dqk]; k: [total_k, Hk, Dqk]; v: [total_k, Hk, Dv] with H a multiple of Hk (GQA);
    cu_seqlens_q: int32 [b + 1], a partition of q's rows (0 .. total_q); cu_seqlens_k: int32 [b + 1], sequence
    b's keys are rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v (non-decreasing inside 0 .. total_k:
    rows no sequence reads are allowed); max_seqlen_q/k: host ints bounding the lengths; softmax_scale defaults
    to Dqk ** -0.5; causal is bottom-right aligned when q and k lengths differ. ``out`` [total_q, H, Dv]
    receives the result when given. Returns out, or (out, lse [H, total_q] float32, None) when
    ``return_attn_probs`` is set. With the ``triton`` provider on an sm_90 GPU (fp16/bf16, Dqk 64/128/192,
    Dv 64/128) a Hopper kernel runs; it needs contiguous q/k/v and copies strided ones when the queries are
    long enough to pay for it (``kernels/triton/varlen.py``), so pass contiguous tensors where you can.
    Bad values (``pagedmla.errors``): a cu_seqlens_q that is not a partition of the q rows makes every row
    NaN; a sequence whose key range lies outside k, or longer than max_seqlen_q, gets NaN rows.
    """
    if torch.compiler.is_dynamo_compiling():
        return _traced_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              return_attn_probs, out, provider)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    entry = _memoised(_varlen_signatures, (q, k, v, cu_seqlens_q, cu_seqlens_k, *(() if out is None else (out,))),
                      (softmax_scale,), provider, lambda: _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, out, provider))
    impl, scale = entry
    if errors.host_value_checks(q.device):
        checks.indptr_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
        checks.indptr_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0], partition=False)
        if cu_seqlens_q.shape[0] > 1:
            lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()
            lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()
            lq, lk = torch.stack([lq, lk]).tolist()
            if lq > max_seqlen_q:
                raise ValueError(f"max_seqlen_q: {max_seqlen_q} is below the longest q sequence {lq}")
            if lk > max_seqlen_k:
                raise ValueError(f"max_seqlen_k: {max_seqlen_k} is below the longest k sequence {lk}")
    o, lse = impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, bool(causal), out)
    if return_attn_probs:
        return o, lse.transpose(0, 1).contiguous(), None
    return o


_varlen_signatures: dict[tuple, tuple[Callable, float]] = {}


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, out, provider) -> tuple[Callable, float]:
    """Every host check of ``flash_attn_varlen_func``; returns (implementation, softmax scale)."""
    checks.tensor(q, "q", ndim=3, dtypes=_KV_DTYPES)
    checks.tensor(k, "k", ndim=3)
    checks.tensor(v, "v", ndim=3)
    _same_dtype(q, "k", k)
    _same_dtype(q, "v", v)
    tq, h, dqk = q.shape
    tk, hk, dk = k.shape
    if dk != dqk:
        raise ValueError(f"k: head dim {dk} differs from q's {dqk}")
    if v.shape[0] != tk or v.shape[1] != hk:
        raise ValueError(f"v: expected shape [{tk}, {hk}, Dv] to match k, got {tuple(v.shape)}")
    if hk < 1 or h % hk:
        raise ValueError(f"k: q's {h} heads must be a multiple of k's {hk} heads")
    b = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else -1
    checks.indptr_shape(cu_seqlens_q, "cu_seqlens_q", max(b, 0) + 1, tq)
    checks.indptr_shape(cu_seqlens_k, "cu_seqlens_k", max(b, 0) + 1, None)
    if out is not None:
        checks.tensor(out, "out", ndim=3)
        if tuple(out.shape) != (tq, h, v.shape[2]) or out.dtype != q.dtype:
            raise ValueError(f"out: expected {q.dtype} of shape {(tq, h, v.shape[2])}, "
                             f"got {out.dtype} {tuple(out.shape)}")
    checks.same_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out)
    scale = checks.softmax_scale(softmax_scale, dqk ** -0.5)
    _, impl = resolve("varlen", q.device, provider)
    return impl, scale


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_lse: torch.Tensor | None = None,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets: softmax-weighted by their LSEs.

    v_a, v_b: [T, H, D]; s_a, s_b: float32 [T, H] natural-log LSE. An empty state (LSE -inf, or +inf:
    FlashMLA's and FlashAttention's empty row) adds nothing; two empty ones give 0 and -inf. A NaN LSE, or a
    NaN value in a non-empty state, is corruption, never an empty state: that row's result is NaN.
    ``out`` / ``out_lse`` receive the results when given (they may be v_a / s_a for an in-place update).
    Returns (v [T, H, D], s [T, H] float32).
    """
    if torch.compiler.is_dynamo_compiling():
        return _traced_merge(v_a, s_a, v_b, s_b, out, out_lse, provider)
    checks.tensor(v_a, "v_a", ndim=3, dtypes=_KV_DTYPES)
    checks.tensor(v_b, "v_b", ndim=3)
    _same_dtype(v_a, "v_b", v_b)
    if v_b.shape != v_a.shape:
        raise ValueError(f"v_b: shape {tuple(v_b.shape)} differs from v_a's {tuple(v_a.shape)}")
    lse_dtypes = (torch.float32, torch.float64)
    for name, s in (("s_a", s_a), ("s_b", s_b)):
        checks.tensor(s, name, ndim=2, dtypes=lse_dtypes)
        if tuple(s.shape) != tuple(v_a.shape[:2]):
            raise ValueError(f"{name}: expected shape {tuple(v_a.shape[:2])}, got {tuple(s.shape)}")
    if out is not None:
        checks.tensor(out, "out", ndim=3)
        if out.shape != v_a.shape or out.dtype != v_a.dtype:
            raise ValueError(f"out: expected {v_a.dtype} of shape {tuple(v_a.shape)}, "
                             f"got {out.dtype} {tuple(out.shape)}")
    if out_lse is not None:
        checks.tensor(out_lse, "out_lse", ndim=2, dtypes=lse_dtypes)
        if tuple(out_lse.shape) != tuple(v_a.shape[:2]):
            raise ValueError(f"out_lse: expected shape {tuple(v_a.shape[:2])}, got {tuple(out_lse.shape)}")
    checks.same_device(v_a, s_a=s_a, v_b=v_b, s_b=s_b, out=out, out_lse=out_lse)
    _, impl = resolve("merge", v_a.device, provider)
    return impl(v_a, s_a, v_b, s_b, out, out_lse)


# The traced forms (Dynamo only): the calls as the ``pagedmla::`` custom ops that ``ops/library.py`` registers,
# looked up by name so that this module need not import that one (which imports this one for the real
# implementations).

def _traced_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                   return_attn_probs, out, provider):
    """``flash_attn_varlen_func`` while Dynamo traces (same arguments and returns)."""
    if out is None:
        o, lse = torch.ops.pagedmla.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     softmax_scale, causal, provider)
    else:
        lse = torch.ops.pagedmla.varlen_attention_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                      max_seqlen_k, out, softmax_scale, causal, provider)
        o = out
    return (o, lse, None) if return_attn_probs else o


def _traced_merge(v_a, s_a, v_b, s_b, out, out_lse, provider):
    """``merge_state`` while Dynamo traces: the results always land in buffers (fresh ones when not given),
    declared as mutated."""
    if out is None:
        out = torch.empty_like(v_a)
    if out_lse is None:
        out_lse = torch.empty(s_a.shape, dtype=lse_dtype(v_a), device=v_a.device)
    torch.ops.pagedmla.merge_state_out(v_a, s_a, v_b, s_b, out, out_lse, provider)
    return out, out_lse
