"""Triton prefill kernels (ragged varlen attention, variable-q paged absorbed attention, merge_state)
against pagedmla.reference.

On CPU they run under the Triton interpreter (fp16/fp32, small shapes, small tiles so the multi-tile,
diagonal and ragged-tail paths are all exercised); the reference runs in float64 on the same rounded
inputs. GPU tests (bf16, realistic sizes) compare with the reference in float32.
"""

from __future__ import annotations

import pytest
import torch

import pagedmla
from pagedmla import errors, reference
from pagedmla.kernels.triton import merge as tmerge
from pagedmla.kernels.triton import paged_varlen as tpaged
from pagedmla.kernels.triton import varlen as tvarlen
from pagedmla.kernels.triton.common import PrefillConfig
from pagedmla.kernels.triton.sm90.mla import sm90_supported
from pagedmla.kernels.triton.sm90.paged_varlen import paged_varlen_sm90
from pagedmla.kernels.triton.sm90.varlen import varlen_sm90_plan, varlen_sm90_supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _check_lse(lse: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert lse.dtype == torch.float32
    empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no key must give LSE -inf, and only those"
    assert not lse.isnan().any()
    if (~empty).any():
        assert (lse.double() - ref.double())[~empty].abs().max().item() < tol


def _check_out(out: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all(), "every output element must be written and finite"
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all(), "rows with no key must be 0"
    assert _rel(out, ref) < tol
    # Row by row too: a wrong or unwritten row cannot hide in the norm of a large tensor.
    scale = ref.double().abs().amax(dim=-1).clamp_min(1e-3)
    assert ((out.double() - ref.double()).abs().amax(dim=-1) / scale).max().item() < 30 * tol


def _lens(gen: torch.Generator, n: int, hi: int) -> list[int]:
    return torch.randint(0, hi + 1, (n,), generator=gen).tolist()


def _varlen_case(lq: list[int], lk: list[int], h: int, hk: int, dk: int, dv: int, dtype, causal: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, h, dk, generator=gen).to(dtype)
    k = torch.randn(tk, hk, dk, generator=gen).to(dtype)
    v = torch.randn(tk, hk, dv, generator=gen).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_q.to(DEVICE), cu_k.to(DEVICE)


VARLEN_CASES = [
    # (q lengths, k lengths, H, Hk, Dqk, Dv)
    ([0, 1, 15, 16, 17, 40], None, 4, 4, 192, 128),
    ([16, 17, 15, 1, 0], None, 4, 2, 128, 128),
    ([33, 5], [70, 2], 8, 1, 64, 64),  # q shorter, then longer, than k (GQA 8)
    ([20, 3, 0], [7, 50, 9], 2, 2, 256, 256),
    ([18], [18], 2, 1, 96, 80),  # non power-of-two dims: 96 = 64 + 32, Dv padded and masked
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_varlen_matches_reference(case, causal, dtype):
    lq, lk, h, hk, dk, dv = VARLEN_CASES[case]
    lk = lq if lk is None else lk
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, h, hk, dk, dv, dtype, causal, seed=case)
    out = torch.full((q.shape[0], h, dv), float("nan"), dtype=dtype, device=DEVICE)
    scale = dk ** -0.5
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), scale, causal, out)
    assert o.data_ptr() == out.data_ptr()
    ref, ref_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, scale, causal)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    _check_out(o, ref, ref_lse, tol)
    _check_lse(lse, ref_lse, 1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_varlen_random_batches(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    b = int(torch.randint(1, 5, (1,), generator=gen))
    lq = _lens(gen, b, 40)
    lk = [x + int(torch.randint(0, 20, (1,), generator=gen)) for x in lq] if seed % 2 else _lens(gen, b, 40)
    hk = [1, 2, 4][seed % 3]
    h = hk * [1, 2, 8][seed % 3]
    causal = seed < 2
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, h, hk, 192, 128, torch.float16, causal, seed)
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.1, causal)
    ref, ref_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 0.1, causal)
    if q.shape[0]:
        _check_out(o, ref, ref_lse, 2e-3)
        _check_lse(lse, ref_lse, 1e-4)


