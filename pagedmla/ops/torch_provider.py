"""The `torch` provider: the reference functions adapted to each op's calling convention."""

from __future__ import annotations

import torch

from pagedmla import reference
from pagedmla.ops.providers import register_impl


def paged_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                 softmax_scale, causal, kv_format=None, k_scale=None):
    b, s_q, h, d = q.shape
    qo_indptr = torch.arange(0, (b + 1) * s_q, s_q, device=q.device, dtype=torch.int32)
    out, lse = reference.paged_mla_attention(q.reshape(b * s_q, h, d), k_cache, block_table, cache_seqlens,
                                             qo_indptr, softmax_scale, causal, head_dim_v, k_cache.shape[1],
                                             kv_format, k_scale)
    return (out.to(q.dtype).reshape(b, s_q, h, head_dim_v),
            lse.to(reference.lse_dtype(q)).reshape(b, s_q, h).transpose(1, 2).contiguous())


def paged_varlen(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, softmax_scale, causal, max_q_len,
                 kv_format=None, k_scale=None, kv_page_indptr=None, num_kv_pages=None):
    # The page layout hint sizes the triton provider's dequantised workspace; the reference reads the cache as is.
    out, lse = reference.paged_mla_attention(q, k_cache, block_table, cache_seqlens, qo_indptr, softmax_scale,
                                             causal, head_dim_v, k_cache.shape[1], kv_format, k_scale)
    return out.to(q.dtype), lse.to(reference.lse_dtype(q))


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out):
    o, lse = reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q)
    if out is None:
        return o.to(q.dtype), lse.to(reference.lse_dtype(q))
    out.copy_(o)
    return out, lse.to(reference.lse_dtype(q))


def merge(v_a, s_a, v_b, s_b, out, out_lse):
    v, s = reference.merge_state(v_a, s_a, v_b, s_b)
    v = v.to(v_a.dtype)
    s = s.to(reference.lse_dtype(v_a))
    if out is not None:
        out.copy_(v)
        v = out
    if out_lse is not None:
        out_lse.copy_(s)
        s = out_lse
    return v, s


register_impl("paged_decode", "torch", paged_decode)
register_impl("paged_varlen", "torch", paged_varlen)
register_impl("varlen", "torch", varlen)
register_impl("merge", "torch", merge)
