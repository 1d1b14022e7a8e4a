"""pagedmla's public ops as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)``.

Dynamo cannot trace into the kernels (Triton launches, host-side checks, the reference's Python loops), so
each public op is registered under the ``pagedmla::`` namespace with a fake (meta) implementation that
gives the output shapes and dtypes, and with its mutations declared (``out=`` buffers, in-place merges,
cache writes). The public functions route here only while tracing: their first statement is
``if torch.compiler.is_dynamo_compiling(): return library.<op>(...)``, so an eager call never pays for the
dispatcher (a custom op's dispatch costs microseconds; ``is_dynamo_compiling()`` is a constant False outside
Dynamo, as cheap as an empty call: 81 ns against 186 ns for ``is_compiling()`` on the CI machine, which
also reads a flag). Dynamo tracing (``torch.compile``) takes the custom ops; ``torch.export`` in non-strict
mode does not. At run time a compiled graph calls these ops, whose real implementations are the eager
public functions. No backward is registered: compile for inference (``torch.no_grad``).

Argument checks run inside the real implementations (at run time), not while tracing. The backend's
forward paths trace through ``backend_forward_decode`` / ``backend_forward_extend`` below, which express
one planned step with these ops (cache write + attention, and the merge of the chunked-prefix form).
"""

from __future__ import annotations

import torch

# The implementations import the public modules late: those modules import this one for their hooks.


def _lse_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@torch.library.custom_op("pagedmla::flash_mla_with_kvcache", mutates_args=())
def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                           provider: str | None = None, k_scale: torch.Tensor | None = None,
                           is_fp8_kvcache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedmla.ops import attention

    out, lse = attention.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                tile_scheduler_metadata, num_splits, softmax_scale, causal,
                                                k_scale=k_scale, is_fp8_kvcache=is_fp8_kvcache, provider=provider)
    return out, lse


@flash_mla_with_kvcache.register_fake
def _(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale=None,
      causal=False, provider=None, k_scale=None, is_fp8_kvcache=False):
    b, s_q, h, _ = q.shape
    return q.new_empty(b, s_q, h, head_dim_v), q.new_empty(b, h, s_q, dtype=_lse_dtype(q))


@torch.library.custom_op("pagedmla::flash_mla_varlen_with_kvcache", mutates_args=())
def flash_mla_varlen_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                                  cache_seqlens: torch.Tensor, qo_indptr: torch.Tensor, head_dim_v: int,
                                  softmax_scale: float | None = None, causal: bool = True,
                                  max_q_len: int | None = None,
                                  provider: str | None = None, k_scale: torch.Tensor | None = None,
                                  is_fp8_kvcache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedmla.ops import attention

    out, lse = attention.flash_mla_varlen_with_kvcache(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v,
                                                       softmax_scale, causal, max_q_len=max_q_len, k_scale=k_scale,
                                                       is_fp8_kvcache=is_fp8_kvcache, provider=provider)
    return out, lse


@flash_mla_varlen_with_kvcache.register_fake
def _(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, softmax_scale=None, causal=True, max_q_len=None,
      provider=None, k_scale=None, is_fp8_kvcache=False):
    t, h, _ = q.shape
    return q.new_empty(t, h, head_dim_v), q.new_empty(t, h, dtype=_lse_dtype(q))