def test_varlen_public_api():
    lq, lk = [0, 17, 5], [3, 40, 5]
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 4, 2, 192, 128, torch.float16, True, seed=7)
    out, lse, _ = pagedmla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True,
                                                  return_attn_probs=True, provider="triton")
    ref, ref_lse = pagedmla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True,
                                                   return_attn_probs=True, provider="torch")[:2]
    assert lse.shape == (4, q.shape[0])
    assert _rel(out, ref) < 2e-3
    _check_lse(lse, ref_lse, 1e-4)


def test_varlen_all_empty_and_bad_input():
    q, k, v, cu_q, cu_k = _varlen_case([0, 0], [3, 0], 2, 2, 64, 64, torch.float16, False, seed=1)
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, 0, 3, 0.1, False)
    assert o.shape == (0, 2, 64) and lse.shape == (0, 2)
    q, k, v, cu_q, cu_k = _varlen_case([2], [3], 2, 2, 64, 64, torch.float16, False, seed=1)
    with pytest.raises(ValueError, match="q"):
        tvarlen.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 2, 3, 0.1, False)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        tvarlen.varlen_attention(q, k, v, cu_q.long(), cu_k, 2, 3, 0.1, False)
    with pytest.raises(ValueError, match="k"):
        tvarlen.varlen_attention(q, k[:, :1].repeat(1, 3, 1), v, cu_q, cu_k, 2, 3, 0.1, False)
    with pytest.raises(ValueError, match="out"):
        tvarlen.varlen_attention(q, k, v, cu_q, cu_k, 2, 3, 0.1, False, torch.empty(2, 2, 32, dtype=q.dtype))


