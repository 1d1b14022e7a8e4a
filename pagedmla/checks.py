"""Argument checks shared by the public ops: each failure is a ValueError/TypeError naming the argument.

Shape and dtype checks are free and always run. Checks of tensor *values* (lengths within the block
table, page ids within the cache, monotone indptrs) need the values on the host: they run where
``pagedmla.errors.host_value_checks`` says (CPU tensors by default, CUDA tensors with
``PAGEDMLA_VALIDATE=all``); elsewhere the kernels guard the values themselves (``pagedmla.errors``).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from pagedmla import kv_format
from pagedmla.errors import host_value_checks

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(t, name: str, *, ndim: int | None = None, dtypes: Iterable[torch.dtype] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    return t


def same_device(ref: torch.Tensor, **named: torch.Tensor | None) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: expected a tensor on {ref.device}, got one on {t.device}")


def dim_equals(actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{what}: expected {expected}, got {actual}")


_MAX_SCALE = 2.0 ** 127  # times log2(e) still below float32's largest value


def softmax_scale(value, default: float) -> float:
    return default if value is None else positive_scale(value)


def positive_scale(value) -> float:
    """A softmax scale as the kernels need it: a finite positive real that stays finite in float32 once
    multiplied by log2(e) (the kernels work in base 2 and float32; the Hopper kernels keep unscaled row
    maxima, which are the maxima of the scaled scores only for a positive scale)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < _MAX_SCALE:
        raise ValueError(f"softmax_scale: expected a finite positive float, got {value!r}")
    return float(value)


def paged_kv(k_cache: torch.Tensor, q: torch.Tensor, head_dim_v, k_scale=None, is_fp8_kvcache=False) -> str | None:
    """k_cache [num_pages, page_size, 1, W] with 0 < head_dim_v <= q's head dim D, in one of the cache formats
    (``pagedmla.kv_format``); returns the FP8 format it holds, or None for rows of q's float dtype (W = D):
      ``fp8_e4m3``: float8_e4m3fn, W = D, with ``k_scale`` (float32, one element, on k_cache's device);
      ``fp8_ds_mla`` (``is_fp8_kvcache=True``, FlashMLA's keyword): uint8 or float8_e4m3fn, W = 656, D = 576,
      head_dim_v = 512, no k_scale."""
    tensor(k_cache, "k_cache", ndim=4)
    num_pages, page_size, h_kv, width = k_cache.shape
    if h_kv != 1:
        raise ValueError(f"k_cache: MLA keeps one KV head, got {h_kv} (shape {tuple(k_cache.shape)})")
    if page_size < 1 or page_size & (page_size - 1) or page_size > 256:
        raise ValueError(f"k_cache: page size (dim 1) must be a power of two in 1..256, got {page_size}")
    d = q.shape[-1]
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int) or not 0 < head_dim_v <= d:
        raise ValueError(f"head_dim_v: expected an int in 1..{d}, got {head_dim_v!r}")
    if not isinstance(is_fp8_kvcache, bool):
        raise ValueError(f"is_fp8_kvcache: expected a bool, got {is_fp8_kvcache!r}")
    fmt = _cache_format(k_cache, q, head_dim_v, is_fp8_kvcache)
    if fmt == "fp8_e4m3":
        if k_scale is None:
            raise ValueError("k_scale: an fp8_e4m3 (float8_e4m3fn) k_cache needs its layer's scale, a float32 "
                             "tensor of one element")
        kv_format.check_k_scale(k_scale, k_cache.device)
    elif k_scale is not None:
        raise ValueError(f"k_scale: only an fp8_e4m3 (float8_e4m3fn, width {d}) k_cache takes a scale; this one is "
                         f"{fmt or k_cache.dtype}")
    if fmt is None and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} differs from q's {q.dtype}")
    return fmt


