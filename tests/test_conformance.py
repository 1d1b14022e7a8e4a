"""Every op x every available provider against the float64 oracle (``tests/oracle.py``), on one cache builder.

The public calls (``pagedmla.flash_mla_with_kvcache``, ``flash_mla_varlen_with_kvcache``,
``flash_attn_varlen_func``, ``merge_state``) with ``provider=`` set: ``torch`` everywhere; ``triton`` on CPU
under the interpreter (fp16 / fp32, small shapes: the interpreter's dot is wrong for bf16) and compiled on
CUDA (the ``gpu`` mark: bf16 / fp16, where the Hopper kernels take the shapes they support). Paged caches
come from ``oracle.make_paged_cache``: pages in permuted order, page 0, spare pages and every slot past a
request's tokens NaN, so a read outside a request's tokens poisons its rows. Kernel-specific behaviour
(configs, launch caches, forced Hopper paths, guards) stays in the kernel test files.

FP8 caches (``fp8_e4m3`` with its k_scale, ``fp8_ds_mla`` behind ``is_fp8_kvcache``) come from the same builder
through ``pagedmla.quantize_latent``; the oracle attends over the rows decoded from their bytes by hand
(``oracle.decode_fp8_rows``), and the results must also be within a cosine difference of 1e-5 of it.
"""

from __future__ import annotations

import pytest
import torch
from oracle import (
    TOLERANCES,
    assert_attention_close,
    cos_diff,
    dense_merge,
    dense_paged,
    dense_varlen,
    gen,
    make_paged_cache,
)

import pagedmla
from pagedmla.ops import available_providers

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def _targets() -> list:
    """(provider, device, dtype) triples: the CPU ones run here, the CUDA ones under the gpu mark."""
    out = []
    for provider in ("torch", "triton"):
        for dtype in (F32, F16):
            out.append(pytest.param(provider, "cpu", dtype, id=f"{provider}-cpu-{str(dtype)[6:]}"))
        for dtype in (BF16, F16):
            out.append(pytest.param(provider, "cuda", dtype, id=f"{provider}-cuda-{str(dtype)[6:]}",
                                    marks=pytest.mark.gpu))
    return out


TARGETS = _targets()


def _skip_unavailable(op: str, provider: str) -> None:
    if provider not in available_providers(op):
        pytest.skip(f"{provider} does not implement {op} in this installation")


# (request KV lengths, q_len, heads, page size, D, Dv, parts): empty requests, lengths at and around page and
# 64-token block edges, forced splits over several parts.
DECODE_CASES = [
    ([0, 1, 63, 65, 130], 1, 16, 16, 576, 512, 4),
    ([64, 0, 17], 2, 3, 64, 576, 512, 3),
    ([2, 70, 1], 3, 4, 16, 80, 64, 2),  # request 0 is shorter than q_len: its first rows see no key
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
@pytest.mark.parametrize("provider,device,dtype", TARGETS)
def test_paged_decode(provider, device, dtype, case, causal):
    _skip_unavailable("paged_decode", provider)
    lens, q_len, heads, page, d, dv, parts = DECODE_CASES[case]
    g = gen("conformance-decode", case, causal, str(dtype))
    cache = make_paged_cache(lens, page, d, dtype, generator=g, scale=0.25)
    b = len(lens)
    q = (torch.randn(b, q_len, heads, d, generator=g, dtype=torch.float64) * 0.25).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    meta, splits = pagedmla.get_mla_metadata(seqlens, q_len * heads, 1, num_sm_parts=parts)
    out, lse = pagedmla.flash_mla_with_kvcache(q.to(device), cache.k_cache.to(device),
                                               cache.block_table.to(device), seqlens, dv, meta, splits,
                                               causal=causal, provider=provider)
    qo = [i * q_len for i in range(b + 1)]
    ref_out, ref_lse = dense_paged(q.reshape(b * q_len, heads, d), qo, cache.rows, d ** -0.5, causal, dv)
    assert_attention_close(out, lse, ref_out.reshape(b, q_len, heads, dv),
                           ref_lse.reshape(b, q_len, heads).transpose(1, 2), TOLERANCES[dtype],
                           f"lens={lens}")


# (q lengths, KV lengths, heads, page size): a request with no new tokens, more queries than keys.
PAGED_VARLEN_CASES = [
    ([1, 5, 17, 40], [1, 20, 17, 100], 4, 16),
    ([0, 9, 1], [5, 31, 3], 3, 64),
    ([6, 4, 3], [2, 0, 3], 4, 16),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(PAGED_VARLEN_CASES)))
