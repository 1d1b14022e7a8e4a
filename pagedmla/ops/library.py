"""pagedmla's public ops as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)``.

Dynamo cannot trace into the kernels (Triton launches, host-side checks, the reference's Python loops), so
each public op is registered under the ``pagedmla::`` namespace with a fake (meta) implementation that
gives the output shapes and dtypes, and with its mutations declared (``out=`` buffers, in-place merges,
cache writes). The real implementations are the eager public calls of ``ops/attention.py`` and
``ops/schedule.py``, imported here; those calls route to these ops only while Dynamo traces, by name
(``torch.ops.pagedmla.<op>``: their first statement is ``if torch.compiler.is_dynamo_compiling(): ...``), so
that the public modules never import this one and an eager call never pays for the dispatcher (a custom
op's dispatch costs microseconds; ``is_dynamo_compiling()`` is a constant False outside Dynamo, as cheap as
an empty call: 81 ns against 186 ns for ``is_compiling()`` on the CI machine, which also reads a flag).
``ops/__init__.py`` imports this module, so the ops exist once ``pagedmla`` is imported. Dynamo tracing
(``torch.compile``) takes the custom ops; ``torch.export`` in non-strict mode does not. No backward is
registered: compile for inference (``torch.no_grad``).

Argument checks run inside the real implementations (at run time), not while tracing. The backend's
forward paths trace through ``MLABackend``'s traced forms (``backend.py``), which express one planned step
with these ops (``cache_write`` + attention; the chunked-prefix form's ``cache_gather`` and merge; the MHA
forms' ``poison_bad_lengths``).
"""

from __future__ import annotations

import torch

from pagedmla import rows
from pagedmla.ops import attention, schedule
from pagedmla.reference import lse_dtype


@torch.library.custom_op("pagedmla::flash_mla_with_kvcache", mutates_args=())
def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                           provider: str | None = None, k_scale: torch.Tensor | None = None,
                           is_fp8_kvcache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                tile_scheduler_metadata, num_splits, softmax_scale, causal,
                                                k_scale=k_scale, is_fp8_kvcache=is_fp8_kvcache, provider=provider)
    return out, lse


@flash_mla_with_kvcache.register_fake
def _(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale=None,
      causal=False, provider=None, k_scale=None, is_fp8_kvcache=False):
    b, s_q, h, _ = q.shape
    return q.new_empty(b, s_q, h, head_dim_v), q.new_empty(b, h, s_q, dtype=lse_dtype(q))


@torch.library.custom_op("pagedmla::flash_mla_varlen_with_kvcache", mutates_args=())
def flash_mla_varlen_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                                  cache_seqlens: torch.Tensor, qo_indptr: torch.Tensor, head_dim_v: int,
                                  softmax_scale: float | None = None, causal: bool = True,
                                  max_q_len: int | None = None,
                                  provider: str | None = None, k_scale: torch.Tensor | None = None,
                                  is_fp8_kvcache: bool = False, kv_page_indptr: torch.Tensor | None = None,
                                  num_kv_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention.flash_mla_varlen_with_kvcache(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v,
                                                       softmax_scale, causal, max_q_len=max_q_len, k_scale=k_scale,
                                                       is_fp8_kvcache=is_fp8_kvcache, provider=provider,
                                                       kv_page_indptr=kv_page_indptr, num_kv_pages=num_kv_pages)
    return out, lse


@flash_mla_varlen_with_kvcache.register_fake
def _(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, softmax_scale=None, causal=True, max_q_len=None,
      provider=None, k_scale=None, is_fp8_kvcache=False, kv_page_indptr=None, num_kv_pages=None):
    t, h, _ = q.shape
    return q.new_empty(t, h, head_dim_v), q.new_empty(t, h, dtype=lse_dtype(q))


