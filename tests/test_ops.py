"""Every public op against the independent dense float64 oracle (tests/oracle.py), on the torch provider.

Inputs are fresh ``torch.randn`` draws from a generator seeded per test case; paged caches have their
pages randomly permuted and every slot a request does not own (page 0, spare pages, tails of last pages)
set to NaN, so a read outside a request's tokens shows up as NaN in the result.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from oracle import (
    TOLERANCES,
    assert_attention_close,
    dense_absorbed,
    dense_merge,
    dense_mha,
    dense_paged,
    dense_varlen,
    gen,
    make_paged_cache,
)

import pagedmla
from pagedmla import split_plan
from pagedmla.ops import providers
from pagedmla.ops import schedule as ops_schedule

F32, F64 = torch.float32, torch.float64


def randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform int in lo..hi inclusive."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return F64 if dtype == F64 else F32


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN where the other has NaN."""
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


def special_lens(page_size: int, g: torch.Generator) -> list[int]:
    """The lengths the acceptance criteria name, plus two random ones."""
    return [1, page_size - 1, page_size, page_size + 1, 0, randint(g, 1, 3 * page_size + 5), randint(g, 2, 70)]


# ----------------------------------------------------------------------------------------------------
# The oracle itself, on cases with a closed form
# ----------------------------------------------------------------------------------------------------

def test_oracle_closed_forms():
    g = gen("oracle")
    q = torch.randn(3, 2, 8, generator=g, dtype=F64)
    kv = torch.randn(5, 8, generator=g, dtype=F64)
    out, lse = dense_absorbed(q, kv[:1], 0.5, False, 6)
    torch.testing.assert_close(out, kv[0, :6].expand(3, 2, 6), rtol=0, atol=1e-15)
    torch.testing.assert_close(lse, (q @ kv[0]) * 0.5, rtol=0, atol=1e-14)
    # Identical keys: uniform weights, lse = score + ln L; causal bottom-right: query i sees 5 - 3 + i + 1 keys.
    same_k = kv[:1].expand(5, 8)
    out, lse = dense_absorbed(q, same_k, 0.5, True, 8)
    for i in range(3):
        torch.testing.assert_close(lse[i], (q[i] @ kv[0]) * 0.5 + math.log(3 + i), rtol=0, atol=1e-14)
    # More queries than keys: the first ones see nothing.
    out, lse = dense_absorbed(q, kv[:2], 0.5, True, 8)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all() and torch.isfinite(lse[1:]).all()
    # GQA: two q heads sharing KV head 0 with equal queries give equal outputs.
    qm = torch.randn(2, 1, 4, generator=g, dtype=F64).expand(2, 2, 4)
    o, _ = dense_mha(qm, torch.randn(3, 1, 4, generator=g, dtype=F64), torch.randn(3, 1, 5, generator=g, dtype=F64),
                     1.0, False)
    assert torch.equal(o[:, 0], o[:, 1])
    # Merge of two halves of the same softmax.
    v, s = dense_merge(torch.ones(1, 1, 2, dtype=F64), torch.tensor([[0.0]], dtype=F64),
                       3 * torch.ones(1, 1, 2, dtype=F64), torch.tensor([[math.log(3.0)]], dtype=F64))
    torch.testing.assert_close(v, torch.full((1, 1, 2), 2.5, dtype=F64))
    torch.testing.assert_close(s, torch.tensor([[math.log(4.0)]], dtype=F64))


# ----------------------------------------------------------------------------------------------------
# flash_mla_with_kvcache
# ----------------------------------------------------------------------------------------------------