@pytest.mark.parametrize("provider,device,dtype", TARGETS)
def test_paged_varlen(provider, device, dtype, case, causal):
    _skip_unavailable("paged_varlen", provider)
    q_lens, kv_lens, heads, page = PAGED_VARLEN_CASES[case]
    g = gen("conformance-paged-varlen", case, causal, str(dtype))
    cache = make_paged_cache(kv_lens, page, 576, dtype, generator=g, scale=0.25)
    out, lse, ref_out, ref_lse = _paged_varlen_against_oracle(q_lens, kv_lens, heads, cache, g, provider, device,
                                                              dtype, causal)
    assert_attention_close(out, lse, ref_out, ref_lse, TOLERANCES[dtype], f"q={q_lens} kv={kv_lens}")


def _paged_varlen_against_oracle(q_lens, kv_lens, heads, cache, g, provider, device, dtype, causal, **kw):
    """flash_mla_varlen_with_kvcache of random queries (q_lens per request) over ``cache`` and the oracle's
    result over its rows: (out, lse, ref_out, ref_lse)."""
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    q = (torch.randn(qo[-1], heads, 576, generator=g, dtype=torch.float64) * 0.25).to(dtype)
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(
        q.to(device), cache.k_cache.to(device), cache.block_table.to(device),
        torch.tensor(kv_lens, dtype=torch.int32, device=device), torch.tensor(qo, dtype=torch.int32, device=device),
        512, causal=causal, provider=provider, **kw)
    ref_out, ref_lse = dense_paged(q, qo, cache.rows, 576 ** -0.5, causal, 512)
    return out, lse, ref_out, ref_lse


# (q lengths, k lengths or None for the same, heads, KV heads, Dqk, Dv)
VARLEN_CASES = [
    ([0, 1, 15, 17], None, 4, 2, 64, 64),
    ([33, 5], [70, 2], 4, 1, 192, 128),
    ([18, 3], [18, 0], 2, 2, 96, 80),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("provider,device,dtype", TARGETS)
def test_varlen(provider, device, dtype, case, causal):
    _skip_unavailable("varlen", provider)
    lq, lk, h, hk, dk, dv = VARLEN_CASES[case]
    lk = lq if lk is None else lk
    g = gen("conformance-varlen", case, causal, str(dtype))
    cu_q, cu_k = [0], [0]
    for a, c in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + c)
    q, k, v = ((torch.randn(n, heads, dim, generator=g, dtype=torch.float64) * 0.5).to(dtype)
               for n, heads, dim in ((cu_q[-1], h, dk), (cu_k[-1], hk, dk), (cu_k[-1], hk, dv)))
    out, lse, _ = pagedmla.flash_attn_varlen_func(
        q.to(device), k.to(device), v.to(device), torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device), max(lq), max(lk), causal=causal,
        return_attn_probs=True, provider=provider)
    ref_out, ref_lse = dense_varlen(q, k, v, cu_q, cu_k, dk ** -0.5, causal)
    assert_attention_close(out, lse.transpose(0, 1), ref_out, ref_lse, TOLERANCES[dtype],
                           f"lq={lq} lk={lk}")