def _paged_case(q_lens, kv_lens, h, page_size, dtype, seed, d=576):
    """Pages in random order, page 0 never used, every slot a request does not own poisoned with NaN."""
    gen = torch.Generator().manual_seed(seed)
    b = len(q_lens)
    max_pages = max(1, max((n + page_size - 1) // page_size for n in kv_lens)) + 1
    num_pages = b * max_pages + 2
    perm = (torch.randperm(num_pages - 1, generator=gen)[: b * max_pages] + 1).view(b, max_pages)
    cache = torch.randn(num_pages, page_size, 1, d, generator=gen).to(dtype)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for i, n in enumerate(kv_lens):
        pos = torch.arange(n)
        owned[perm[i, pos // page_size] * page_size + pos % page_size] = True
    cache.view(-1, d)[~owned] = float("nan")
    qo = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    q = torch.randn(int(qo[-1]), h, d, generator=gen).to(dtype)
    return (q.to(DEVICE), cache.to(DEVICE), perm.to(torch.int32).to(DEVICE),
            torch.tensor(kv_lens, dtype=torch.int32).to(DEVICE), qo.to(DEVICE))


PAGED_CASES = [
    # (q lengths, kv lengths, H, page size)
    ([1, 5, 17, 40], [1, 20, 17, 100], 4, 16),
    ([3, 1, 16], [70, 1, 16], 16, 1),
    ([33], [33], 2, 64),
    ([1, 2], [64, 65], 8, 64),
    ([0, 9, 1], [5, 31, 3], 3, 16),  # a request with no new tokens; H not a power of two
    ([6, 4, 3], [2, 0, 3], 4, 16),  # more queries than keys: causal rows that see no key, an empty KV
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_paged_prefill_matches_reference(case, causal):
    q_lens, kv_lens, h, page_size = PAGED_CASES[case]
    dtype = torch.float16 if case % 2 == 0 else torch.float32
    q, cache, bt, lens, qo = _paged_case(q_lens, kv_lens, h, page_size, dtype, seed=case)
    scale = 576 ** -0.5
    o, lse = tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 512, scale, causal, None)
    ref, ref_lse = reference.paged_mla_attention(q.double(), cache.double(), bt, lens, qo, scale, causal, 512,
                                                 page_size)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    _check_out(o, ref, ref_lse, tol)
    _check_lse(lse, ref_lse, 1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_paged_prefill_random(seed):
    gen = torch.Generator().manual_seed(200 + seed)
    b = int(torch.randint(1, 5, (1,), generator=gen))
    q_lens = [int(x) for x in torch.randint(1, 41, (b,), generator=gen)]
    kv_lens = [n + int(torch.randint(0, 90, (1,), generator=gen)) for n in q_lens]
    page_size = [1, 16, 64][seed]
    h = [16, 4, 8][seed]
    q, cache, bt, lens, qo = _paged_case(q_lens, kv_lens, h, page_size, torch.float16, seed)
    o, lse = tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 512, 0.05, True, max(q_lens))
    ref, ref_lse = reference.paged_mla_attention(q.double(), cache.double(), bt, lens, qo, 0.05, True, 512,
                                                 page_size)
    _check_out(o, ref, ref_lse, 2e-3)
    _check_lse(lse, ref_lse, 1e-4)


def test_paged_prefill_hopper_kernel_rejects_other_value_widths():
    q, cache, bt, lens, qo = _paged_case([4, 1], [9, 30], 4, 64, torch.float16, seed=3)
    with pytest.raises(ValueError, match="head_dim_v 256"):
        tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 256, 0.1, True, None, config=PrefillConfig(use_sm90=True))


def test_paged_prefill_public_api_and_bad_input():
    q, cache, bt, lens, qo = _paged_case([4, 1], [9, 30], 4, 16, torch.float16, seed=3)
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(q, cache, bt, lens, qo, 512, causal=True, provider="triton")
    ref, ref_lse = pagedmla.flash_mla_varlen_with_kvcache(q, cache, bt, lens, qo, 512, causal=True, provider="torch")
    assert _rel(out, ref) < 2e-3
    _check_lse(lse, ref_lse, 1e-4)
    with pytest.raises(ValueError, match="head_dim_v"):
        tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 576, 0.1, True, None)
    with pytest.raises(ValueError, match="qo_indptr"):
        tpaged.paged_varlen_attention(q, cache, bt, lens, qo.long(), 512, 0.1, True, None)
    with pytest.raises(ValueError, match="k_cache"):
        tpaged.paged_varlen_attention(q, cache.float(), bt, lens, qo, 512, 0.1, True, None)


def _merge_inputs(t, h, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    v_a = torch.randn(t, h, d, generator=gen).to(dtype)
    v_b = torch.randn(t, h, d, generator=gen).to(dtype)
    s_a = (3 * torch.randn(h, t, generator=gen)).t()  # a transposed (strided) LSE view
    s_b = 3 * torch.randn(t, h, generator=gen)
    s_a[0] = float("-inf")
    s_b[1] = float("-inf")
    s_a[2, : h // 2 + 1] = float("-inf")
    s_b[2, : h // 2 + 1] = float("-inf")
    v_a[0] = float("nan")  # an empty state's values must not leak into the result
    return v_a.to(DEVICE), s_a.to(DEVICE), v_b.to(DEVICE), s_b.to(DEVICE)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype,d", [(torch.float16, 128), (torch.float32, 40)])
def test_merge_state(dtype, d, in_place):
    v_a, s_a, v_b, s_b = _merge_inputs(37, 5, d, dtype, seed=d)
    ref, ref_s = reference.merge_state(v_a.double(), s_a.double(), v_b.double(), s_b.double())
    if in_place:
        s_a = s_a.contiguous()
        v, s = tmerge.merge_state(v_a, s_a, v_b, s_b, v_a, s_a)
        assert v.data_ptr() == v_a.data_ptr() and s.data_ptr() == s_a.data_ptr()
    else:
        v, s = tmerge.merge_state(v_a, s_a, v_b, s_b)
    assert torch.isfinite(v).all()
    assert _rel(v, ref) < (1e-3 if dtype == torch.float16 else 1e-6)
    _check_lse(s, ref_s, 1e-5)
    both_empty = torch.isneginf(ref_s)
    assert both_empty.any() and (v[both_empty] == 0).all()


def test_merge_public_api():
    v_a, s_a, v_b, s_b = _merge_inputs(9, 4, 64, torch.float16, seed=5)
    v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, provider="triton")
    ref, ref_s = pagedmla.merge_state(v_a, s_a, v_b, s_b, provider="torch")
    assert _rel(v, ref) < 1e-3
    _check_lse(s, ref_s, 1e-5)


# ---------------------------------------------------------------- GPU, bf16, realistic sizes


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def test_varlen_default_kernel_choice(monkeypatch):
    """Without a config: the Hopper kernel where it applies, unless a strided input would have to be copied
    for queries too short to pay for the copy, or the launch has more work tiles than its int32 tile
    counter takes; an explicit config decides by its use_sm90 alone."""
    q, k, v = torch.zeros(4, 2, 192), torch.zeros(4, 2, 192), torch.zeros(4, 2, 320)[..., 192:]
    monkeypatch.setattr(tvarlen, "varlen_sm90_supported", lambda *a: True)
    assert tvarlen._use_sm90(None, q, k, v[..., :128].contiguous(), 1, 1)
    assert not tvarlen._use_sm90(None, q, k, v, tvarlen.SM90_COPY_MIN_Q - 1, 1)
    assert tvarlen._use_sm90(None, q, k, v, tvarlen.SM90_COPY_MIN_Q, 1)
    assert not tvarlen._use_sm90(PrefillConfig(block_m=64), q, k, v, 4096, 1)
    assert tvarlen._use_sm90(PrefillConfig(use_sm90=True), q, k, v, 1, 1)
    # 4 rows over many sequences: (4 // 128 + batch) x 2 heads per-sequence work tiles, and the counter takes
    # fewer than 2**31 - 2**20.
    long_q = tvarlen.SM90_COPY_MIN_Q
    assert tvarlen._use_sm90(None, q, k, v, long_q, 2 ** 30 - 2 ** 19 - 1)
    assert not tvarlen._use_sm90(None, q, k, v, long_q, 2 ** 30 - 2 ** 19)
    monkeypatch.setattr(tvarlen, "varlen_sm90_supported", lambda *a: False)
    assert not tvarlen._use_sm90(None, q, k, v[..., :128].contiguous(), 4096, 1)



def test_prefill_config_is_typed_and_merges_over_the_default():
    """Both prefill entry points take a PrefillConfig or None (a dict names the argument in a TypeError); a
    config's set fields replace the default tiles', the rest stay."""
    q, k, v = torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="config"):
        tvarlen.varlen_attention(q, k, v, cu, cu, 4, 4, 0.25, True, config={"BLOCK_M": 16})
    cache = torch.zeros(2, 16, 1, 16)
    table, lens = torch.ones(1, 1, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(TypeError, match="config"):
        tpaged.paged_varlen_attention(q, cache, table, lens, cu, 16, 0.25, True, config={"HOPPER": False})
    base = tvarlen.default_config(192, 128, torch.float16)
    merged = PrefillConfig(block_n=32).over(base)
    assert (merged.block_m, merged.block_n, merged.num_warps, merged.num_stages, merged.use_sm90) == (
        base.block_m, 32, base.num_warps, base.num_stages, False)

def test_varlen_sm90_plan():
    """The Hopper ragged kernel's tile numbering: the longest sequence's row tiles for every sequence, unless
    more than half of those would be empty; then each sequence's own (cu_q[b+1] // 128 - cu_q[b] // 128 + 1)."""
    assert varlen_sm90_plan(1024, 16 * 1024, 128, 16) == (8 * 128 * 16, False)
    assert varlen_sm90_plan(4096, 4096 + 63 * 64, 128, 64) == ((8128 // 128 + 64) * 128, True)
    assert varlen_sm90_plan(256, 100, 1, 2) == (4, False)  # padded = 2 x per-sequence: still padded
    assert varlen_sm90_plan(384, 100, 1, 2) == (2, True)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hk,lens", [(16, 16, [1024, 4096, 2500, 3]), (128, 128, [1024, 777]), (16, 2, [2048, 1]),
                                       (16, 16, [300, 17])])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("contiguous_v", [True, False])
def test_gpu_varlen_bf16(h, hk, lens, causal, contiguous_v):
    """The public call with the default kernel choice: on sm_90 the Hopper kernel for contiguous inputs and
    for long queries, the portable kernel for a strided value view over short queries ([300, 17])."""
    gen = torch.Generator(device="cuda").manual_seed(sum(lens) + h)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    t = int(cu[-1])
    q = (torch.randn(t, h, 192, device="cuda", generator=gen) / 2).bfloat16()
    k = (torch.randn(t, hk, 192, device="cuda", generator=gen) / 2).bfloat16()
    v = torch.randn(t, hk, 128, device="cuda", generator=gen).bfloat16()
    if not contiguous_v:  # the value half of a [T, Hk, 64 + 128] decompression output, as the model makes
        v = torch.cat([torch.full((t, hk, 64), float("nan"), device="cuda").bfloat16(), v], -1)[..., 64:]
    out = torch.full((t, h, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = pagedmla.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                             return_attn_probs=True, out=out, provider="triton")[:2]
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, cu, 192 ** -0.5, causal)
    assert o.data_ptr() == out.data_ptr() and torch.isfinite(o).all()
    assert _rel(o, ref) < 1e-2 and _cos(o, ref) > 0.9999
    assert (lse.t() - ref_lse).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_varlen_equal_dims_bf16(d):
    lens_q, lens_k = [300, 1, 1000], [700, 64, 1000]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 8, 2, d, d, torch.bfloat16, True, seed=d)
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), d ** -0.5, True)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, d ** -0.5, True)
    assert torch.isfinite(o).all() and _rel(o, ref) < 1e-2 and _cos(o, ref) > 0.9999
    assert (lse - ref_lse).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["portable", "sm90"])