def run_flash_mla(dtype, page_size, heads, q_len, causal, scale, D, dv, key):
    g = gen("flash_mla", key)
    lens = special_lens(page_size, g)
    cache = make_paged_cache(lens, page_size, D, dtype, extra_pages=2, generator=g)
    b = len(lens)
    q = torch.randn(b, q_len, heads, D, generator=g, dtype=F64).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(seqlens, q_len * heads, 1)
    k_before = cache.k_cache.clone()
    out, lse = pagedmla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, dv, meta, splits,
                                               softmax_scale=scale, causal=causal, provider="torch")
    assert out.dtype == dtype and lse.dtype == lse_dtype(dtype)
    assert tuple(out.shape) == (b, q_len, heads, dv) and tuple(lse.shape) == (b, heads, q_len)
    assert same(cache.k_cache, k_before)  # inputs untouched

    eff_scale = D ** -0.5 if scale is None else scale
    qo = [i * q_len for i in range(b + 1)]
    ref_out, ref_lse = dense_paged(q.reshape(b * q_len, heads, D), qo, cache.rows, eff_scale, causal, dv)
    ref_out = ref_out.reshape(b, q_len, heads, dv)
    ref_lse = ref_lse.reshape(b, q_len, heads).transpose(1, 2)
    assert_attention_close(out, lse, ref_out, ref_lse, TOLERANCES[dtype], f"lens={lens}")
    # The zero-length request must come back empty whatever the mask.
    assert torch.isneginf(lse[4]).all() and (out[4] == 0).all()