def _cache_format(k_cache: torch.Tensor, q: torch.Tensor, head_dim_v: int, is_fp8_kvcache: bool) -> str | None:
    """The format of a shape-checked paged k_cache (``paged_kv``), from its dtype, width and the flag."""
    width, d = k_cache.shape[-1], q.shape[-1]
    if is_fp8_kvcache:
        if k_cache.dtype not in (torch.uint8, kv_format.FP8_DTYPE):
            raise ValueError(f"k_cache: is_fp8_kvcache=True reads fp8_ds_mla rows of uint8 or float8_e4m3fn bytes, "
                             f"got {k_cache.dtype}")
        if width != kv_format.DS_ROW_BYTES:
            raise ValueError(f"k_cache: fp8_ds_mla rows (is_fp8_kvcache=True) are {kv_format.DS_ROW_BYTES} bytes, "
                             f"got width {width}")
        if (d, head_dim_v) != (kv_format.ROW_DIM, kv_format.LATENT_DIM):
            raise ValueError(f"q: fp8_ds_mla caches hold {kv_format.ROW_DIM} columns with {kv_format.LATENT_DIM} "
                             f"values: q's head dim must be {kv_format.ROW_DIM} and head_dim_v "
                             f"{kv_format.LATENT_DIM}, got {d} and {head_dim_v}")
        return "fp8_ds_mla"
    if k_cache.dtype == torch.uint8 or (k_cache.dtype == kv_format.FP8_DTYPE and width == kv_format.DS_ROW_BYTES
                                        and d != width):
        raise ValueError(f"k_cache: {k_cache.dtype} rows of width {width} look like fp8_ds_mla rows: pass "
                         "is_fp8_kvcache=True")
    if k_cache.dtype not in FLOAT_DTYPES + (kv_format.FP8_DTYPE,):
        names = ", ".join(str(t).replace("torch.", "") for t in FLOAT_DTYPES + (kv_format.FP8_DTYPE, torch.uint8))
        raise ValueError(f"k_cache: expected dtype in ({names}), got {str(k_cache.dtype).replace('torch.', '')}")
    if width != d:
        raise ValueError(f"k_cache: head dim {width} differs from q's head dim {d}")
    return "fp8_e4m3" if k_cache.dtype == kv_format.FP8_DTYPE else None


def block_table_and_lens(block_table: torch.Tensor, cache_seqlens: torch.Tensor, batch: int) -> None:
    tensor(block_table, "block_table", ndim=2, dtypes=(torch.int32,))
    tensor(cache_seqlens, "cache_seqlens", ndim=1, dtypes=(torch.int32,))
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (one per request), got {block_table.shape[0]}")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens: expected {batch} entries (one per request), got {cache_seqlens.shape[0]}")