@pytest.mark.parametrize("h,hk,lens", [(16, 16, [1024, 2500, 3]), (128, 128, [777, 1])])
def test_gpu_varlen_each_kernel_bf16(kernel, h, hk, lens):
    """Both kernels on the GPU whatever the default picks (the portable one runs off sm_90 and for
    fp32 / other head dims there)."""
    q, k, v, cu, _ = _varlen_case(lens, lens, h, hk, 192, 128, torch.bfloat16, True, seed=h + len(lens))
    if kernel == "sm90" and not varlen_sm90_supported(q, k, v):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q = (q.float() / 2).bfloat16()
    o, lse = tvarlen.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), 192 ** -0.5, True,
                                      config=PrefillConfig(use_sm90=kernel == "sm90"))
    ref, ref_lse = reference.varlen_attention(q.float(), k.float(), v.float(), cu, cu, 192 ** -0.5, True)
    _check_lse(lse, ref_lse, 1e-2)
    _check_out(o, ref, ref_lse, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("kernel", [None, "portable"])
def test_gpu_paged_prefill_bf16(h, kernel):
    q_lens = [512, 1, 37, 300]
    kv_lens = [2048 + 512, 4000, 37, 1300]
    q, cache, bt, lens, qo = _paged_case(q_lens, kv_lens, h, 64, torch.bfloat16, seed=h)
    q = (q.float() / 4).bfloat16()
    if kernel is None:  # the public call: the Hopper kernel on sm_90
        out, lse = pagedmla.flash_mla_varlen_with_kvcache(q, cache, bt, lens, qo, 512, causal=True,
                                                          max_q_len=max(q_lens), provider="triton")
    else:
        out, lse = tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 512, 576 ** -0.5, True, None,
                                                 config=PrefillConfig(use_sm90=False))
    ref, ref_lse = reference.paged_mla_attention(q, cache, bt, lens, qo, 576 ** -0.5, True, 512, 64)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2 and _cos(out, ref) > 0.9999
    assert (lse - ref_lse).abs().max().item() < 1e-2


