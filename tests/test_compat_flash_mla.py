"""pagedmla.flash_mla: FlashMLA's 2025 and current decode signatures, its +inf empty-row LSE, its FP8 KV
format (``is_fp8_kvcache``), its unsupported features rejected by name. Checked against the float64 oracle
and the native API."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_attention_close, dense_paged, gen, make_paged_cache

import pagedmla
from pagedmla import flash_mla

POS_INF = float("inf")


def case(g, dtype, lens, q_len=2, heads=4, d=48, dv=32, page_size=16):
    cache = make_paged_cache(lens, page_size, d, dtype, generator=g)
    q = torch.randn(len(lens), q_len, heads, d, generator=g).to(dtype)
    return q, cache, torch.tensor(lens, dtype=torch.int32), dv


def oracle(q, cache, lens, dv, causal, scale=None):
    b, q_len, heads, d = q.shape
    out, lse = dense_paged(q.reshape(b * q_len, heads, d), [i * q_len for i in range(b + 1)], cache.rows,
                           d ** -0.5 if scale is None else scale, causal, dv)
    return out.reshape(b, q_len, heads, dv), lse.reshape(b, q_len, heads).transpose(1, 2)


@pytest.mark.parametrize("api", ["2025", "current"])
@pytest.mark.parametrize("causal", [False, True])
def test_both_signatures_match_the_oracle_with_flashmla_empty_rows(api, causal):
    g = gen("fm_compat", api, causal)
    # Length 0 (an empty request) and 1 with q_len 3 (two causal rows see no key).
    lens = [0, 1, 17, 40]
    q, cache, seqlens, dv = case(g, torch.float32, lens, q_len=3)
    if api == "2025":
        md, ns = flash_mla.get_mla_metadata(seqlens, 3 * 4, 1)
        out, lse = flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, md, ns,
                                                    causal=causal)
    else:
        meta, ns = flash_mla.get_mla_metadata()
        assert isinstance(meta, flash_mla.FlashMLASchedMeta) and ns is None and not meta.have_initialized
        out, lse = flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv,
                                                    tile_scheduler_metadata=meta, num_splits=None, causal=causal)
        assert meta.have_initialized and meta.config.b == 4 and meta.config.s_q == 3
    ref_out, ref_lse = oracle(q, cache, lens, dv, causal)
    empty = torch.isneginf(ref_lse)
    assert empty[0].all() and (empty[1].sum() == (8 if causal else 0))
    # FlashMLA's convention: +inf exactly where no key is seen; the native API's -inf elsewhere unchanged.
    assert torch.isposinf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert (out[empty.transpose(1, 2)] == 0).all()
    assert_attention_close(out, lse.where(~empty, float("-inf")), ref_out, ref_lse, 1e-5)
    native_md, native_ns = pagedmla.get_mla_metadata(seqlens, 3 * 4, 1)
    n_out, n_lse = pagedmla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, native_md,
                                                   native_ns, causal=causal)
    assert torch.equal(out, n_out) and torch.isneginf(n_lse[empty]).all()
    assert torch.equal(lse[~empty], n_lse[~empty])


def test_current_schedule_is_filled_once_and_checked():
    g = gen("fm_lazy")
    q, cache, seqlens, dv = case(g, torch.float32, [5, 30], q_len=1)
    meta, _ = flash_mla.get_mla_metadata()
    first = flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta, None,
                                             causal=True)
    md = meta.tile_scheduler_metadata
    second = flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta, None,
                                              causal=True)
    assert meta.tile_scheduler_metadata is md  # reused, not recomputed
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    with pytest.raises(ValueError, match="causal"):
        flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta, None, causal=False)
    with pytest.raises(ValueError, match="h_q"):
        flash_mla.flash_mla_with_kvcache(q[:, :, :2], cache.k_cache, cache.block_table, seqlens, dv, meta, None,
                                         causal=True)
    with pytest.raises(ValueError, match="num_splits"):
        flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta,
                                         torch.zeros(3, dtype=torch.int32), causal=True)


def test_bad_metadata_is_rejected_by_name():
    g = gen("fm_bad")
    q, cache, seqlens, dv = case(g, torch.float32, [5, 30], q_len=1)
    md, _ = flash_mla.get_mla_metadata(seqlens, 4, 1)
    with pytest.raises(ValueError, match="num_splits"):
        flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, md, None)
    with pytest.raises(TypeError, match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, "meta", None)
    with pytest.raises(TypeError, match="get_mla_metadata"):
        flash_mla.get_mla_metadata(seqlens)
    with pytest.raises(ValueError, match="q:"):
        flash_mla.flash_mla_with_kvcache(q[0], cache.k_cache, cache.block_table, seqlens, dv,
                                         flash_mla.get_mla_metadata()[0], None)
    with pytest.raises(ValueError, match="block_table"):
        flash_mla.flash_mla_with_kvcache(q, cache.k_cache, None, seqlens, dv, flash_mla.get_mla_metadata()[0], None)
    # Several KV heads: MLA keeps one latent head; the native check names k_cache.
    kc2 = cache.k_cache.expand(-1, -1, 2, -1).contiguous()
    with pytest.raises(ValueError, match="k_cache"):
        flash_mla.flash_mla_with_kvcache(q, kc2, cache.block_table, seqlens, dv, flash_mla.get_mla_metadata()[0], None)


@pytest.mark.parametrize("name,value", [
    ("indices", torch.zeros(2, 1, 8, dtype=torch.int32)),
    ("attn_sink", torch.zeros(4)),
    ("extra_k_cache", torch.zeros(1, 16, 1, 48)),
    ("extra_indices_in_kvcache", torch.zeros(2, 1, 8, dtype=torch.int32)),
    ("topk_length", torch.zeros(2, dtype=torch.int32)),
    ("extra_topk_length", torch.zeros(2, dtype=torch.int32)),
])
def test_unsupported_features_are_named(name, value):
    g = gen("fm_unsupported", name)
    q, cache, seqlens, dv = case(g, torch.float32, [5, 30], q_len=1)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(NotImplementedError, match=name):
        flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta, None,
                                         **{name: value})
    assert not meta.have_initialized
    with pytest.raises(NotImplementedError, match="topk"):
        flash_mla.get_mla_metadata(seqlens, 4, 1, topk=64)


def test_triton_provider_matches_torch(monkeypatch):
    """The compat layer on the Triton kernels (interpreter on CPU, fp16): same results as on torch."""
    g = gen("fm_triton")
    q, cache, seqlens, dv = case(g, torch.float16, [0, 3, 70], q_len=2, d=48, dv=32)
    results = {}
    for provider in ("torch", "triton"):
        monkeypatch.setenv("PAGEDMLA_PROVIDER", provider)
        meta, _ = flash_mla.get_mla_metadata()
        results[provider] = flash_mla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta,
                                                             None, causal=True)
    (o_t, l_t), (o_k, l_k) = results["torch"], results["triton"]
    assert torch.isposinf(l_k[0]).all() and torch.equal(torch.isposinf(l_k), torch.isposinf(l_t))
    finite = torch.isfinite(l_t)
    assert torch.allclose(o_k.float(), o_t.float(), atol=2e-3) and torch.allclose(l_k[finite], l_t[finite], atol=1e-3)


@pytest.mark.parametrize("api", ["2025", "current"])
def test_fp8_kvcache_reads_flashmla_layout(api):
    """is_fp8_kvcache=True reads FlashMLA's FP8 KV rows as its quantiser lays them out: 656 bytes typed
    float8_e4m3fn, pages strided by page_size + 1 rows (it allocates one spare row per block and slices it off)."""
    g = gen("fm_fp8", api)
    lens, page = [0, 5, 70], 16
    dense = make_paged_cache(lens, page, 576, generator=g, kv_format="fp8_ds_mla",
                             encode=lambda rows: pagedmla.quantize_latent(rows, "fp8_ds_mla"))
    padded = torch.zeros(dense.k_cache.shape[0], page + 1, 1, 656, dtype=torch.float8_e4m3fn)[:, :page]
    padded.view(torch.uint8).copy_(dense.k_cache)
    assert not padded.is_contiguous()
    q = torch.randn(len(lens), 2, 4, 576, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    if api == "2025":
        md, ns = flash_mla.get_mla_metadata(seqlens, 2 * 4, 1, 4, True)
    else:
        md, ns = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, padded, dense.block_table, seqlens, 512, md, ns, causal=True,
                                                is_fp8_kvcache=True)
    ref_out, ref_lse = oracle(q, dense, lens, 512, True)
    empty = torch.isneginf(ref_lse)
    assert torch.isposinf(lse[empty]).all()
    assert_attention_close(out, lse.where(~empty, float("-inf")), ref_out, ref_lse, 1e-5)
    if api == "current":
        assert md.config.is_fp8_kvcache