@torch.library.custom_op("pagedmla::varlen_attention", mutates_args=())
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None = None, causal: bool = False,
                     provider: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func returning (out [Tq, H, Dv], lse [H, Tq])."""
    from pagedmla.ops import attention

    out, lse, _ = attention.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   softmax_scale, causal, True, provider=provider)
    return out, lse


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
      provider=None):
    t, h, _ = q.shape
    return q.new_empty(t, h, v.shape[2]), q.new_empty(h, t, dtype=_lse_dtype(q))


@torch.library.custom_op("pagedmla::varlen_attention_out", mutates_args=("out",))
def varlen_attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor,
                         softmax_scale: float | None = None, causal: bool = False,
                         provider: str | None = None) -> torch.Tensor:
    """flash_attn_varlen_func writing ``out``; returns lse [H, Tq]."""
    from pagedmla.ops import attention

    _, lse, _ = attention.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 softmax_scale, causal, True, out=out, provider=provider)
    return lse


@varlen_attention_out.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, softmax_scale=None, causal=False,
      provider=None):
    t, h, _ = q.shape
    return q.new_empty(h, t, dtype=_lse_dtype(q))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, return_attn_probs=False, *, out=None, provider=None):
    """The traced form of ``pagedmla.flash_attn_varlen_func`` (same arguments and returns)."""
    if out is None:
        o, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                  causal, provider)
    else:
        lse = varlen_attention_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                                   softmax_scale, causal, provider)
        o = out
    return (o, lse, None) if return_attn_probs else o


@torch.library.custom_op("pagedmla::merge_state_out", mutates_args=("out", "out_lse"))
def merge_state_out(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, out: torch.Tensor,
                    out_lse: torch.Tensor, provider: str | None = None) -> None:
    """merge_state into ``out`` / ``out_lse`` (which may be v_a / s_a, as in the eager call)."""
    from pagedmla.ops import attention

    attention.merge_state(v_a, s_a, v_b, s_b, out, out_lse=out_lse, provider=provider)


@merge_state_out.register_fake
def _(v_a, s_a, v_b, s_b, out, out_lse, provider=None):
    return None


def merge_state(v_a, s_a, v_b, s_b, out=None, *, out_lse=None, provider=None):
    """The traced form of ``pagedmla.merge_state``: results always land in buffers (fresh ones when not
    given), declared as mutated."""
    if out is None:
        out = torch.empty_like(v_a)
    if out_lse is None:
        out_lse = torch.empty(s_a.shape, dtype=_lse_dtype(v_a), device=v_a.device)
    merge_state_out(v_a, s_a, v_b, s_b, out, out_lse, provider)
    return out, out_lse


@torch.library.custom_op("pagedmla::get_mla_metadata", mutates_args=())
def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_sm_parts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedmla.ops import schedule

    md, ns = schedule.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts=num_sm_parts)
    return md, ns


@get_mla_metadata.register_fake
def _(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts=None):
    from pagedmla.ops import schedule

    parts = num_sm_parts or schedule.num_sm_parts_for(cache_seqlens.device, num_q_tokens_per_head_k, num_heads_k)
    bs = cache_seqlens.shape[0]
    return (cache_seqlens.new_empty(parts, schedule.METADATA_WIDTH, dtype=torch.int32),
            cache_seqlens.new_empty(bs + 1, dtype=torch.int32))


@torch.library.custom_op("pagedmla::cache_write", mutates_args=("buffer",))
def cache_write(buffer: torch.Tensor, out_cache_loc: torch.Tensor, latent: torch.Tensor) -> None:
    """Rows ``latent`` [T, D] into ``buffer`` [num_slots, 1, D] at slots ``out_cache_loc`` int64 [T] (the
    backend's cache write; slots are the backend's own, unchecked as in ``MLAKVCache.write(validate=False)``)."""
    flat = buffer.view(-1, buffer.shape[-1])
    flat.index_copy_(0, out_cache_loc, latent.reshape(-1, buffer.shape[-1]).to(buffer.dtype))


@cache_write.register_fake
def _(buffer, out_cache_loc, latent):
    return None


def _provider_for(backend, op: str) -> str | None:
    from pagedmla.ops.providers import available_providers

    return backend.provider if backend.provider in available_providers(op) else None


def _save(backend, k, layer, out_cache_loc, cache, save_kv_cache: bool, latent=None) -> None:
    if save_kv_cache:
        from pagedmla.backend import _layer_id

        rows = k if latent is None else latent
        cache_write(cache.layer(_layer_id(layer)), out_cache_loc, rows.reshape(rows.shape[0], -1))


def _traced_meta(backend, cache):
    """The backend's planned step, for a traced forward (NotImplementedError for what tracing lacks)."""
    meta = backend._meta()
    if meta.dcp is not None:
        raise NotImplementedError("torch.compile: decode context parallelism (MLAConfig.dcp_size > 1) runs eagerly "
                                  "or as CUDA graphs, not traced")
    if cache.kv_format is not None:
        raise NotImplementedError(f"torch.compile: FP8 caches ({cache.kv_format}) run eagerly or as CUDA graphs, "
                                  "not traced")
    return meta