@pytest.mark.parametrize("shape", [(17, 3, 128), (7, 1, 40)])
@pytest.mark.parametrize("provider,device,dtype", TARGETS)
def test_merge(provider, device, dtype, shape):
    _skip_unavailable("merge", provider)
    g = gen("conformance-merge", shape, str(dtype))
    t, h, d = shape
    v_a, v_b = ((torch.randn(t, h, d, generator=g, dtype=torch.float64)).to(dtype) for _ in range(2))
    s_a, s_b = (torch.randn(t, h, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    s_a[0, 0] = float("-inf")  # one side empty: the other passes through
    s_a[1, 0] = s_b[1, 0] = float("-inf")  # both empty: output 0, LSE -inf
    out, lse = pagedmla.merge_state(v_a.to(device), s_a.float().to(device), v_b.to(device), s_b.float().to(device),
                                    provider=provider)
    ref_out, ref_lse = dense_merge(v_a, s_a.float(), v_b, s_b.float())
    assert_attention_close(out, lse, ref_out, ref_lse, TOLERANCES[dtype], f"shape={shape}")


# FP8 caches: lengths at the page and 64-token edges, page sizes 1 / 16 / 64, every provider on both formats;
# the torch provider also with bf16 queries (the oracle's rows are the dequantised ones, so the tolerance is the
# query dtype's).
FP8_LENS = [0, 1, 63, 64, 65]
FP8_FORMATS = ["fp8_e4m3", "fp8_ds_mla"]
FP8_TARGETS = TARGETS + [pytest.param("torch", "cpu", BF16, id="torch-cpu-bfloat16")]
# The fp8_e4m3 layer scale: not a power of two, so the kernels' fp8 x k_scale rounds as the oracle's does not.
FP8_K_SCALE = 1.3 / 448


def _fp8_cache(lens, page, kv_format, g, device):
    """(cache, keyword arguments of the paged calls) for ``kv_format``."""
    k_scale = torch.tensor([FP8_K_SCALE])
    ks = k_scale if kv_format == "fp8_e4m3" else None
    cache = make_paged_cache(lens, page, 576, generator=g, scale=0.25, kv_format=kv_format, k_scale=FP8_K_SCALE,
                             encode=lambda rows: pagedmla.quantize_latent(rows, kv_format, k_scale=ks))
    kw = dict(k_scale=k_scale.to(device)) if kv_format == "fp8_e4m3" else dict(is_fp8_kvcache=True)
    return cache, kw


def _assert_fp8_close(out, lse, ref_out, ref_lse, dtype, what):
    assert_attention_close(out, lse, ref_out, ref_lse, TOLERANCES[dtype], what)
    diff = cos_diff(out, ref_out)
    assert diff < 1e-5, f"cos diff {diff:.2e} [{what}]"


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("kv_format", FP8_FORMATS)
@pytest.mark.parametrize("provider,device,dtype", FP8_TARGETS)
def test_paged_decode_fp8(provider, device, dtype, kv_format, page):
    _skip_unavailable("paged_decode", provider)
    q_len, heads = 2, 4
    g = gen("conformance-decode-fp8", kv_format, page, str(dtype))
    cache, kw = _fp8_cache(FP8_LENS, page, kv_format, g, device)
    b = len(FP8_LENS)
    q = (torch.randn(b, q_len, heads, 576, generator=g, dtype=torch.float64) * 0.25).to(dtype)
    seqlens = torch.tensor(FP8_LENS, dtype=torch.int32, device=device)
    meta, splits = pagedmla.get_mla_metadata(seqlens, q_len * heads, 1, num_sm_parts=3)
    out, lse = pagedmla.flash_mla_with_kvcache(q.to(device), cache.k_cache.to(device), cache.block_table.to(device),
                                               seqlens, 512, meta, splits, causal=True, provider=provider, **kw)
    ref_out, ref_lse = dense_paged(q.reshape(b * q_len, heads, 576), [i * q_len for i in range(b + 1)], cache.rows,
                                   576 ** -0.5, True, 512)
    _assert_fp8_close(out, lse, ref_out.reshape(b, q_len, heads, 512),
                      ref_lse.reshape(b, q_len, heads).transpose(1, 2), dtype, f"{kv_format} page={page}")


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("kv_format", FP8_FORMATS)
@pytest.mark.parametrize("provider,device,dtype", FP8_TARGETS)
def test_paged_varlen_fp8(provider, device, dtype, kv_format, page):
    _skip_unavailable("paged_varlen", provider)
    g = gen("conformance-paged-varlen-fp8", kv_format, page, str(dtype))
    cache, kw = _fp8_cache(FP8_LENS, page, kv_format, g, device)
    out, lse, ref_out, ref_lse = _paged_varlen_against_oracle([0, 1, 5, 64, 3], FP8_LENS, 2, cache, g, provider,
                                                              device, dtype, True, **kw)
    _assert_fp8_close(out, lse, ref_out, ref_lse, dtype, f"{kv_format} page={page}")
