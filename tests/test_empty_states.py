"""Empty attention states and empty caches, on the torch and the Triton provider (interpreter on CPU).

merge_state: an empty state's LSE is -inf (pagedmla) or +inf (FlashMLA / FlashAttention's empty row); both
mean "no keys" and give the same result. A NaN LSE, or a NaN value in a state that is not empty, is
corruption and must come out as NaN, never be read as empty. Empty caches (0 pages, every length 0)
return output 0 and LSE -inf.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_attention_close, dense_merge, gen

import pagedmla

NEG_INF, POS_INF, NAN = float("-inf"), float("inf"), float("nan")
PROVIDERS = ["torch", "triton"]


def states(g: torch.Generator, T: int, H: int, D: int, dtype: torch.dtype):
    v_a = torch.randn(T, H, D, generator=g).to(dtype)
    v_b = torch.randn(T, H, D, generator=g).to(dtype)
    s_a = torch.randn(T, H, generator=g) * 3
    s_b = torch.randn(T, H, generator=g) * 3
    return v_a, s_a, v_b, s_b


@pytest.mark.parametrize("provider", PROVIDERS)
def test_merge_reads_plus_and_minus_inf_as_empty(provider):
    g = gen("merge_inf", provider)
    T, H, D = 12, 3, 32
    v_a, s_a, v_b, s_b = states(g, T, H, D, torch.float16)
    kind = (torch.arange(T * H) % 4).reshape(T, H)
    s_a[kind == 0] = NEG_INF
    s_b[kind == 1] = NEG_INF
    s_a[kind == 2] = NEG_INF
    s_b[kind == 2] = NEG_INF
    # Garbage (NaN) in the values of every empty state must not leak.
    v_a[torch.isneginf(s_a)] = NAN
    v_b[torch.isneginf(s_b)] = NAN
    ref_v, ref_s = dense_merge(v_a, s_a, v_b, s_b)
    minus = pagedmla.merge_state(v_a, s_a, v_b, s_b, provider=provider)
    plus = pagedmla.merge_state(v_a, s_a.abs().where(torch.isinf(s_a), s_a), v_b,
                                s_b.abs().where(torch.isinf(s_b), s_b), provider=provider)
    mixed = pagedmla.merge_state(v_a, s_a.abs().where(torch.isinf(s_a), s_a), v_b, s_b, provider=provider)
    assert (torch.isposinf(s_a) == 0).all() and torch.isneginf(s_a).sum() == 2 * T * H // 4
    for v, s in (minus, plus, mixed):
        assert_attention_close(v, s, ref_v, ref_s, 2e-3)
        # Two empty states: output 0 and pagedmla's -inf, whichever convention came in.
        assert (v[kind == 2] == 0).all() and torch.isneginf(s[kind == 2]).all()
    assert torch.equal(plus[0], minus[0]) and torch.equal(plus[1], minus[1])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_merge_propagates_nan(provider):
    g = gen("merge_nan", provider)
    T, H, D = 6, 2, 16
    v_a, s_a, v_b, s_b = states(g, T, H, D, torch.float32)
    s_a[0, 0] = NAN                        # NaN LSE against a live state
    s_a[1, 0], s_b[1, 0] = NAN, NEG_INF    # NaN LSE against an empty (-inf) state: still NaN, not empty
    s_a[2, 0], s_b[2, 0] = NAN, POS_INF    # ... and against FlashMLA's empty (+inf)
    v_b[3, 0, 5] = NAN                     # NaN value in a live state
    s_a[4, 0], s_b[4, 0] = 0.0, -200.0     # NaN value in a live state whose weight underflows to 0
    v_b[4, 0, 0] = NAN
    s_b[5, 0] = NEG_INF                    # NaN value in an empty state: ignored
    v_b[5, 0, 0] = NAN
    v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, provider=provider)
    for t in (0, 1, 2):
        assert torch.isnan(v[t, 0]).all() and torch.isnan(s[t, 0]), t
    assert torch.isnan(v[3, 0, 5]) and torch.isfinite(s[3, 0])
    assert torch.isnan(v[4, 0, 0]) and torch.isfinite(s[4, 0])
    assert torch.isfinite(v[5, 0]).all() and torch.allclose(v[5, 0], v_a[5, 0]) and s[5, 0] == s_a[5, 0]
    # Rows without corruption are untouched by their neighbours'.
    ref_v, ref_s = dense_merge(v_a[:, 1:], s_a[:, 1:], v_b[:, 1:], s_b[:, 1:])
    assert_attention_close(v[:, 1:], s[:, 1:], ref_v, ref_s, 1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_merge_in_place_with_plus_inf(provider):
    """The in-place form (out aliasing v_a / s_a) with +inf empties, as a FlashMLA caller would feed it."""
    g = gen("merge_inplace_inf", provider)
    v_a, s_a, v_b, s_b = states(g, 5, 4, 64, torch.float16)
    s_a[:, 0] = POS_INF
    s_b[:, 1] = POS_INF
    s_a[0, 2], s_b[0, 2] = POS_INF, POS_INF
    v_b0, s_b0 = v_b.clone(), s_b.clone()
    v_a1, s_a1 = v_a.clone(), s_a.clone()
    v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, out=v_a, out_lse=s_a, provider=provider)
    assert v.data_ptr() == v_a.data_ptr() and s.data_ptr() == s_a.data_ptr()
    # Column 0: a is empty, the result is b; column 1: b is empty, the result is a; [0, 2]: both empty.
    assert torch.equal(v[1:, 0], v_b0[1:, 0]) and torch.equal(s[1:, 0], s_b0[1:, 0])
    assert torch.equal(v[:, 1], v_a1[:, 1]) and torch.equal(s[:, 1], s_a1[:, 1])
    assert (v[0, 2] == 0).all() and torch.isneginf(s[0, 2])
    ref_v, ref_s = dense_merge(v_a1[:, 3:], s_a1[:, 3:], v_b0[:, 3:], s_b0[:, 3:])
    assert_attention_close(v[:, 3:], s[:, 3:], ref_v, ref_s, 2e-3)


def _decode_inputs(dtype, num_pages: int, width: int, lens: list[int]):
    b, q_len, h, d, dv = len(lens), 2, 4, 48, 32
    q = torch.randn(b, q_len, h, d).to(dtype)
    k_cache = torch.randn(num_pages, 16, 1, d).to(dtype)
    block_table = torch.zeros(b, width, dtype=torch.int32)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, block_table, cache_seqlens, dv


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_pages,width", [(0, 1), (0, 0), (3, 0), (3, 2)], ids=["0pages", "0pages_0cols",
                                                                                   "0cols", "all_len_0"])
def test_empty_cache_gives_zero_and_neg_inf(provider, num_pages, width):
    q, k_cache, block_table, lens, dv = _decode_inputs(torch.float16, num_pages, width, [0, 0, 0])
    md, ns = pagedmla.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1)
    out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, block_table, lens, dv, md, ns, causal=True,
                                               provider=provider)
    assert tuple(out.shape) == (3, 2, 4, dv) and (out == 0).all() and torch.isneginf(lse).all()
    qv = q.reshape(6, 4, -1)
    indptr = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(qv, k_cache, block_table, lens, indptr, dv, provider=provider)
    assert tuple(out.shape) == (6, 4, dv) and (out == 0).all() and torch.isneginf(lse).all()
