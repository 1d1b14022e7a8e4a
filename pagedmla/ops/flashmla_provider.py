"""The `flashmla` provider: FlashMLA's sm90 dense decode (``sgl-flash-mla``), for side-by-side runs.

FlashMLA's own limits apply and are checked here rather than failing inside the library: bfloat16
(no FP8 cache), page size 64, Hopper GPUs. Its split schedule differs from pagedmla's, so the adapter computes
FlashMLA's own on every call (on the device, no host synchronisation; once per layer, where an engine
built on FlashMLA alone would compute it once per step) and ignores the metadata it is given.
"""

from __future__ import annotations

import flash_mla
import torch

from pagedmla.ops.providers import register_impl


def paged_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                 softmax_scale, causal, kv_format=None, k_scale=None):
    if kv_format is not None:
        raise ValueError(f"k_cache: the flashmla provider runs bfloat16 caches (FlashMLA has no dense FP8 "
                         f"decode), got {kv_format}; use provider='triton' or 'torch'")
    if q.device.type != "cuda" or q.dtype != torch.bfloat16:
        raise ValueError(f"q: the flashmla provider runs bfloat16 CUDA tensors, got {q.dtype} on {q.device}")
    if k_cache.shape[1] != 64:
        raise ValueError(f"k_cache: the flashmla provider needs page size 64, got {k_cache.shape[1]}")
    b, s_q, h_q, _ = q.shape
    sched = flash_mla.flash_mla_interface.FlashMLASchedMeta()
    sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
        cache_seqlens, s_q * h_q, 1, use_legacy=True)
    return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, None,
                                            softmax_scale=softmax_scale, causal=causal, use_legacy=True)


register_impl("paged_decode", "flashmla", paged_decode)
