"""pagedmla.flashinfer: the MLA paged wrapper (page lists -> block table in plan, ckv/kpe views of one
576-wide buffer used without a copy, base-2 or natural LSE) and the ragged prefill wrapper."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_attention_close, dense_paged, dense_varlen, gen

from pagedmla import flashinfer

I32 = torch.int32


def mla_case(g, lens, q_lens, heads=4, page=4, dtype=torch.float32):
    pages = [-(-L // page) for L in lens]
    num_pages = sum(pages) + 2
    buf = torch.randn(num_pages, page, 576, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).to(I32)
    kv_indices = perm[: sum(pages)]
    kv_indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=I32)
    qo_indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=I32)
    q = torch.randn(sum(q_lens), heads, 576, generator=g).to(dtype)
    rows = []
    for b, L in enumerate(lens):
        ids = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        rows.append(buf[ids].reshape(-1, 576)[:L].double())
    return q, buf, qo_indptr, kv_indptr, kv_indices, torch.tensor(lens, dtype=I32), rows


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [2, 2, 2], [3, 1, 2]], ids=["decode", "verify", "varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_mla_wrapper_matches_the_oracle(q_lens, causal):
    g = gen("fi_mla", str(q_lens), causal)
    lens = [0, 9, 23]
    q, buf, qo, kvp, kvi, kvl, rows = mla_case(g, lens, q_lens)
    w = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8), backend="fa2")
    scale = 1 / math.sqrt(192)
    w.plan(qo, kvp, kvi, kvl, 4, 512, 64, 4, causal, scale, torch.float32, torch.float32)
    ckv, kpe = buf[..., :512], buf[..., 512:]
    out, lse2 = w.run(q[..., :512], q[..., 512:], ckv, kpe, return_lse=True)
    ref_out, ref_lse = dense_paged(q, qo.tolist(), rows, scale, causal, 512)
    assert_attention_close(out, lse2 / math.log2(math.e), ref_out, ref_lse, 1e-5)
    # Natural LSE when asked; pre-allocated outputs; a plain run returns only out.
    o_buf, l_buf = torch.empty_like(out), torch.empty_like(lse2)
    res = w.run(q[..., :512], q[..., 512:], ckv, kpe, out=o_buf, lse=l_buf, return_lse=True,
                return_lse_base_on_e=True)
    assert res[0] is o_buf and res[1] is l_buf and torch.equal(o_buf, out)
    assert torch.allclose(l_buf[torch.isfinite(l_buf)], (lse2 / math.log2(math.e))[torch.isfinite(lse2)])
    assert torch.equal(w.run(q[..., :512], q[..., 512:], ckv, kpe), out)
    # Separate (copied) buffers give the same result.
    sep = w.run(q[..., :512].clone(), q[..., 512:].clone(), ckv.clone(), kpe.clone())
    assert torch.equal(sep, out)


def test_mla_wrapper_reads_the_first_b_plus_1_kv_indptr_entries():
    """FlashInfer reads kv_indptr[0 .. b] only (its own tests pass a longer array); a shorter one is refused."""
    g = gen("fi_long_indptr")
    q, buf, qo, kvp, kvi, kvl, _ = mla_case(g, [7, 0, 13], [2, 1, 3])
    outs = []
    for indptr in (kvp, torch.cat([kvp, torch.tensor([int(kvp[-1]) + 5, 10 ** 6], dtype=I32)])):
        w = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8))
        w.plan(qo, indptr, kvi, kvl, 4, 512, 64, 4, True, 0.1, torch.float32, torch.float32)
        outs.append(w.run(q[..., :512], q[..., 512:], buf[..., :512], buf[..., 512:], return_lse=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    w = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8))
    with pytest.raises(ValueError, match="kv_indptr: expected at least 4 entries, got 3"):
        w.plan(qo, kvp[:3], kvi, kvl, 4, 512, 64, 4, True, 0.1, torch.float32, torch.float32)


def test_views_of_one_buffer_are_not_copied():
    buf = torch.randn(3, 4, 576)
    joined = flashinfer._joined(buf[..., :512], buf[..., 512:], "ckv_cache", "kpe_cache")
    assert joined.data_ptr() == buf.data_ptr() and joined.shape == buf.shape and torch.equal(joined, buf)
    copied = flashinfer._joined(buf[..., :512].clone(), buf[..., 512:].clone(), "ckv_cache", "kpe_cache")
    assert copied.data_ptr() != buf.data_ptr() and torch.equal(copied, buf)
    # A wider buffer's first 576 columns are views too; swapped blocks are not.
    wide = torch.randn(3, 4, 600)
    assert flashinfer._joined(wide[..., :512], wide[..., 512:576], "a", "b").data_ptr() == wide.data_ptr()
    swapped = flashinfer._joined(buf[..., 64:], buf[..., :64], "a", "b")
    assert swapped.data_ptr() != buf.data_ptr() and torch.equal(swapped, torch.cat([buf[..., 64:], buf[..., :64]], -1))


def test_mla_wrapper_rejects_what_it_lacks_by_name():
    g = gen("fi_reject")
    q, buf, qo, kvp, kvi, kvl, _ = mla_case(g, [5, 6], [1, 1])
    w = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8))
    with pytest.raises(ValueError, match="kv_data_type"):
        w.plan(qo, kvp, kvi, kvl, 4, 512, 64, 4, False, 0.1, torch.float32, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q[..., :512], q[..., 512:], buf[..., :512], buf[..., 512:])
    w.plan(qo, kvp, kvi, kvl, 4, 512, 64, 4, False, 0.1, torch.float32, torch.float32)
    for name in ("ckv_scale", "kpe_scale", "o_scale", "profiler_buffer", "page_table"):
        with pytest.raises(ValueError, match=name):
            w.run(q[..., :512], q[..., 512:], buf[..., :512], buf[..., 512:], **{name: 1.0})
    with pytest.raises(ValueError, match="q_nope"):
        w.run(q[..., :512].half(), q[..., 512:].half(), buf[..., :512], buf[..., 512:])
    with pytest.raises(ValueError, match="backend"):
        flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8), backend="cutlass")
    with pytest.raises(ValueError, match="kv_len_arr"):
        w.plan(qo, kvp, kvi, torch.tensor([5, 60], dtype=I32), 4, 512, 64, 4, False, 0.1, torch.float32,
               torch.float32)


def test_mla_wrapper_cuda_graph_mode_reuses_its_buffers():
    g = gen("fi_graph")
    q, buf, qo, kvp, kvi, kvl, rows = mla_case(g, [7, 13], [1, 1])
    w = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8), use_cuda_graph=True)
    w.plan(qo, kvp, kvi, kvl, 4, 512, 64, 4, False, 0.1, torch.float32, torch.float32)
    table, lens, md = w._block_table, w._seq_lens, w._metadata
    q2, buf2, qo2, kvp2, kvi2, kvl2, rows2 = mla_case(g, [3, 10], [1, 1])
    w.plan(qo2, kvp2, kvi2, kvl2, 4, 512, 64, 4, False, 0.1, torch.float32, torch.float32)
    assert w._block_table is table and w._seq_lens is lens and w._metadata is md
    out = w.run(q2[..., :512], q2[..., 512:], buf2[..., :512], buf2[..., 512:])
    ref, _ = dense_paged(q2, qo2.tolist(), rows2, 0.1, False, 512)
    assert_attention_close(out, None, ref, None, 1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_ragged_prefill_wrapper(causal):
    g = gen("fi_ragged", causal)
    q = torch.randn(8, 4, 48, generator=g)
    k = torch.randn(12, 2, 48, generator=g)
    v = torch.randn(12, 2, 32, generator=g)
    qo = torch.tensor([0, 3, 8], dtype=I32)
    kv = torch.tensor([0, 3, 12], dtype=I32)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8, dtype=torch.int8), "NHD", backend="fa2")
    w.plan(qo, kv, 4, 2, 48, head_dim_vo=32, causal=causal, sm_scale=0.2)
    out, lse2 = w.run_return_lse(q, k, v)
    ref_out, ref_lse = dense_varlen(q, k, v, qo.tolist(), kv.tolist(), 0.2, causal)
    assert tuple(lse2.shape) == (8, 4)
    assert_attention_close(out, lse2 / math.log2(math.e), ref_out, ref_lse, 1e-5)
    o_buf, l_buf = torch.empty_like(out), torch.empty_like(lse2)
    w.run(q, k, v, out=o_buf, lse=l_buf)
    assert torch.equal(o_buf, out) and torch.equal(l_buf, lse2)
    for name, kwargs in (("window_left", {"window_left": 16}), ("logits_soft_cap", {"logits_soft_cap": 30.0}),
                         ("pos_encoding_mode", {"pos_encoding_mode": "ROPE_LLAMA"}),
                         ("custom_mask", {"custom_mask": torch.ones(1, dtype=torch.bool)})):
        with pytest.raises(ValueError, match=name):
            w.plan(qo, kv, 4, 2, 48, **kwargs)
    with pytest.raises(ValueError, match="k_scale"):
        w.run(q, k, v, k_scale=2.0)
