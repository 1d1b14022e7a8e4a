"""FlashMLA's dense decode API on pagedmla's kernels: ``import pagedmla.flash_mla as flash_mla``.

Follows deepseek-ai/FlashMLA's ``flash_mla/flash_mla_interface.py`` in both of its generations:

* 2025 (explicit metadata; FlashMLA up to September 2025, the last sm90-only releases and
  ``sgl-flash-mla``): ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k[, num_heads_q,
  is_fp8_kvcache, topk])`` returns int32 ``(tile_scheduler_metadata, num_splits)``, which
  ``flash_mla_with_kvcache(..., tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False)`` takes.
* current (FlashMLA since January 2026, checked against commit 9241ae3): ``get_mla_metadata()`` without
  arguments returns ``(FlashMLASchedMeta(), None)``; the first ``flash_mla_with_kvcache(...,
  tile_scheduler_metadata=sched_meta, num_splits=None)`` fills the schedule from that call's shapes and
  ``cache_seqlens``, later calls reuse it and must keep those shapes (and, as in FlashMLA, the same length
  values: the schedule is not recomputed).

Conventions are FlashMLA's, not pagedmla's: a query row that sees no key (a request of length 0, or a
causal row before the first key) returns output 0 and LSE **+inf** (pagedmla's native API says -inf);
``pagedmla.merge_state`` reads both as empty. LSE is the natural log, float32 ``[b, h_q, s_q]``.

FP8 caches: ``is_fp8_kvcache=True`` reads a k_cache of FlashMLA's FP8 KV format (``fp8_ds_mla``: 656-byte rows of
uint8 or float8_e4m3fn, as FlashMLA's quantiser writes them, page stride free; ``pagedmla.kv_format``) in dense
attention, where FlashMLA itself reads that format only in its sparse kernels; the schedule is the same as for
bf16 caches, so ``get_mla_metadata`` accepts the flag and ignores it.

FlashMLA features pagedmla does not have raise ``NotImplementedError`` naming the argument instead of
being ignored: sparse attention (``indices``, ``topk``, ``topk_length``), attention sinks (``attn_sink``),
extra caches (``extra_k_cache``, ``extra_indices_in_kvcache``, ``extra_topk_length``). Several KV heads
(``k_cache.shape[2] > 1``) are rejected by the native checks with a ``ValueError``: MLA keeps one latent head.
The provider is chosen as for every pagedmla op (``PAGEDMLA_PROVIDER``, else the best one for the device).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pagedmla.ops import attention, schedule


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The current FlashMLA's schedule object: empty from ``get_mla_metadata()``, filled by the first
    ``flash_mla_with_kvcache`` call that receives it (fields as in FlashMLA)."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def _unsupported(name: str, value, what: str) -> None:
    if value is not None and value is not False:
        raise NotImplementedError(f"{name}: {what} is not supported by pagedmla.flash_mla (got {_describe(value)})")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def get_mla_metadata(
    cache_seqlens: torch.Tensor | None = None,
    num_q_tokens_per_head_k: int | None = None,
    num_heads_k: int | None = None,
    num_heads_q: int | None = None,
    is_fp8_kvcache: bool = False,
    topk: int | None = None,
):
    """FlashMLA's scheduling call, both generations.

    Without arguments (current FlashMLA): returns ``(FlashMLASchedMeta(), None)``, filled lazily by the
    first ``flash_mla_with_kvcache`` call. With them (2025 FlashMLA): cache_seqlens int32 [b] (KV lengths
    including this step's tokens), num_q_tokens_per_head_k = s_q * h_q // h_k, num_heads_k = 1; returns
    ``(tile_scheduler_metadata int32 [parts, 8], num_splits int32 [b + 1])`` computed on the device without
    host synchronisation. ``num_heads_q`` is accepted and unused (FlashMLA needs it for sparse attention), and so
    is ``is_fp8_kvcache`` (FP8 caches split the same way).
    """
    if cache_seqlens is None and num_q_tokens_per_head_k is None and num_heads_k is None:
        _unsupported("topk", topk, "sparse attention")
        return FlashMLASchedMeta(), None
    if num_q_tokens_per_head_k is None or num_heads_k is None:
        raise TypeError("get_mla_metadata: pass cache_seqlens, num_q_tokens_per_head_k and num_heads_k "
                        "(2025 FlashMLA) or no arguments (current FlashMLA)")
    _unsupported("topk", topk, "sparse attention")
    if num_heads_q is not None and (isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int)
                                    or num_heads_q < 1):
        raise ValueError(f"num_heads_q: expected a positive int or None, got {num_heads_q!r}")
    return schedule.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)


def _check_config(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config) -> None:
    """Later calls on one schedule must keep the first call's shapes and flags (FlashMLA asserts this)."""
    for f in dataclasses.fields(config):
        first, now = getattr(meta.config, f.name), getattr(config, f.name)
        if first != now:
            raise ValueError(f"tile_scheduler_metadata: this FlashMLASchedMeta was filled for {f.name}={first!r}, "
                             f"this call has {f.name}={now!r}; use a fresh get_mla_metadata() per shape")


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta | torch.Tensor,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's paged MLA decode, dense attention.

    q: [b, s_q, h_q, d] (d = 576 for DeepSeek); k_cache: [num_blocks, page_block_size, 1, d], q's dtype, or with
    ``is_fp8_kvcache=True`` FlashMLA's FP8 rows [num_blocks, page_block_size, 1, 656] (uint8 or float8_e4m3fn);
    block_table: int32 [b, max_blocks]; cache_seqlens: int32 [b]; head_dim_v: the value width (the first
    head_dim_v columns of a cache row, 512); tile_scheduler_metadata / num_splits: a ``FlashMLASchedMeta``
    and None (current FlashMLA) or the two tensors of the 2025 ``get_mla_metadata``. softmax_scale defaults
    to d ** -0.5; causal masks bottom-right aligned. Returns out [b, s_q, h_q, head_dim_v] (q's dtype) and
    lse [b, h_q, s_q] float32, +inf for a row that sees no key (module docstring).
    """
    _unsupported("indices", indices, "sparse attention")
    _unsupported("attn_sink", attn_sink, "an attention sink")
    _unsupported("extra_k_cache", extra_k_cache, "an extra KV cache")
    _unsupported("extra_indices_in_kvcache", extra_indices_in_kvcache, "an extra KV cache")
    _unsupported("topk_length", topk_length, "sparse attention")
    _unsupported("extra_topk_length", extra_topk_length, "sparse attention")
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t is None:
            raise ValueError(f"{name}: required for dense attention (None only goes with sparse indices)")
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        if num_splits is not None:
            raise ValueError("num_splits: must be None when tile_scheduler_metadata is a FlashMLASchedMeta")
        meta = tile_scheduler_metadata
        for name, t in (("q", q), ("k_cache", k_cache)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a 4-D tensor, got {_describe(t)}")
        b, s_q, h_q, _ = q.shape
        h_k = k_cache.shape[2]
        config = FlashMLASchedMeta.Config(b, s_q, h_q, k_cache.shape[1], h_k, bool(causal), bool(is_fp8_kvcache),
                                          None, None, None)
        if not meta.have_initialized:
            # Several KV heads are rejected by the attention call below; the schedule only needs a valid count.
            h_k = max(1, h_k)
            meta.tile_scheduler_metadata, meta.num_splits = schedule.get_mla_metadata(
                cache_seqlens, max(1, s_q * h_q // h_k), h_k)
            meta.config = config
            meta.have_initialized = True
        else:
            _check_config(meta, config)
        md, ns = meta.tile_scheduler_metadata, meta.num_splits
    elif isinstance(tile_scheduler_metadata, torch.Tensor):
        if num_splits is None:
            raise ValueError("num_splits: required with a tensor tile_scheduler_metadata (2025 FlashMLA: pass "
                             "both outputs of get_mla_metadata(cache_seqlens, ...)); or pass the "
                             "FlashMLASchedMeta of get_mla_metadata() with num_splits=None")
        md, ns = tile_scheduler_metadata, num_splits
    else:
        raise TypeError("tile_scheduler_metadata: expected a FlashMLASchedMeta (get_mla_metadata()) or an int32 "
                        f"tensor (get_mla_metadata(cache_seqlens, ...)), got {type(tile_scheduler_metadata).__name__}")
    return _native(q, k_cache, block_table, cache_seqlens, head_dim_v, md, ns, softmax_scale, causal, is_fp8_kvcache)


def _native(q, k_cache, block_table, cache_seqlens, head_dim_v, md, ns, softmax_scale, causal, is_fp8_kvcache):
    out, lse = attention.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, md, ns,
                                                softmax_scale, causal, is_fp8_kvcache=is_fp8_kvcache)
    # FlashMLA's empty row: -inf -> +inf in one in-place pass (NaN and +inf kept as they are).
    return out, lse.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=math.inf)