SM90_VARLEN_CASES = [
    # (q lengths, k lengths, H, Hk, Dqk, Dv): ragged tails around the 64-row warpgroup and 128-row program
    # tiles, q shorter and longer than k, GQA 1, 2, 8
    ([0, 1, 15, 16, 17, 64, 65, 127, 128, 129, 1000], None, 4, 4, 192, 128),
    ([300, 5, 190], [700, 2, 190], 16, 2, 192, 128),
    ([33, 5, 260], [70, 2, 100], 8, 1, 128, 128),
    ([20, 200, 0], [7, 500, 9], 4, 2, 64, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(SM90_VARLEN_CASES)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_varlen_hopper_kernel(case, causal, dtype):
    """The Hopper ragged kernel against the reference on ragged tails, GQA and every supported head dim."""
    lq, lk, h, hk, dk, dv = SM90_VARLEN_CASES[case]
    lk = lk or lq
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, h, hk, dk, dv, dtype, causal, seed=case + 40)
    if not varlen_sm90_supported(q, k, v):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q = (q.float() / 2).to(dtype)
    # Spare rows after the last sequence (an engine's buffers have capacity) hold NaN: never to be used.
    k = torch.cat([k, torch.full((70, hk, dk), float("nan"), dtype=dtype, device="cuda")])
    v = torch.cat([v, torch.full((70, hk, dv), float("nan"), dtype=dtype, device="cuda")])
    out = torch.full((q.shape[0], h, dv), float("nan"), dtype=dtype, device="cuda")
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), dk ** -0.5, causal, out,
                                      config=PrefillConfig(use_sm90=True))
    ref, ref_lse = reference.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, dk ** -0.5, causal)
    assert o.data_ptr() == out.data_ptr()
    _check_lse(lse, ref_lse, 1e-2)
    _check_out(o, ref, ref_lse, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_hopper_kernel_many_tiles(causal):
    """The persistent kernel's tile hand-off: thousands of work tiles (far more than SMs) over 60 sequences
    of 0-1500 tokens, q shorter and longer than k, GQA 4; a second call (the tile counter starts again)
    and CUDA-graph replays with new inputs give the same results."""
    gen = torch.Generator().manual_seed(7)
    lq, lk = _lens(gen, 60, 1500), _lens(gen, 60, 1500)
    assert not varlen_sm90_plan(max(lq), sum(lq), 32, len(lq))[1]  # the padded numbering runs
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 32, 8, 192, 128, torch.bfloat16, causal, seed=9)
    if not varlen_sm90_supported(q, k, v):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q = (q.float() / 2).bfloat16()

    def call():
        return tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 192 ** -0.5, causal,
                                        config=PrefillConfig(use_sm90=True))

    o, lse = call()
    ref, ref_lse = reference.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, 192 ** -0.5, causal)
    _check_lse(lse, ref_lse, 1e-2)
    _check_out(o, ref, ref_lse, 1e-2)
    o2, lse2 = call()
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_o, g_lse = call()
    # Two replays on new inputs: a counter left at its end value by the first would leave the second's
    # outputs stale.
    for _ in range(2):
        q.copy_(torch.flip(q, [0]))
        graph.replay()
        o3, lse3 = call()
        assert torch.equal(g_o, o3) and torch.equal(g_lse, lse3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_hopper_kernel_skewed_batch(causal):
    """One long prompt among many short ones (a chunked-prefill batch): the per-sequence tile numbering,
    every row of every sequence computed once (lengths around the 128-row tiles,
    sequences that start mid-tile, empty ones, GQA 4, q shorter than k for some)."""
    gen = torch.Generator().manual_seed(11)
    short = [0, 1, 17, 127, 128, 129, 255, 64]
    lq = [3001] + [short[i % len(short)] for i in range(60)] + [700]
    lk = [n + int(torch.randint(0, 3, (1,), generator=gen)) * 40 for n in lq]
    assert varlen_sm90_plan(max(lq), sum(lq), 16, len(lq))[1]  # the per-sequence numbering runs
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 16, 4, 192, 128, torch.bfloat16, causal, seed=13)
    if not varlen_sm90_supported(q, k, v):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q = (q.float() / 2).bfloat16()
    out = torch.full((q.shape[0], 16, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 192 ** -0.5, causal, out,
                                      config=PrefillConfig(use_sm90=True))
    ref, ref_lse = reference.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, 192 ** -0.5, causal)
    _check_lse(lse, ref_lse, 1e-2)
    _check_out(o, ref, ref_lse, 1e-2)