@torch.library.custom_op("pagedmla::varlen_attention", mutates_args=())
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None = None, causal: bool = False,
                     provider: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func returning (out [Tq, H, Dv], lse [H, Tq])."""
    out, lse, _ = attention.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   softmax_scale, causal, True, provider=provider)
    return out, lse


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
      provider=None):
    t, h, _ = q.shape
    return q.new_empty(t, h, v.shape[2]), q.new_empty(h, t, dtype=lse_dtype(q))


@torch.library.custom_op("pagedmla::varlen_attention_out", mutates_args=("out",))
def varlen_attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor,
                         softmax_scale: float | None = None, causal: bool = False,
                         provider: str | None = None) -> torch.Tensor:
    """flash_attn_varlen_func writing ``out``; returns lse [H, Tq]."""
    _, lse, _ = attention.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 softmax_scale, causal, True, out=out, provider=provider)
    return lse


@varlen_attention_out.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, softmax_scale=None, causal=False,
      provider=None):
    t, h, _ = q.shape
    return q.new_empty(h, t, dtype=lse_dtype(q))


@torch.library.custom_op("pagedmla::merge_state_out", mutates_args=("out", "out_lse"))
def merge_state_out(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, out: torch.Tensor,
                    out_lse: torch.Tensor, provider: str | None = None) -> None:
    """merge_state into ``out`` / ``out_lse`` (which may be v_a / s_a, as in the eager call)."""
    attention.merge_state(v_a, s_a, v_b, s_b, out, out_lse=out_lse, provider=provider)


@merge_state_out.register_fake
def _(v_a, s_a, v_b, s_b, out, out_lse, provider=None):
    return None


@torch.library.custom_op("pagedmla::get_mla_metadata", mutates_args=())
def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_sm_parts: int | None = None,
                     kv_format: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    md, ns = schedule.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts=num_sm_parts,
                                       kv_format=kv_format)
    return md, ns


@get_mla_metadata.register_fake
def _(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts=None, kv_format=None):
    parts = num_sm_parts or schedule.num_sm_parts_for(cache_seqlens.device, num_q_tokens_per_head_k, num_heads_k,
                                                      schedule.plan_format(kv_format))
    bs = cache_seqlens.shape[0]
    return (cache_seqlens.new_empty(parts, schedule.METADATA_WIDTH, dtype=torch.int32),
            cache_seqlens.new_empty(bs + 1, dtype=torch.int32))


@torch.library.custom_op("pagedmla::cache_write", mutates_args=("buffer",))
def cache_write(buffer: torch.Tensor, out_cache_loc: torch.Tensor, latent: torch.Tensor) -> None:
    """Rows ``latent`` [T, D] into a 16-bit cache layer ``buffer`` [num_slots, 1, D] at slots ``out_cache_loc``
    int64 [T] (the backend's cache write, as ``MLAKVCache.write(validate=False)``: a slot outside the layer
    is dropped and sets ``errors.CACHE_SLOT``)."""
    rows.store_slots(buffer.view(-1, buffer.shape[-1]), out_cache_loc, latent.reshape(-1, buffer.shape[-1]))


@cache_write.register_fake
def _(buffer, out_cache_loc, latent):
    return None


@torch.library.custom_op("pagedmla::cache_gather", mutates_args=())
def cache_gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows [n, D] of a 16-bit cache layer ``buffer`` [num_slots, 1, D] at ``slots`` int64 [n] (the
    chunked-prefix form's prefix rows); a slot outside the layer gives a NaN row and sets ``errors.CACHE_SLOT``."""
    return rows.gather_slots(buffer.view(-1, buffer.shape[-1]), slots)


@cache_gather.register_fake
def _(buffer, slots):
    return buffer.new_empty(slots.shape[0], buffer.shape[-1])


@torch.library.custom_op("pagedmla::poison_bad_lengths", mutates_args=("out",))
def poison_bad_lengths(out: torch.Tensor, indptr: torch.Tensor, lens: torch.Tensor, planned: torch.Tensor,
                       capacity: int, max_rows: int) -> None:
    """``pagedmla.rows.poison_bad_lengths``: NaN rows of ``out`` [T, W] for the requests whose device length is
    bad for the plan (the backend's MHA forms)."""
    rows.poison_bad_lengths(out, indptr, lens, planned, capacity, max_rows)


@poison_bad_lengths.register_fake
def _(out, indptr, lens, planned, capacity, max_rows):
    return None