def backend_forward_decode(backend, q, k, v, layer, out_cache_loc, cache, bs: int, *, save_kv_cache: bool = True):
    """The traced form of ``MLABackend.forward_decode`` for DECODE / TARGET_VERIFY steps (DRAFT_EXTEND
    goes through ``backend_forward_extend``)."""
    from pagedmla.backend import ForwardMode, _layer_id

    meta = _traced_meta(backend, cache)
    if meta.bs == 0:
        return q.new_empty(0, backend.heads * backend.v_dim)
    if meta.mode == ForwardMode.DRAFT_EXTEND or not meta.uniform:  # a ragged verify runs the varlen kernel
        return backend_forward_extend(backend, q, k, v, layer, out_cache_loc, cache, save_kv_cache=save_kv_cache)
    _save(backend, k, layer, out_cache_loc, cache, save_kv_cache)
    out, _ = flash_mla_with_kvcache(q.view(bs, meta.q_len, backend.heads, backend.kv_dim),
                                    cache.paged_view(_layer_id(layer)), meta.block_table, meta.seq_lens,
                                    backend.v_dim, meta.tile_scheduler_metadata, meta.num_splits, backend.scale,
                                    True, backend.provider)
    return out.reshape(meta.num_tokens, backend.heads * backend.v_dim)


def backend_forward_extend(backend, q, k, v, layer, out_cache_loc, cache, *, save_kv_cache: bool = True,
                           latent=None, kv_decompress=None):
    """The traced form of ``MLABackend.forward_extend`` (absorbed, MHA and chunked-prefix forms)."""
    from pagedmla.backend import _layer_id

    meta = _traced_meta(backend, cache)
    if meta.bs == 0:
        return q.new_empty(0, backend.heads * backend.v_dim)
    lid = _layer_id(layer)
    if meta.form == "absorbed":
        _save(backend, k, layer, out_cache_loc, cache, save_kv_cache)
        out, _ = flash_mla_varlen_with_kvcache(q, cache.paged_view(lid), meta.block_table, meta.seq_lens,
                                               meta.qo_indptr, backend.v_dim, backend.scale, True, meta.max_q_len,
                                               _provider_for(backend, "paged_varlen"))
        return out.reshape(meta.num_tokens, backend.heads * backend.v_dim)
    if save_kv_cache and latent is None:
        raise ValueError("latent: the MHA forms need the latent rows to store")
    _save(backend, k, layer, out_cache_loc, cache, save_kv_cache, latent)
    varlen_provider = _provider_for(backend, "varlen")
    out, lse_ht = varlen_attention(q, k, v, meta.qo_indptr, meta.qo_indptr, meta.max_q_len, meta.max_q_len,
                                   backend.scale, True, varlen_provider)
    lse = lse_ht.transpose(0, 1)
    if meta.form == "chunked":
        if kv_decompress is None:
            raise ValueError("kv_decompress: the chunked-prefix form needs it to expand prefix rows")
        merge_provider = _provider_for(backend, "merge")
        for chunk in meta.prefix_chunks:
            rows = cache.layer(lid).view(-1, backend.kv_dim).index_select(0, chunk.slots)
            kc, vc = kv_decompress(rows)
            o2, l2 = varlen_attention(q, kc, vc, meta.qo_indptr, chunk.cu_seqlens, meta.max_q_len, chunk.max_len,
                                      backend.scale, False, varlen_provider)
            out, lse = merge_state(out, lse, o2, l2.transpose(0, 1), provider=merge_provider)
    return out.reshape(meta.num_tokens, -1)