@pytest.mark.gpu
def test_gpu_varlen_hopper_kernel_without_keys():
    q, k, v, cu_q, cu_k = _varlen_case([5, 3], [0, 0], 4, 4, 192, 128, torch.bfloat16, True, seed=1)
    if not varlen_sm90_supported(q, k, v):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, 5, 0, 0.1, True, config=PrefillConfig(use_sm90=True))
    assert (o == 0).all() and torch.isneginf(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("h", [128, 16, 3])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_paged_prefill_hopper_kernel(h, page, dtype, causal):
    """The Hopper paged-prefill kernel: requests with 0, 1, 15, 16, 17 and hundreds of
    new tokens over cached prefixes, queries longer than the keys (causal rows that see nothing), an empty
    KV, NaN in every slot a request does not own, pages in random order."""
    cache_ok = torch.empty(1, 64, 1, 576, dtype=dtype, device="cuda")
    if not sm90_supported(cache_ok[0, :1], cache_ok, 512):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q_lens = [0, 1, 15, 16, 17, 300, 6, 3, 130]
    kv_lens = [40, 1000, 15, 80, 17, 2300, 2, 0, 700]
    q, cache, bt, lens, qo = _paged_case(q_lens, kv_lens, h, page, dtype, seed=h + page)
    q = (q.float() / 4).to(dtype)
    # The op allocates its output: leave a NaN-filled block of that size for the caching allocator to hand
    # back, so that a row the kernel does not write cannot pass as 0.
    del cache_ok
    torch.full((q.shape[0], h, 512), float("nan"), dtype=dtype, device="cuda")
    out, lse = tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 512, 576 ** -0.5, causal, None,
                                             config=PrefillConfig(use_sm90=True))
    ref, ref_lse = reference.paged_mla_attention(q.float(), cache.float(), bt, lens, qo, 576 ** -0.5, causal, 512,
                                                 page)
    _check_lse(lse, ref_lse, 1e-2)
    _check_out(out, ref, ref_lse, 1e-2)
    assert _cos(out, ref) > 0.9999


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_paged_prefill_hopper_kernel_many_tiles_per_program(causal):
    """The persistent kernel's hand-off: 5 programs for 117 tiles, so each runs tiles of several requests in
    a row (empty ones, rows that see no key, an empty KV among them: the Q and ring bookkeeping must carry
    across); a second call (its counter starts again) and CUDA-graph replays with new inputs agree."""
    cache_ok = torch.empty(1, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    if not sm90_supported(cache_ok[0, :1], cache_ok, 512):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q_lens = [7, 0, 200, 1, 33, 6, 64, 120, 3]
    kv_lens = [300, 50, 900, 0, 33, 2, 1000, 130, 70]
    q, cache, bt, lens, qo = _paged_case(q_lens, kv_lens, 16, 64, torch.bfloat16, seed=21)
    q = (q.float() / 4).bfloat16()
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], 16), float("nan"), dtype=torch.float32, device="cuda")

    def call():
        paged_varlen_sm90(q, cache, bt, lens, qo, 576 ** -0.5, causal, out, lse, programs=5)
        return out.clone(), lse.clone()

    o, o_lse = call()
    ref, ref_lse = reference.paged_mla_attention(q.float(), cache.float(), bt, lens, qo, 576 ** -0.5, causal, 512,
                                                 64)
    _check_lse(o_lse, ref_lse, 1e-2)
    _check_out(o, ref, ref_lse, 1e-2)
    o2, lse2 = call()
    assert torch.equal(o2, o) and torch.equal(lse2, o_lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_varlen_sm90(q, cache, bt, lens, qo, 576 ** -0.5, causal, out, lse, programs=5)
    # Two replays on new inputs: a counter left at its end value by the first would leave the second's
    # outputs stale.
    for _ in range(2):
        q.copy_(torch.flip(q, [0]))
        graph.replay()
        g_o, g_lse = out.clone(), lse.clone()
        assert torch.equal(g_o, call()[0]) and torch.equal(g_lse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_paged_prefill_hopper_kernel_negative_length(causal):
    """A negative cache length reaching the kernel (the host does not read values on CUDA by default) gives
    that request NaN rows and sets the error bit (pagedmla.errors); the others are exact, and the persistent
    programs finish (a negative tile end once stopped the loader early)."""
    cache_ok = torch.empty(1, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    if not sm90_supported(cache_ok[0, :1], cache_ok, 512):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    q_lens, kv_lens = [40, 9, 70, 5], [100, 0, 200, 64]
    q, cache, bt, lens, qo = _paged_case(q_lens, kv_lens, 16, 64, torch.bfloat16, seed=5)
    q = (q.float() / 4).bfloat16()
    ref, ref_lse = reference.paged_mla_attention(q.float(), cache.float(), bt, lens, qo, 576 ** -0.5, causal, 512,
                                                 64)
    lens[1] = -7
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], 16), float("nan"), dtype=torch.float32, device="cuda")
    errors.device_errors()
    paged_varlen_sm90(q, cache, bt, lens, qo, 576 ** -0.5, causal, out, lse, programs=3)
    torch.cuda.synchronize()
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[40:49] = False
    _check_lse(lse[keep], ref_lse[keep], 1e-2)
    _check_out(out[keep], ref[keep], ref_lse[keep], 1e-2)
    assert out[40:49].isnan().all() and lse[40:49].isnan().all()
    assert errors.device_errors() == errors.NEGATIVE_LENGTH


@pytest.mark.gpu
def test_gpu_merge_bf16():
    v_a, s_a, v_b, s_b = _merge_inputs(4096, 16, 128, torch.bfloat16, seed=0)
    ref, ref_s = reference.merge_state(v_a, s_a, v_b, s_b)
    v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, provider="triton")
    assert torch.isfinite(v).all() and _rel(v, ref) < 1e-2
    _check_lse(s, ref_s, 1e-4)
