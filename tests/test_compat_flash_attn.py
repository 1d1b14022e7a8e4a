"""pagedmla.flash_attn: FlashAttention 2's positional order, FA3's keywords, the +inf empty-row LSE,
unsupported features rejected by name, the paged / seqused_k convenience paths and the reference backward."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_attention_close, dense_varlen, gen

import pagedmla
from pagedmla import flash_attn

I32 = torch.int32


def packed(g, lens_q, lens_k, h=4, hk=2, d=32, dv=16, dtype=torch.float32):
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hk, dv, generator=g).to(dtype)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("causal", [False, True])
def test_fa2_positional_order_and_return_conventions(causal):
    g = gen("fa_pos", causal)
    lens_q, lens_k = [3, 5, 2], [7, 0, 1]  # an empty sequence; causal rows before the first key
    q, k, v, cu_q, cu_k = packed(g, lens_q, lens_k)
    # FA2: the 8th positional argument is dropout_p, the 9th softmax_scale.
    out, lse, s_dmask = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, 0.0, 0.3, causal, (-1, -1), 0.0,
                                                          None, True, True)
    assert s_dmask is None and tuple(lse.shape) == (4, 10) and lse.dtype == torch.float32
    ref_out, ref_lse = dense_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), 0.3, causal)
    empty = torch.isneginf(ref_lse.T)
    assert empty.any() and torch.isposinf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert_attention_close(out, lse.where(~empty, float("-inf")).T, ref_out, ref_lse, 1e-5)
    assert (out[empty.T] == 0).all()
    # Plain return, and FA3 / vLLM's return_softmax_lse pair.
    plain = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.3, causal=causal)
    pair = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.3, causal=causal,
                                             return_softmax_lse=True)
    assert torch.equal(plain, out) and torch.equal(pair[0], out) and torch.equal(pair[1], lse)
    # FA3 knobs that do not change the result are accepted.
    hinted = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.3, causal=causal,
                                               num_splits=0, pack_gqa=True, sm_margin=4, window_size=None)
    assert torch.equal(hinted, out)
    # The native call keeps -inf and its own positional order.
    n_out, n_lse, _ = pagedmla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, 0.3, causal, True)
    assert torch.equal(n_out, out) and torch.isneginf(n_lse[empty]).all()


def test_a_positional_dropout_is_not_read_as_the_scale():
    """The trap of issue 23: FA2 callers pass dropout_p positionally; 0.17 must be rejected, never used."""
    g = gen("fa_trap")
    q, k, v, cu_q, cu_k = packed(g, [4], [6])
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, 0.17)
    base = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, 0.0)
    ref_out, _ = dense_varlen(q, k, v, [0, 4], [0, 6], 32 ** -0.5, False)
    assert_attention_close(base, None, ref_out, None, 1e-5)


@pytest.mark.parametrize("name,kwargs", [
    ("dropout_p", {"dropout_p": 0.1}),
    ("window_size", {"window_size": (4, 0)}),
    ("window_size", {"window_size": (-1, 8)}),
    ("softcap", {"softcap": 30.0}),
    ("alibi_slopes", {"alibi_slopes": torch.zeros(4)}),
    ("seqused_q", {"seqused_q": torch.ones(1, dtype=I32)}),
    ("qv", {"qv": torch.zeros(4, 4, 8)}),
    ("q_descale", {"q_descale": torch.ones(1)}),
    ("attention_chunk", {"attention_chunk": 64}),
])
def test_unsupported_features_are_rejected_by_name(name, kwargs):
    g = gen("fa_reject", name)
    q, k, v, cu_q, cu_k = packed(g, [4], [6])
    with pytest.raises(ValueError, match=name):
        flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, **kwargs)


def test_block_table_and_seqused_k_paths():
    g = gen("fa_paged")
    lens_q, lens_k, page = [2, 1, 3], [9, 0, 20], 4
    q, k, v, cu_q, cu_k = packed(g, lens_q, lens_k)
    ref = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 20, causal=True, return_softmax_lse=True)
    # Paged: scatter each sequence's keys over shuffled pages of a [num_blocks, page, hk, d] cache.
    num_blocks = 15
    kc = torch.full((num_blocks, page, 2, 32), float("nan"))
    vc = torch.full((num_blocks, page, 2, 16), float("nan"))
    table = torch.randperm(num_blocks, generator=g).to(I32).reshape(3, 5)
    for b, L in enumerate(lens_k):
        for pos in range(L):
            row = int(cu_k[b]) + pos
            kc[table[b, pos // page], pos % page] = k[row]
            vc[table[b, pos // page], pos % page] = v[row]
    paged = flash_attn.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 20, causal=True, block_table=table,
                                              return_softmax_lse=True)
    assert torch.allclose(paged[0], ref[0], atol=1e-6) and torch.equal(torch.isposinf(paged[1]), torch.isposinf(ref[1]))
    used = torch.tensor(lens_k, dtype=I32)
    paged_used = flash_attn.flash_attn_varlen_func(q, kc, vc, cu_q, None, 3, 20, causal=True, block_table=table,
                                                   seqused_k=used)
    assert torch.allclose(paged_used, ref[0], atol=1e-6)
    # seqused_k on packed K/V: sequence b uses the first seqused_k[b] of its rows.
    short = torch.tensor([5, 0, 11], dtype=I32)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 20, causal=True, seqused_k=short)
    sel = torch.cat([torch.arange(int(cu_k[b]), int(cu_k[b]) + int(short[b])) for b in range(3)])
    cu_short = torch.tensor([0, 5, 5, 16], dtype=I32)
    expected = flash_attn.flash_attn_varlen_func(q, k[sel], v[sel], cu_q, cu_short, 3, 11, causal=True)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 20, block_table=table[:, :1])


def test_packed_variants_match_the_unpacked_call():
    g = gen("fa_packed")
    q, k, v, cu_q, cu_k = packed(g, [3, 4], [5, 6], h=4, hk=4, d=16, dv=16)
    ref = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, causal=True)
    kv = torch.stack([k, v], dim=1)
    assert torch.equal(flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 4, 6, causal=True), ref)
    qkv = torch.stack([q, q, q], dim=1)
    self_ref = flash_attn.flash_attn_varlen_func(q, q, q, cu_q, cu_q, 4, 4, causal=True)
    assert torch.equal(flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 4, causal=True), self_ref)
    with pytest.raises(ValueError, match="kv"):
        flash_attn.flash_attn_varlen_kvpacked_func(q, k, cu_q, cu_k, 4, 6)


def test_backward_matches_autograd_through_the_oracle():
    g = gen("fa_grad")
    q, k, v, cu_q, cu_k = packed(g, [3, 5], [4, 6], dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    # The oracle does not record gradients: a plain differentiable float64 attention per sequence instead.
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    parts = []
    for (q0, q1), (k0, k1) in zip(((0, 3), (3, 8)), ((0, 4), (4, 10))):
        kk, vv = ks[k0:k1].repeat_interleave(2, 1), vs[k0:k1].repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", qs[q0:q1], kk) * 32 ** -0.5
        n, L = q1 - q0, k1 - k0
        visible = torch.arange(L)[None, :] <= torch.arange(n)[:, None] + (L - n)
        p_attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num()
        parts.append(torch.einsum("hqk,khd->qhd", p_attn, vv))
    ref_out = torch.cat(parts)
    assert torch.allclose(out, ref_out, atol=1e-12)
    want = torch.autograd.grad(ref_out, (qs, ks, vs), grad)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10)
    with pytest.raises(ValueError, match="out"):
        flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, out=torch.empty_like(out))


def test_triton_provider_matches_torch(monkeypatch):
    g = gen("fa_triton")
    q, k, v, cu_q, cu_k = packed(g, [3, 0, 17], [5, 4, 17], h=4, hk=2, d=64, dv=64, dtype=torch.float16)
    res = {}
    for provider in ("torch", "triton"):
        monkeypatch.setenv("PAGEDMLA_PROVIDER", provider)
        res[provider] = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True,
                                                          return_softmax_lse=True)
    assert torch.allclose(res["triton"][0].float(), res["torch"][0].float(), atol=2e-3)
    assert torch.equal(torch.isposinf(res["triton"][1]), torch.isposinf(res["torch"][1]))