@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [1, 3, 16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_flash_mla_with_kvcache_small_dim(dtype, page_size, heads, q_len, causal, scale):
    run_flash_mla(dtype, page_size, heads, q_len, causal, scale, 40, 32,
                  (dtype, page_size, heads, q_len, causal, scale))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,q_len,scale", [(1, 4, None), (7, 3, 0.05), (16, 2, None), (128, 1, 0.1),
                                                (128, 4, None)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_flash_mla_with_kvcache_deepseek_dims(dtype, page_size, heads, q_len, scale, causal):
    run_flash_mla(dtype, page_size, heads, q_len, causal, scale, 576, 512,
                  ("ds", dtype, page_size, heads, q_len, causal, scale))


def test_flash_mla_with_kvcache_default_scale_is_d_to_minus_half():
    """Default scale must be D ** -0.5 exactly: compare against an explicit call and against a wrong one."""
    g = gen("default_scale")
    cache = make_paged_cache([37, 5], 16, 576, F64, generator=g)
    q = torch.randn(2, 2, 4, 576, generator=g, dtype=F64)
    lens = torch.tensor([37, 5], dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(lens, 8, 1)
    args = (q, cache.k_cache, cache.block_table, lens, 512, meta, splits)
    default = pagedmla.flash_mla_with_kvcache(*args, causal=True, provider="torch")
    explicit = pagedmla.flash_mla_with_kvcache(*args, softmax_scale=576 ** -0.5, causal=True, provider="torch")
    other = pagedmla.flash_mla_with_kvcache(*args, softmax_scale=512 ** -0.5, causal=True, provider="torch")
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    assert not torch.allclose(default[1], other[1])


def test_flash_mla_with_kvcache_uses_only_the_first_pages_of_a_wide_block_table():
    """A block table much wider than needed, filled with poisoned ids past each request's pages."""
    g = gen("wide_table")
    lens = [3, 64, 65]
    cache = make_paged_cache(lens, 16, 64, F64, max_pages=32, extra_pages=5, generator=g)
    q = torch.randn(3, 1, 2, 64, generator=g, dtype=F64)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(seqlens, 2, 1)
    out, lse = pagedmla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, 48, meta, splits,
                                               causal=True, provider="torch")
    ref_out, ref_lse = dense_paged(q.reshape(3, 2, 64), [0, 1, 2, 3], cache.rows, 64 ** -0.5, True, 48)
    assert_attention_close(out.reshape(3, 2, 48), lse.reshape(3, 2), ref_out, ref_lse, 1e-10)


# ----------------------------------------------------------------------------------------------------
# flash_mla_varlen_with_kvcache
# ----------------------------------------------------------------------------------------------------

def run_flash_mla_varlen(dtype, page_size, heads, causal, D, dv, pass_max, key):
    g = gen("varlen_paged", key)
    # (kv_len, q_len): q longer than kv, empty q, empty kv with queries, a full prefill, random.
    pairs = [(1, 3), (page_size - 1, 1), (page_size, 0), (page_size + 1, 4), (0, 2),
             (randint(g, 1, 2 * page_size + 3), randint(g, 0, 6)), (7, 7), (3, 5), (randint(g, 5, 90), 2)]
    pairs = [(kv, min(q, kv + 3)) if kv == page_size - 1 else (kv, q) for kv, q in pairs]
    lens = [kv for kv, _ in pairs]
    qls = [q for _, q in pairs]
    qo = [0]
    for n in qls:
        qo.append(qo[-1] + n)
    cache = make_paged_cache(lens, page_size, D, dtype, generator=g)
    q = torch.randn(qo[-1], heads, D, generator=g, dtype=F64).to(dtype)
    scale = 0.21 if heads % 2 else None
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(
        q, cache.k_cache, cache.block_table, torch.tensor(lens, dtype=torch.int32),
        torch.tensor(qo, dtype=torch.int32), dv, softmax_scale=scale, causal=causal,
        max_q_len=max(qls) if pass_max else None, provider="torch")
    assert out.dtype == dtype and lse.dtype == lse_dtype(dtype)
    ref_out, ref_lse = dense_paged(q, qo, cache.rows, D ** -0.5 if scale is None else scale, causal, dv)
    assert_attention_close(out, lse, ref_out, ref_lse, TOLERANCES[dtype], f"pairs={pairs}")
    # Request 0 has 3 queries over 1 key: bottom-right causal leaves its first two queries empty.
    if causal:
        assert torch.isneginf(lse[0:2]).all() and torch.isfinite(lse[2]).all()
    else:
        assert torch.isfinite(lse[0:3]).all()


@pytest.mark.parametrize("pass_max", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [1, 3, 16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_flash_mla_varlen_small_dim(dtype, page_size, heads, causal, pass_max):
    run_flash_mla_varlen(dtype, page_size, heads, causal, 40, 32, pass_max,
                         (dtype, page_size, heads, causal, pass_max))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [1, 7, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_flash_mla_varlen_deepseek_dims(dtype, page_size, heads, causal):
    run_flash_mla_varlen(dtype, page_size, heads, causal, 576, 512, True, ("ds", dtype, page_size, heads, causal))


@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_flash_mla_varlen_equals_uniform_call(q_len):
    """With equal q lengths the varlen call and the FlashMLA call are the same computation."""
    g = gen("varlen_vs_uniform", q_len)
    lens = [q_len + 5, 70, q_len]
    cache = make_paged_cache(lens, 16, 72, F64, generator=g)
    q = torch.randn(3, q_len, 5, 72, generator=g, dtype=F64)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(seqlens, q_len * 5, 1)
    out_u, lse_u = pagedmla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, 64, meta, splits,
                                                   causal=True, provider="torch")
    qo = torch.arange(0, 4 * q_len, q_len, dtype=torch.int32)
    out_v, lse_v = pagedmla.flash_mla_varlen_with_kvcache(q.reshape(-1, 5, 72), cache.k_cache, cache.block_table,
                                                          seqlens, qo, 64, causal=True, provider="torch")
    torch.testing.assert_close(out_v.reshape(3, q_len, 5, 64), out_u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_v.reshape(3, q_len, 5).transpose(1, 2), lse_u, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# flash_attn_varlen_func
# ----------------------------------------------------------------------------------------------------

VARLEN_PAIRS = [(0, 0), (0, 5), (3, 0), (1, 1), (1, 7), (4, 9), (6, 3), (9, 2), (13, 13)]


@pytest.mark.parametrize("mode", ["out", "lse", "out_arg"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (8, 1), (3, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_flash_attn_varlen_func(dtype, heads, kv_heads, causal, mode):
    g = gen("varlen", dtype, heads, kv_heads, causal, mode)
    pairs = VARLEN_PAIRS + [(randint(g, 0, 20), randint(g, 0, 20)) for _ in range(3)]
    perm = torch.randperm(len(pairs), generator=g).tolist()
    pairs = [pairs[i] for i in perm]
    cu_q, cu_k = [0], [0]
    for lq, lk in pairs:
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    q = torch.randn(cu_q[-1], heads, 192, generator=g, dtype=F64).to(dtype)
    k = torch.randn(cu_k[-1], kv_heads, 192, generator=g, dtype=F64).to(dtype)
    v = torch.randn(cu_k[-1], kv_heads, 128, generator=g, dtype=F64).to(dtype)
    scale = None if causal else 0.09
    kwargs = dict(softmax_scale=scale, causal=causal, provider="torch")
    args = (q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
            max(lq for lq, _ in pairs), max(lk for _, lk in pairs))
    ref_out, ref_lse = dense_varlen(q, k, v, cu_q, cu_k, 192 ** -0.5 if scale is None else scale, causal)
    if mode == "out":
        out = pagedmla.flash_attn_varlen_func(*args, **kwargs)
        assert isinstance(out, torch.Tensor)
        assert_attention_close(out, None, ref_out, None, TOLERANCES[dtype], f"pairs={pairs}")
    elif mode == "lse":
        res = pagedmla.flash_attn_varlen_func(*args, return_attn_probs=True, **kwargs)
        assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
        out, lse = res[0], res[1]
        assert lse.dtype == lse_dtype(dtype) and tuple(lse.shape) == (heads, cu_q[-1])
        assert_attention_close(out, lse, ref_out, ref_lse.T, TOLERANCES[dtype], f"pairs={pairs}")
    else:
        buf = torch.randn(cu_q[-1], heads, 128, generator=g, dtype=F64).to(dtype)
        res = pagedmla.flash_attn_varlen_func(*args, return_attn_probs=True, out=buf, **kwargs)
        assert res[0] is buf or res[0].data_ptr() == buf.data_ptr()
        assert_attention_close(buf, res[1], ref_out, ref_lse.T, TOLERANCES[dtype], f"pairs={pairs}")
        out = buf
    assert out.dtype == dtype


def test_flash_attn_varlen_gqa_maps_head_to_group():
    """Each q head must use KV head h // (H // Hk): swapping two KV heads must move the right q heads."""
    g = gen("gqa_map")
    q = torch.randn(6, 8, 32, generator=g, dtype=F64)
    k = torch.randn(6, 2, 32, generator=g, dtype=F64)
    v = torch.randn(6, 2, 16, generator=g, dtype=F64)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out = pagedmla.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, provider="torch")
    ref, _ = dense_varlen(q, k, v, [0, 6], [0, 6], 32 ** -0.5, True)
    assert_attention_close(out, None, ref, None, 1e-10)
    swapped = pagedmla.flash_attn_varlen_func(q, k.flip(1), v.flip(1), cu, cu, 6, 6, causal=True, provider="torch")
    assert not torch.allclose(swapped[:, :4], out[:, :4])


# ----------------------------------------------------------------------------------------------------
# merge_state
# ----------------------------------------------------------------------------------------------------

def test_merge_state_equals_attention_over_the_union():
    """Splitting a request's keys in two, attending to each part and merging must equal attending to all."""
    g = gen("merge_union")
    q = torch.randn(5, 4, 48, generator=g, dtype=F64)
    k = torch.randn(23, 4, 48, generator=g, dtype=F64)
    v = torch.randn(23, 4, 32, generator=g, dtype=F64)
    full, full_lse = dense_varlen(q, k, v, [0, 5], [0, 23], 0.2, False)
    cu_q = torch.tensor([0, 5], dtype=torch.int32)
    oa, la, _ = pagedmla.flash_attn_varlen_func(q, k[:9], v[:9], cu_q, torch.tensor([0, 9], dtype=torch.int32), 5, 9,
                                                softmax_scale=0.2, return_attn_probs=True, provider="torch")
    ob, lb, _ = pagedmla.flash_attn_varlen_func(q, k[9:], v[9:], cu_q, torch.tensor([0, 14], dtype=torch.int32), 5,
                                                14, softmax_scale=0.2, return_attn_probs=True, provider="torch")
    v_m, s_m = pagedmla.merge_state(oa, la.T.contiguous(), ob, lb.T.contiguous(), provider="torch")
    assert_attention_close(v_m, s_m, full, full_lse, 1e-10)


# ----------------------------------------------------------------------------------------------------
# Zero-length batches
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_zero_length_batches(dtype):
    D, dv, H = 40, 32, 3
    kc = torch.randn(4, 16, 1, D, dtype=F64).to(dtype)
    # flash_mla_with_kvcache, b = 0
    lens0 = torch.zeros(0, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(lens0, 2 * H, 1)
    assert tuple(splits.shape) == (1,) and int(splits[0]) == 0
    out, lse = pagedmla.flash_mla_with_kvcache(torch.randn(0, 2, H, D, dtype=F64).to(dtype), kc,
                                               torch.zeros(0, 3, dtype=torch.int32), lens0, dv, meta, splits,
                                               causal=True, provider="torch")
    assert tuple(out.shape) == (0, 2, H, dv) and tuple(lse.shape) == (0, H, 2) and out.dtype == dtype
    # flash_mla_varlen_with_kvcache, b = 0 and T = 0 with requests that have KV but no queries
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(torch.randn(0, H, D, dtype=F64).to(dtype), kc,
                                                      torch.zeros(0, 3, dtype=torch.int32), lens0,
                                                      torch.zeros(1, dtype=torch.int32), dv, provider="torch")
    assert tuple(out.shape) == (0, H, dv) and tuple(lse.shape) == (0, H)
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(torch.randn(0, H, D, dtype=F64).to(dtype), kc,
                                                      torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                                                      torch.tensor([20, 5], dtype=torch.int32),
                                                      torch.zeros(3, dtype=torch.int32), dv, max_q_len=0,
                                                      provider="torch")
    assert tuple(out.shape) == (0, H, dv) and tuple(lse.shape) == (0, H)
    # flash_attn_varlen_func: b = 0; T = 0 with b = 2; q empty but k not
    for cu_q, cu_k, tk in (([0], [0], 0), ([0, 0, 0], [0, 0, 0], 0), ([0, 0, 0], [0, 4, 6], 6)):
        q = torch.randn(0, 4, 24, dtype=F64).to(dtype)
        k = torch.randn(tk, 2, 24, dtype=F64).to(dtype)
        v = torch.randn(tk, 2, 16, dtype=F64).to(dtype)
        o, s, _ = pagedmla.flash_attn_varlen_func(q, k, v, torch.tensor(cu_q, dtype=torch.int32),
                                                  torch.tensor(cu_k, dtype=torch.int32), 0, 4, causal=True,
                                                  return_attn_probs=True, provider="torch")
        assert tuple(o.shape) == (0, 4, 16) and tuple(s.shape) == (4, 0)
    # k empty but q not: every row is empty
    q = torch.randn(3, 4, 24, dtype=F64).to(dtype)
    o, s, _ = pagedmla.flash_attn_varlen_func(q, torch.randn(0, 2, 24, dtype=dtype), torch.randn(0, 2, 16, dtype=dtype),
                                              torch.tensor([0, 3], dtype=torch.int32),
                                              torch.tensor([0, 0], dtype=torch.int32), 3, 0, return_attn_probs=True,
                                              provider="torch")
    assert (o == 0).all() and torch.isneginf(s).all()
    # merge_state, T = 0
    v, s = pagedmla.merge_state(torch.randn(0, H, 8, dtype=dtype), torch.randn(0, H), torch.randn(0, H, 8, dtype=dtype),
                                torch.randn(0, H), provider="torch")
    assert tuple(v.shape) == (0, H, 8) and tuple(s.shape) == (0, H)


# ----------------------------------------------------------------------------------------------------
# get_mla_metadata
# ----------------------------------------------------------------------------------------------------

def enumerate_schedule(meta: torch.Tensor, splits: torch.Tensor, lens: list[int]):
    """Host-side walk over the documented metadata rows: returns {(req, block): part} and, per request,
    the list of split indices its pieces were given, in part order. Asserts each KV block is seen once."""
    nblocks = [-(-max(0, x) // split_plan.BLOCK_N) for x in lens]
    seen: dict[tuple[int, int], int] = {}
    pieces: dict[int, list[int]] = {b: [] for b in range(len(lens))}
    # Row 0 carries the fingerprint of the block counts and splits (what the decode kernels verify).
    want = [int(f) for f in split_plan.fingerprint(torch.tensor(nblocks, dtype=torch.int64), splits.cpu(),
                                                  meta.shape[0])]
    for p, row in enumerate(meta.tolist()):
        begin_req, begin_block, end_req, end_block, begin_split = row[:5]
        reserved = [0] * (len(row) - 5) if p else want + [0] * (len(row) - 7)
        assert row[5:] == reserved, f"part {p}: reserved columns {row[5:]}, expected {reserved}"
        if begin_req > end_req:
            continue  # idle part
        assert 0 <= begin_req and end_req < len(lens), f"part {p}: requests {begin_req}..{end_req} out of range"
        for r in range(begin_req, end_req + 1):
            lo = begin_block if r == begin_req else 0
            hi = end_block if r == end_req else nblocks[r]
            assert 0 <= lo and hi <= nblocks[r], f"part {p}: request {r} blocks {lo}..{hi} of {nblocks[r]}"
            if lo >= hi:
                continue
            for blk in range(lo, hi):
                assert (r, blk) not in seen, f"block {blk} of request {r} in parts {seen[(r, blk)]} and {p}"
                seen[(r, blk)] = p
            pieces[r].append(begin_split if r == begin_req else 0)
    for r, n in enumerate(nblocks):
        for blk in range(n):
            assert (r, blk) in seen, f"block {blk} of request {r} (len {lens[r]}) is in no part"
    return seen, pieces


def check_metadata(lens: list[int], parts: int | None, q_tokens: int = 16):
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(seqlens, q_tokens, 1, num_sm_parts=parts)
    assert meta.dtype == torch.int32 and splits.dtype == torch.int32
    assert meta.device == seqlens.device and splits.device == seqlens.device
    assert meta.dim() == 2 and meta.shape[1] == split_plan.METADATA_WIDTH
    if parts is not None:
        assert meta.shape[0] == parts
    assert tuple(splits.shape) == (len(lens) + 1,) and int(splits[0]) == 0
    counts = (splits[1:] - splits[:-1]).tolist()
    assert all(c >= 0 for c in counts)
    assert int(splits[-1]) <= len(lens) + meta.shape[0] - 1, "more pieces than requests + parts - 1"
    _, pieces = enumerate_schedule(meta, splits, lens)
    for r, got in pieces.items():
        # Request r's pieces are numbered 0, 1, ... in part order and there are num_splits[r+1]-num_splits[r].
        assert got == list(range(len(got))), f"request {r}: split indices {got} (lens={lens}, parts={parts})"
        assert counts[r] == len(got), f"request {r}: num_splits says {counts[r]} pieces, metadata has {len(got)}"
        if lens[r] <= 0:
            assert counts[r] == 0


@pytest.mark.parametrize("seed", range(12))
def test_get_mla_metadata_covers_every_block_once(seed):
    g = gen("metadata", seed)
    bs = randint(g, 1, 12)
    choices = [0, 1, 63, 64, 65, 128, 129, 1000, 4097]
    lens = [choices[randint(g, 0, len(choices) - 1)] if randint(g, 0, 1) else randint(g, 0, 3000) for _ in range(bs)]
    if seed % 4 == 0:
        lens[randint(g, 0, bs - 1)] = 0
    for parts in range(1, 141):
        check_metadata(lens, parts)
    check_metadata(lens, None)
    check_metadata(lens, None, q_tokens=128 * 4)


@pytest.mark.parametrize("seed", range(6))
def test_get_mla_metadata_covers_every_block_once_wide_batches(seed):
    """Up to 40 requests, 16 or 128 q rows, part counts from 1 to beyond the SM count."""
    rng = random.Random(seed)
    for _ in range(8):
        b = rng.randint(1, 40)
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000)]) for _ in range(b)]
        for parts, rows in itertools.product((1, 2, 3, 7, 33, 66, 132, 200), (16, 128)):
            check_metadata(lens, parts, q_tokens=rows)


@pytest.mark.parametrize("lens", [[0], [0, 0, 0], [1], [64], [65], [64 * 37], [0, 5000, 0], [1] * 40])
def test_get_mla_metadata_edge_batches(lens):
    for parts in (1, 2, 3, 7, 64, 132, 140):
        check_metadata(lens, parts)


def test_get_mla_metadata_empty_batch():
    meta, splits = pagedmla.get_mla_metadata(torch.zeros(0, dtype=torch.int32), 16, 1, num_sm_parts=5)
    assert meta.dtype == torch.int32 and tuple(meta.shape) == (5, split_plan.METADATA_WIDTH)
    assert splits.tolist() == [0]
    assert all(r[0] > r[2] for r in meta.tolist())  # every part idle


def test_get_mla_metadata_splits_long_request_across_parts():
    """A long single request and many parts must actually be split, and balanced: no part carries more than
    its share of the request's units (its blocks plus the fixed cost, which the first part pays)."""
    for rows in (16, 128):
        meta, splits = pagedmla.get_mla_metadata(torch.tensor([64 * 100], dtype=torch.int32), rows, 1,
                                                 num_sm_parts=10)
        assert int(splits[1]) >= 9
        seen, _ = enumerate_schedule(meta, splits, [6400])
        per_part = [sum(1 for p in seen.values() if p == i) for i in range(10)]
        overhead = split_plan.overhead_blocks(rows)
        share = -(-(100 + overhead) // 10)
        assert sum(per_part) == 100 and max(per_part[0] + overhead, *per_part[1:]) <= share, per_part


def test_min_part_units_is_an_exact_integer_square_root():
    n = torch.arange(0, 20000, dtype=torch.int64)
    k = split_plan.min_part_units(n)
    assert (k >= 1).all() and (k * k * split_plan.PIECE_COST_RATIO >= n).all()
    assert ((k - 1) * (k - 1) * split_plan.PIECE_COST_RATIO < n)[1:].all(), "not the smallest such k"
    assert split_plan.min_part_units(torch.tensor(100)).item() == 4


def test_default_schedule_gives_parts_a_minimum_length():
    """The default plan's parts are at least min_part_units(longest request's blocks) long, so one request
    over many parts has few pieces; an explicit part count cuts the work as finely as asked; both cover every
    block once."""
    lens = torch.tensor([6400], dtype=torch.int32)  # 100 KV blocks after 3 units of fixed cost: units 3 .. 102
    parts, rows = 132, 128
    for default_plan, per_part in ((True, 4), (False, 1)):
        meta = torch.empty(parts, 8, dtype=torch.int32)
        splits = torch.empty(2, dtype=torch.int32)
        ops_schedule.schedule_into(lens, meta, splits, rows, default_plan=default_plan)
        seen, _ = enumerate_schedule(meta, splits, lens.tolist())
        assert len(seen) == 100
        assert splits.tolist() == [0, 102 // per_part - 3 // per_part + 1], default_plan
    # get_mla_metadata: the default plan unless num_sm_parts is given.
    md, ns = pagedmla.get_mla_metadata(lens, rows, 1)
    want_md = torch.empty_like(md)
    want_ns = torch.empty_like(ns)
    ops_schedule.schedule_into(lens, want_md, want_ns, rows, default_plan=True)
    assert torch.equal(md, want_md) and torch.equal(ns, want_ns)
    assert pagedmla.get_mla_metadata(lens, rows, 1, num_sm_parts=132)[1].tolist() == [0, 100]


# ----------------------------------------------------------------------------------------------------
# Provider selection
# ----------------------------------------------------------------------------------------------------

def small_call_args(g):
    lens = [5, 17]
    cache = make_paged_cache(lens, 16, 40, F32, generator=g)
    q = torch.randn(2, 1, 2, 40, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(seqlens, 2, 1)
    return (q, cache.k_cache, cache.block_table, seqlens, 32, meta, splits)


def all_ops(g, **kw):
    """Call the four ops once each with ``kw`` (provider=...) and return their results."""
    args = small_call_args(g)
    q, kc, bt, lens = args[:4]
    res = [pagedmla.flash_mla_with_kvcache(*args, **kw)]
    res.append(pagedmla.flash_mla_varlen_with_kvcache(q.reshape(2, 2, 40), kc, bt, lens,
                                                      torch.tensor([0, 1, 2], dtype=torch.int32), 32, **kw))
    qv = torch.randn(5, 2, 24, generator=g)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    res.append(pagedmla.flash_attn_varlen_func(qv, qv, qv[..., :16], cu, cu, 3, 3, **kw))
    res.append(pagedmla.merge_state(qv, torch.randn(5, 2, generator=g), qv.flip(0), torch.randn(5, 2, generator=g),
                                    **kw))
    return res


def spy_on_torch(monkeypatch):
    calls = []
    providers._load("torch")
    for op in providers.OPS:
        real = providers._impls[op]["torch"]

        def spy(*a, _real=real, _op=op, **kw):
            calls.append(_op)
            return _real(*a, **kw)

        monkeypatch.setitem(providers._impls[op], "torch", spy)
    return calls


def test_explicit_torch_provider_is_dispatched(monkeypatch):
    monkeypatch.setenv("PAGEDMLA_PROVIDER", "triton")  # the explicit argument wins over the variable
    calls = spy_on_torch(monkeypatch)
    all_ops(gen("provider_explicit"), provider="torch")
    assert calls == ["paged_decode", "paged_varlen", "varlen", "merge"]


def test_env_provider_torch(monkeypatch):
    monkeypatch.setenv("PAGEDMLA_PROVIDER", "torch")
    calls = spy_on_torch(monkeypatch)
    with_env = all_ops(gen("provider_env"))
    assert calls == ["paged_decode", "paged_varlen", "varlen", "merge"]
    monkeypatch.delenv("PAGEDMLA_PROVIDER")
    explicit = all_ops(gen("provider_env"), provider="torch")
    for a, b in zip(with_env, explicit):
        a, b = (a, ) if isinstance(a, torch.Tensor) else a, (b, ) if isinstance(b, torch.Tensor) else b
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for op in providers.OPS:
        assert providers.resolve(op, torch.device("cpu"))[0] == "torch"


def test_unknown_provider_argument_is_rejected():
    g = gen("provider_unknown")
    for op_call in range(4):
        with pytest.raises(ValueError, match="provider"):
            _call_one(op_call, g, provider="cudnn")


def test_unknown_provider_env_is_rejected(monkeypatch):
    monkeypatch.setenv("PAGEDMLA_PROVIDER", "no_such_provider")
    g = gen("provider_env_unknown")
    for op_call in range(4):
        with pytest.raises(ValueError, match="PAGEDMLA_PROVIDER"):
            _call_one(op_call, g)


def test_triton_on_cpu_without_interpreter_is_rejected(monkeypatch):
    providers._load("triton")  # let the real module register first so teardown restores it untouched
    for op in providers.OPS:
        if "triton" not in providers._impls[op]:
            monkeypatch.setitem(providers._impls[op], "triton", lambda *a: pytest.fail("triton impl was called"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = gen("provider_triton_cpu")
    for op_call in range(4):
        with pytest.raises(ValueError, match="provider.*TRITON_INTERPRET"):
            _call_one(op_call, g, provider="triton")


def _call_one(which: int, g, **kw):
    args = small_call_args(g)
    q, kc, bt, lens = args[:4]
    if which == 0:
        return pagedmla.flash_mla_with_kvcache(*args, **kw)
    if which == 1:
        return pagedmla.flash_mla_varlen_with_kvcache(q.reshape(2, 2, 40), kc, bt, lens,
                                                      torch.tensor([0, 1, 2], dtype=torch.int32), 32, **kw)
    qv = torch.randn(5, 2, 24, generator=g)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    if which == 2:
        return pagedmla.flash_attn_varlen_func(qv, qv, qv, cu, cu, 3, 3, **kw)
    return pagedmla.merge_state(qv, torch.randn(5, 2, generator=g), qv, torch.randn(5, 2, generator=g), **kw)