def pages_spanned(lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64: the pages of ``page_size`` tokens that lengths ``lens`` span (0 for a negative length)."""
    return (lens.to(torch.int64).clamp(min=0) + page_size - 1) // page_size


def outside_pages(block_table: torch.Tensor, spans: torch.Tensor, num_pages: int) -> torch.Tensor:
    """bool [rows, width]: the entries of each row's first ``spans`` pages (int [rows]) that are not a page of
    a cache of ``num_pages`` pages. Device ops only, no synchronisation."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    return (cols < spans.unsqueeze(1)) & ((block_table < 0) | (block_table >= num_pages))


def paged_values(block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_pages: int, page_size: int) -> None:
    """Lengths non-negative and within the block table; every page a request reads is a real page."""
    if not host_value_checks(block_table.device) or block_table.shape[0] == 0:
        return
    capacity = block_table.shape[1] * page_size
    lens = cache_seqlens.to(torch.int64)
    bad_page = outside_pages(block_table, pages_spanned(lens, page_size), num_pages)
    flags = torch.stack([lens.min(), lens.max(), bad_page.any().to(torch.int64)]).tolist()
    if flags[0] < 0:
        raise ValueError(f"cache_seqlens: lengths must be >= 0, got minimum {flags[0]}")
    if flags[1] > capacity:
        raise ValueError(f"cache_seqlens: length {flags[1]} exceeds the block table's capacity "
                         f"{block_table.shape[1]} pages x {page_size} = {capacity}")
    if flags[2]:
        row, col = bad_page.nonzero()[0].tolist()
        raise ValueError(f"block_table: page id {int(block_table[row, col])} at [{row}, {col}] is outside "
                         f"the cache's 0..{num_pages - 1}")


def page_layout(kv_page_indptr: torch.Tensor | None, num_kv_pages, batch: int, device: torch.device) -> None:
    """The host half of a page layout (the pages each request's length spans, ``flash_mla_varlen_with_kvcache``):
    ``kv_page_indptr`` and ``num_kv_pages`` both given or neither; kv_page_indptr int32 [batch + 1] on
    ``device``, num_kv_pages an int >= 0 (its last entry, which the caller knows on the host)."""
    if kv_page_indptr is None and num_kv_pages is None:
        return
    if kv_page_indptr is None or num_kv_pages is None:
        raise ValueError("kv_page_indptr / num_kv_pages: give both or neither")
    tensor(kv_page_indptr, "kv_page_indptr", ndim=1, dtypes=(torch.int32,))
    if kv_page_indptr.shape[0] != batch + 1:
        raise ValueError(f"kv_page_indptr: expected {batch + 1} entries (requests + 1), got {kv_page_indptr.shape[0]}")
    if kv_page_indptr.device != device:
        raise ValueError(f"kv_page_indptr: expected a tensor on {device}, got one on {kv_page_indptr.device}")
    if isinstance(num_kv_pages, bool) or not isinstance(num_kv_pages, int) or num_kv_pages < 0:
        raise ValueError(f"num_kv_pages: expected an int >= 0, got {num_kv_pages!r}")


def page_layout_values(kv_page_indptr: torch.Tensor | None, num_kv_pages: int | None, cache_seqlens: torch.Tensor,
                       page_size: int) -> None:
    """The value half of ``page_layout`` (one synchronisation on CUDA), where ``host_value_checks`` says: an
    indptr from 0 to ``num_kv_pages`` whose span for each request covers the pages its length reads."""
    if kv_page_indptr is None or not host_value_checks(kv_page_indptr.device):
        return
    t = kv_page_indptr.to(torch.int64)
    need = pages_spanned(cache_seqlens, page_size)
    short = (t[1:] - t[:-1]) < need
    first, last, decreasing, under = torch.stack([t[0], t[-1], (t[1:] < t[:-1]).any().to(torch.int64),
                                                  short.any().to(torch.int64)]).tolist()
    if first != 0 or last != num_kv_pages or decreasing:
        raise ValueError(f"kv_page_indptr: must run non-decreasing from 0 to num_kv_pages = {num_kv_pages}, got "
                         f"{first} .. {last}{' (decreasing)' if decreasing else ''}")
    if under:
        b = int(short.nonzero()[0])
        raise ValueError(f"kv_page_indptr: request {b} spans {int(t[b + 1] - t[b])} pages, fewer than the "
                         f"{int(need[b])} its cache_seqlens {int(cache_seqlens[b])} reads")


def indptr(t: torch.Tensor, name: str, size: int, total: int | None) -> None:
    """An int32 [size] cumulative index starting at 0, non-decreasing, ending at ``total`` if given (the
    values checked where ``host_value_checks`` says)."""
    indptr_shape(t, name, size, total)
    indptr_values(t, name, total)


def indptr_shape(t: torch.Tensor, name: str, size: int, total: int | None) -> None:
    """The host half of ``indptr``: an int32 1-D tensor of ``size`` entries (with no entries past the first
    there are no sequences, so ``total`` must be 0)."""
    tensor(t, name, ndim=1, dtypes=(torch.int32,))
    if t.shape[0] != size:
        raise ValueError(f"{name}: expected {size} entries, got {t.shape[0]}")
    if size == 1 and total:
        raise ValueError(f"{name}: one entry (no sequences) cannot cover {total} rows")


def indptr_values(t: torch.Tensor, name: str, total: int | None, partition: bool = True) -> None:
    """The value half of ``indptr`` (one synchronisation on CUDA), where ``host_value_checks`` says: with
    ``partition`` the entries run non-decreasing from 0 to ``total``; without, they only stay inside
    [0, total] (key ranges that need not cover every row, as the kernels accept them)."""
    if not host_value_checks(t.device) or t.shape[0] == 0:
        return
    first, last, decreasing = torch.stack(
        [t[0].to(torch.int64), t[-1].to(torch.int64), (t[1:] < t[:-1]).any().to(torch.int64)]).tolist()
    if partition and first != 0:
        raise ValueError(f"{name}: must start at 0, got {first}")
    if first < 0:
        raise ValueError(f"{name}: must not be negative, starts at {first}")
    if decreasing:
        raise ValueError(f"{name}: must be non-decreasing")
    if total is not None and partition and last != total:
        raise ValueError(f"{name}: last entry {last} must equal the number of tokens {total}")
    if total is not None and last > total:
        raise ValueError(f"{name}: last entry {last} is past the {total} rows")
