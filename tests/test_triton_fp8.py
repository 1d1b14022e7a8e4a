"""The portable Triton kernels on FP8 caches, beyond the conformance grid (``test_conformance.py``): a NaN stored
in a live FP8 value reaches the output as on the torch reference (the interpreter decodes the NaN codes as
+-480, ``common.fp8_nan_fixup``), FlashMLA's padded page stride reads in place, the Hopper FP8 decode
(``sm90/decode_fp8.py``) matches the oracle and guards its pages on the GPU, and the paged prefill's
dequantise-first path (``rows.dequantize_pages`` + the Hopper kernel) matches the reference."""

from __future__ import annotations

import functools

import pytest
import torch
from bounds import checked_accesses, guarded, margins_intact
from oracle import TOLERANCES, assert_attention_close, cos_diff, dense_paged, gen, make_paged_cache

import pagedmla
from pagedmla import errors
from pagedmla.kernels.triton.common import PrefillConfig
from pagedmla.kernels.triton.decode import DecodeConfig, paged_decode_triton, select_config
from pagedmla.kernels.triton.paged_varlen import dequantize_first, paged_varlen_attention
from pagedmla.kernels.triton.rows import dequantize_pages
from pagedmla.kernels.triton.sm90.decode_fp8 import sm90_fp8_supported
from pagedmla.split_plan import narrow_block

K_SCALE = torch.tensor([0.004])


def _cache(kv_format: str, lens: list[int], page: int, key, extra_pages: int = 3):
    ks = K_SCALE if kv_format == "fp8_e4m3" else None
    cache = make_paged_cache(lens, page, 576, generator=gen("triton-fp8", kv_format, key), scale=0.3,
                             extra_pages=extra_pages,
                             kv_format=kv_format, k_scale=K_SCALE.item(),
                             encode=lambda rows: pagedmla.quantize_latent(rows, kv_format, k_scale=ks))
    kw = dict(k_scale=K_SCALE) if kv_format == "fp8_e4m3" else dict(is_fp8_kvcache=True)
    return cache, kw


def _decode(q, cache, lens, kw, provider):
    seqlens = torch.tensor(lens, dtype=torch.int32)
    md, ns = pagedmla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1, num_sm_parts=2)
    return pagedmla.flash_mla_with_kvcache(q, cache.k_cache, cache.block_table, seqlens, 512, md, ns, causal=True,
                                           provider=provider, **kw)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_nan_in_a_live_fp8_value_poisons_its_request_only(kv_format):
    lens = [9, 20]
    cache, kw = _cache(kv_format, lens, 16, "nan")
    page = cache.pages[1][0]
    cache.k_cache.view(torch.uint8)[page, 3, 0, 7] = 0x7F  # a latent code of request 1's token 3: NaN
    q = torch.randn(2, 1, 4, 576, generator=gen("triton-fp8-nan-q")).half()
    for provider in ("torch", "triton"):
        out, lse = _decode(q, cache, lens, kw, provider)
        assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all(), provider
        qo = torch.tensor([0, 1, 2], dtype=torch.int32)
        out_v, _ = pagedmla.flash_mla_varlen_with_kvcache(q[:, 0], cache.k_cache, cache.block_table,
                                                          torch.tensor(lens, dtype=torch.int32), qo, 512,
                                                          provider=provider, **kw)
        assert torch.isfinite(out_v[0]).all() and torch.isnan(out_v[1]).all(), provider


def test_decode_reads_flashmla_padded_page_stride():
    """FlashMLA's quantiser strides pages by page_size + 1 rows: the decode kernel reads that view in place."""
    lens = [5, 40]
    cache, kw = _cache("fp8_ds_mla", lens, 16, "padded")
    padded = torch.zeros(cache.k_cache.shape[0], 17, 1, 656, dtype=torch.float8_e4m3fn)[:, :16]
    padded.view(torch.uint8).copy_(cache.k_cache)
    q = torch.randn(2, 2, 4, 576, generator=gen("triton-fp8-padded-q")).half()
    ref, ref_lse = _decode(q, cache, lens, kw, "torch")
    out, lse = _decode(q, cache._replace(k_cache=padded), lens, kw, "triton")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_hopper_kernels_name_what_an_fp8_cache_needs(kv_format):
    """A forced Hopper config off an sm_90 GPU (this machine) is refused by name; the paged prefill's names
    its dequantise-first path."""
    lens = [4]
    cache, kw = _cache(kv_format, lens, 64, "hopper")
    ks = kw.get("k_scale")
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(1, 1, 32, 576, generator=gen("triton-fp8-hopper-q")).half()
    md, ns = pagedmla.get_mla_metadata(seqlens, 32, 1)
    with pytest.raises(ValueError, match="^config: use_sm90 needs an sm_90 GPU"):
        paged_decode_triton(q, cache.k_cache, cache.block_table, seqlens, 512, md, ns, 576 ** -0.5, True,
                            config=DecodeConfig(block_m=64, use_sm90=True), kv_format=kv_format, k_scale=ks)
    # The paged prefill runs the Hopper kernel over dequantised pages, which this machine (CPU) cannot.
    with pytest.raises(ValueError, match="^config: use_sm90 over a fp8_.* cache needs its pages dequantised first"):
        paged_varlen_attention(q[0], cache.k_cache, cache.block_table, seqlens, torch.tensor([0, 1], dtype=torch.int32),
                               512, 576 ** -0.5, True, config=PrefillConfig(use_sm90=True), kv_format=kv_format,
                               k_scale=ks)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_decode_64_row_tiles(kv_format):
    """More than 32 query rows per request: the FP8 64-row config (four 128-column chunks), against the oracle."""
    lens = [1, 40]
    cache, kw = _cache(kv_format, lens, 16, "rows64")
    q = (torch.randn(2, 2, 32, 576, generator=gen("triton-fp8-rows64-q")) * 0.3).half()
    cfg = select_config(q, cache.k_cache, 512, None, kv_format)
    assert (cfg.block_m, cfg.chunks, cfg.use_tma, cfg.use_sm90) == (64, 4, False, False)
    out, lse = _decode(q, cache, lens, kw, "triton")
    ref_out, ref_lse = dense_paged(q.reshape(4, 32, 576), [0, 2, 4], cache.rows, 576 ** -0.5, True, 512)
    assert_attention_close(out, lse, ref_out.reshape(2, 2, 32, 512), ref_lse.reshape(2, 2, 32).transpose(1, 2),
                           TOLERANCES[torch.float16], kv_format)
    assert cos_diff(out, ref_out.reshape(2, 2, 32, 512)) < 1e-5


def test_negative_k_scale_reads_as_its_sign_says():
    """fp8_e4m3's k_scale is folded into the softmax scale, so a negative one (value = fp8 x k_scale, whatever
    its sign) flips the scores' sign: the Triton decode and paged prefill must still match the reference
    (the unmasked softmax of the paged prefill takes the row max before scaling, which needs a positive
    scale: with the wrong max, exp2 overflows once the scores spread widely)."""
    lens = [40, 70]
    scale = torch.tensor([-0.004])
    cache = make_paged_cache(lens, 16, 576, generator=gen("triton-fp8-negative"), scale=0.3, kv_format="fp8_e4m3",
                             k_scale=scale.item(),
                             encode=lambda rows: pagedmla.quantize_latent(rows, "fp8_e4m3", k_scale=scale))
    q = torch.randn(2, 1, 4, 576, generator=gen("triton-fp8-negative-q")).half()
    kw = dict(k_scale=scale)
    outs = {p: _decode(q, cache, lens, kw, p) for p in ("torch", "triton")}
    assert_attention_close(*outs["triton"], *outs["torch"], TOLERANCES[torch.float16], "decode")
    seqlens = torch.tensor(lens, dtype=torch.int32)
    # Scores spread over hundreds (in log2 units) so that a row max taken before a negative scale overflows.
    qv = (torch.randn(2 * 20, 4, 576, generator=gen("triton-fp8-negative-qv")) * 300).half()
    qo = torch.tensor([0, 20, 40], dtype=torch.int32)
    varlen = {p: pagedmla.flash_mla_varlen_with_kvcache(qv, cache.k_cache, cache.block_table, seqlens, qo, 512,
                                                        provider=p, **kw) for p in ("torch", "triton")}
    assert all(torch.isfinite(t).all() for t in varlen["triton"])
    assert_attention_close(*varlen["triton"], *varlen["torch"], TOLERANCES[torch.float16], "paged prefill")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_e4m3_decode_takes_query_rows_of_any_magnitude(device):
    """The fp8_e4m3 decode runs its dots in fp16 on query rows scaled by a power of two into fp16's range
    (``common.fp16_row_scale``): a row far above 2^15 (beyond fp16 altogether in bf16 on the GPU, where it
    would overflow unscaled), one of ordinary size, a tiny one and a zero row match the oracle. The small
    softmax scale keeps the large row's scores moderate."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    lens = [37, 70]
    cache, kw = _cache("fp8_e4m3", lens, 16, "magnitudes")
    heads = 4
    q = torch.randn(2, 1, heads, 576, generator=gen("triton-fp8-magnitudes-q"))
    big = 1e5 if dtype == torch.bfloat16 else 4e4
    q[:, :, 0] *= big / q[:, :, 0].abs().amax()
    q[:, :, 2] *= 1e-6
    q[:, :, 3] = 0.0
    q = q.to(dtype)
    scale = 1e-4
    seqlens = torch.tensor(lens, dtype=torch.int32)
    md, ns = pagedmla.get_mla_metadata(seqlens, heads, 1, num_sm_parts=2)
    dev = dict(device=device)
    out, lse = pagedmla.flash_mla_with_kvcache(
        q.to(**dev), cache.k_cache.to(**dev), cache.block_table.to(**dev), seqlens.to(**dev), 512, md.to(**dev),
        ns.to(**dev), softmax_scale=scale, causal=True, provider="triton", k_scale=kw["k_scale"].to(**dev))
    ref_out, ref_lse = dense_paged(q.reshape(2, heads, 576), [0, 1, 2], cache.rows, scale, True, 512)
    assert_attention_close(out.cpu(), lse.cpu(), ref_out.reshape(2, 1, heads, 512),
                           ref_lse.reshape(2, 1, heads).transpose(1, 2), TOLERANCES[dtype], "decode")
    assert cos_diff(out.cpu(), ref_out.reshape(2, 1, heads, 512)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 32, 64])
def test_repeated_fp8_decode_calls_read_their_own_cache_and_scale(kv_format, heads):
    """A call shape's second and later calls launch the bound kernel (``launch.BoundLaunch``) with only the
    addresses changed: each call must read its own cache, q and (fp8_e4m3) k_scale: the Hopper kernel by TMA
    (pages of 64; its narrow form up to 32 query rows), the portable one by pointer loads (pages of 16), which
    up to 32 rows reads the latent bytes as words (``decode.fp8_pairs``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lens = [70, 130, 1]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for page in (16, 64):
        md, ns = pagedmla.get_mla_metadata(seqlens, heads, 1)
        for call in range(3):
            scale = torch.tensor([0.004 * (call + 1)])
            ks = scale if kv_format == "fp8_e4m3" else None
            cache = make_paged_cache(lens, page, 576, generator=gen("triton-fp8-bound", kv_format, heads, page, call),
                                     scale=0.3, kv_format=kv_format, k_scale=scale.item(),
                                     encode=lambda rows, ks=ks: pagedmla.quantize_latent(rows, kv_format, k_scale=ks))
            kw = dict(k_scale=scale.cuda()) if kv_format == "fp8_e4m3" else dict(is_fp8_kvcache=True)
            q = torch.randn(3, 1, heads, 576, generator=gen("triton-fp8-bound-q", heads, page, call)).bfloat16()
            out, lse = pagedmla.flash_mla_with_kvcache(q.cuda(), cache.k_cache.cuda(), cache.block_table.cuda(),
                                                       seqlens, 512, md, ns, causal=True, provider="triton", **kw)
            ref_out, ref_lse = dense_paged(q.reshape(3, heads, 576), [0, 1, 2, 3], cache.rows, 576 ** -0.5, True, 512)
            assert_attention_close(out.cpu(), lse.cpu(), ref_out.reshape(3, 1, heads, 512),
                                   ref_lse.reshape(3, 1, heads).transpose(1, 2), TOLERANCES[torch.bfloat16], kv_format)


def test_word_reads_need_even_rows():
    """The words of ``decode.fp8_pairs`` are read through int16 pointers: an fp8_e4m3 cache whose rows start at
    odd addresses (carved out of a byte buffer at offset 1) runs the byte reads instead, and still matches the
    reference; the same cache at an even address reads words."""
    from pagedmla.kernels.triton.decode import DecodeConfig as Cfg
    from pagedmla.kernels.triton.decode import _portable_main_args

    lens = [37, 70]
    cache, kw = _cache("fp8_e4m3", lens, 16, "odd")
    n = cache.k_cache.numel()
    odd, even = (torch.empty(n + 2, dtype=torch.uint8)[at:at + n].view(torch.float8_e4m3fn).view(cache.k_cache.shape)
                 for at in (1, 2))
    for c in (odd, even):
        c.view(torch.uint8).copy_(cache.k_cache.view(torch.uint8))
    assert odd.data_ptr() % 2 == 1 and even.data_ptr() % 2 == 0
    q = torch.randn(2, 1, 16, 576, generator=gen("triton-fp8-odd-q")).half()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    md, ns = pagedmla.get_mla_metadata(seqlens, 16, 1, num_sm_parts=2)
    cfg = Cfg(block_m=16, block_n=32, num_warps=4, num_stages=3, chunks=4, use_tma=True, carry_pages=True)
    out, lse = torch.empty(2, 1, 16, 512, dtype=q.dtype), torch.empty(2, 16, 1)
    for k_cache, words in ((odd, False), (even, True)):
        *_, options = _portable_main_args(q, k_cache, cache.block_table, seqlens, md, ns, 576 ** -0.5, True, cfg,
                                          out, lse, torch.empty(1), torch.zeros(1, dtype=torch.int32),
                                          "fp8_e4m3", kw["k_scale"])
        assert options["PAIRS"] is words
        got = _decode(q, cache._replace(k_cache=k_cache), lens, kw, "triton")
        ref = _decode(q, cache, lens, kw, "torch")
        assert_attention_close(*got, *ref, TOLERANCES[torch.float16], "decode")


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("page", [16, 64])
def test_dequantize_pages_writes_each_referenced_page(kv_format, page):
    """Request b's page j (below its length) lands in workspace page b * width + j as the format's values (fp8_e4m3
    without k_scale), a bad page id names page -1, pages past a length keep their own (unwritten) page."""
    lens = [2 * page + 1, page, 0]
    cache, _ = _cache(kv_format, lens, page, f"dequant-{page}")
    table = cache.block_table.clone()
    table[1, 0] = 10 ** 6  # request 1's only page: outside the cache
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ws, ws_table = dequantize_pages(cache.k_cache, table, seqlens, kv_format, torch.float16)
    b, width = table.shape
    assert ws.shape == (b * width, page, 1, 576) and ws_table.shape == (b, width)
    one = torch.ones(1) if kv_format == "fp8_e4m3" else None
    for r in range(b):
        for j in range(width):
            want = -1 if (r, j) == (1, 0) else r * width + j
            assert ws_table[r, j].item() == want, (r, j)
            if j * page < lens[r] and want >= 0:
                raw = cache.k_cache[table[r, j]].reshape(page, -1)
                ref = pagedmla.dequantize_latent(raw, kv_format, k_scale=one, dtype=torch.float32)
                # The values rounded once to the workspace's dtype (fp16 here; ds_mla's bf16 rope columns are exact
                # only in bf16), the poisoned slots after a request's last token included (NaN in every field).
                torch.testing.assert_close(ws[want, :, 0].float(), ref.half().float(), rtol=0, atol=0, equal_nan=True)


def _page_indptr(lens: list[int], page: int) -> list[int]:
    """Prefix sums of the pages each length spans (the backend's ``kv_page_indptr``)."""
    out = [0]
    for n in lens:
        out.append(out[-1] + -(-n // page))
    return out


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_dequantize_pages_packs_the_pages_host_lengths_span(kv_format):
    """With ``kv_page_indptr`` request b's page j lands in workspace page kv_page_indptr[b] + j, the same values
    as without the layout, and the workspace holds the spanned pages only; a device length past its host span
    (request 1: one page more than the host said) names page -1 for that page alone and sets ``PAGE_LAYOUT``.
    Every load and store stays inside the launch's tensors (the workspace included) and the inputs' margins
    stay intact."""
    page = 16
    lens = [2 * page + 1, page + 3, 0, 5, 40]
    host = [2 * page + 1, page, 0, 5, 40]  # request 1's device length is one page past the host's
    cache, _ = _cache(kv_format, lens, page, "dequant-compact")
    table, seqlens = guarded(cache.block_table), guarded(torch.tensor(lens, dtype=torch.int32))
    indptr = _page_indptr(host, page)
    total = indptr[-1]
    dev_indptr = guarded(torch.tensor(indptr, dtype=torch.int32))
    errors.device_errors(table.device)
    with checked_accesses() as log:
        ws, ws_table = dequantize_pages(cache.k_cache, table, seqlens, kv_format, torch.float16, dev_indptr, total)
    assert log.launches == 1 and not log.violations, log.violations
    assert errors.device_errors(table.device) == errors.PAGE_LAYOUT
    full, full_table = dequantize_pages(cache.k_cache, table, seqlens, kv_format, torch.float16)
    assert ws.shape == (total, page, 1, 576) and ws_table.shape == table.shape
    for r in range(len(lens)):
        for j in range(-(-lens[r] // page)):
            want = indptr[r] + j if j < indptr[r + 1] - indptr[r] else -1
            assert ws_table[r, j].item() == want, (r, j)
            if want >= 0:
                torch.testing.assert_close(ws[want], full[full_table[r, j]], rtol=0, atol=0, equal_nan=True)
    assert ws_table[1, 1].item() == -1 and margins_intact(table, seqlens, dev_indptr)


@pytest.mark.parametrize("layout", ["overlapping", "decreasing", "wrapping", "negative start", "short end",
                                    "long end"])
def test_dequantize_pages_refuses_a_layout_that_is_not_a_partition(layout):
    """Spans that overlap would hand one request another's rows, so a layout that is not a partition of the
    num_kv_pages pages (0 first, non-decreasing, num_kv_pages last) gives no request a page: -1 wherever a length
    reads, ``PAGE_LAYOUT`` set, and every access inside the launch's tensors, for entries near 2^31 too."""
    page = 16
    lens = [3 * page, 0, 2 * page, page]
    cache, _ = _cache("fp8_ds_mla", lens, page, "dequant-partition")
    total = 6
    indptr = {"overlapping": [0, 3, 1, 4, 6], "decreasing": [0, 3, 3, 2, 6], "wrapping": [0, 1, -(2 ** 31), 2, 6],
              "negative start": [-1, 3, 3, 5, 6], "short end": [0, 3, 3, 5, 5],
              "long end": [0, 3, 3, 5, 2 ** 31 - 1]}[layout]
    table, seqlens = guarded(cache.block_table), guarded(torch.tensor(lens, dtype=torch.int32))
    dev_indptr = guarded(torch.tensor(indptr, dtype=torch.int32))
    errors.device_errors(table.device)
    with checked_accesses() as log:
        _, ws_table = dequantize_pages(cache.k_cache, table, seqlens, "fp8_ds_mla", torch.float16, dev_indptr,
                                       total)
    assert not log.violations, log.violations
    assert errors.device_errors(table.device) == errors.PAGE_LAYOUT
    for r, n in enumerate(lens):
        assert (ws_table[r, : -(-n // page)] == -1).all(), r
    assert margins_intact(table, seqlens, dev_indptr)


def test_dequantize_pages_checks_the_layout_on_the_host():
    cache, _ = _cache("fp8_ds_mla", [3], 16, "dequant-layout-args")
    args = (cache.k_cache, cache.block_table, torch.tensor([3], dtype=torch.int32), "fp8_ds_mla", torch.float16)
    with pytest.raises(ValueError, match="kv_page_indptr / num_kv_pages: give both or neither"):
        dequantize_pages(*args, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_page_indptr: expected 2 entries"):
        dequantize_pages(*args, torch.tensor([0, 1, 2], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="kv_page_indptr: expected dtype in \\(int32\\)"):
        dequantize_pages(*args, torch.tensor([0, 1]), 1)
    with pytest.raises(ValueError, match="num_kv_pages: expected an int >= 0"):
        dequantize_pages(*args, torch.tensor([0, 1], dtype=torch.int32), -1)


def _paged_prefill_case(kv_format: str, key: str, lens: list[int], new: list[int], heads: int):
    # Enough poisoned pages beside the requests' that the workspace (a page per table entry) fits the cache's
    # page count (``dequantize_first``).
    cache, kw = _cache(kv_format, lens, 64, key, extra_pages=len(lens) * (-(-max(lens) // 64) + 1))
    g = gen("triton-fp8-dequant-q", kv_format, key)
    qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = (torch.randn(int(qo[-1]), heads, 576, generator=g) * 0.5).bfloat16()
    return cache, kw, q, qo


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
def test_dequantise_first_prefill_matches_the_reference(kv_format, heads):
    """On sm_90 the FP8 paged prefill dequantises the referenced pages and runs the Hopper kernel (k_scale folded
    into the scores and outputs): against the float64 oracle on the dequantised rows, NaN in every unused slot,
    permuted pages; the same bf16 tolerance as the bf16 cache's, and the portable FP8 kernel beside it."""
    lens, new = [1, 64, 65, 300, 1000], [1, 64, 17, 300, 129]
    cache, kw, q, qo = _paged_prefill_case(kv_format, f"ref-{heads}", lens, new, heads)
    dev = torch.device("cuda")
    k_cache, table = cache.k_cache.to(dev), cache.block_table.to(dev)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    ks = kw.get("k_scale")
    ks = None if ks is None else ks.to(dev)
    assert dequantize_first(q.to(dev), k_cache, table, 512)
    ref, ref_lse = dense_paged(q.double(), qo.tolist(), cache.rows, 576 ** -0.5, True, 512)
    for config in (None, PrefillConfig(use_sm90=False)):
        out, lse = paged_varlen_attention(q.to(dev), k_cache, table, seqlens, qo.to(dev), 512, 576 ** -0.5, True,
                                          config=config, kv_format=kv_format, k_scale=ks)
        assert_attention_close(out.cpu(), lse.cpu(), ref, ref_lse, TOLERANCES[torch.bfloat16], f"{config}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_dequantise_first_prefill_poisons_a_bad_page_only(kv_format):
    """A page id outside the cache in request 1's table: its rows that read the page are NaN (and the error word
    says BLOCK_TABLE), the other requests' outputs bit-identical to a clean run."""
    lens, new = [130, 200, 70], [2, 64, 70]
    cache, kw, q, qo = _paged_prefill_case(kv_format, "bad-page", lens, new, 16)
    dev = torch.device("cuda")
    k_cache, seqlens = cache.k_cache.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
    ks = kw.get("k_scale")
    ks = None if ks is None else ks.to(dev)
    clean = cache.block_table.to(dev)
    bad = clean.clone()
    bad[1, 0] = 10 ** 6
    args = (q.to(dev), k_cache)
    assert dequantize_first(args[0], k_cache, clean, 512)
    out0, lse0 = paged_varlen_attention(*args, clean, seqlens, qo.to(dev), 512, 576 ** -0.5, True,
                                        kv_format=kv_format, k_scale=ks)
    errors.device_errors(dev)
    out1, lse1 = paged_varlen_attention(*args, bad, seqlens, qo.to(dev), 512, 576 ** -0.5, True,
                                        kv_format=kv_format, k_scale=ks)
    lo, hi = int(qo[1]), int(qo[2])
    assert torch.equal(out1[:lo], out0[:lo]) and torch.equal(out1[hi:], out0[hi:])
    assert torch.equal(lse1[:lo], lse0[:lo]) and torch.equal(lse1[hi:], lse0[hi:])
    assert torch.isnan(out1[lo:hi]).all() and torch.isnan(lse1[lo:hi]).all()
    assert errors.device_errors(dev) & errors.BLOCK_TABLE


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_dequantise_first_sizes_the_workspace_by_the_host_lengths(kv_format):
    """One long request among short ones (the backend's skewed extend): a workspace page per table entry would
    exceed the cache's pages, so without a page layout the portable kernel runs; with ``kv_page_indptr`` the
    workspace holds the pages the lengths span and the Hopper kernel runs (the public call, which passes the
    layout to the triton provider). Both against the float64 oracle (NaN in every unused slot, permuted
    pages); then a device length one page past its host span (request 2) makes that request's rows NaN and
    reports ``PAGE_LAYOUT``, the others bit-identical to the clean run."""
    lens, new = [2000, 3, 70, 1, 130], [16, 3, 5, 1, 64]
    cache, kw = _cache(kv_format, lens, 64, "compact", extra_pages=2)
    dev = torch.device("cuda")
    g = gen("triton-fp8-compact-q", kv_format)
    qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = (torch.randn(sum(new), 16, 576, generator=g) * 0.5).bfloat16().to(dev)
    k_cache, table = cache.k_cache.to(dev), cache.block_table.to(dev)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    pages = _page_indptr(lens, 64)
    indptr = torch.tensor(pages, dtype=torch.int32, device=dev)
    assert table.shape[0] * table.shape[1] > k_cache.shape[0] >= pages[-1]
    assert not dequantize_first(q, k_cache, table, 512) and dequantize_first(q, k_cache, table, 512, pages[-1])
    ref, ref_lse = dense_paged(q.cpu().double(), qo.tolist(), cache.rows, 576 ** -0.5, True, 512)
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    call = functools.partial(pagedmla.flash_mla_varlen_with_kvcache, q, k_cache, table, seqlens, qo, 512,
                             576 ** -0.5, True, provider="triton", **kw)
    compact = call(kv_page_indptr=indptr, num_kv_pages=pages[-1])
    for name, (out, lse) in (("compact", compact), ("portable", call())):
        assert_attention_close(out.cpu(), lse.cpu(), ref, ref_lse, TOLERANCES[torch.bfloat16], name)
    short = _page_indptr([2000, 3, 64, 1, 130], 64)  # the host thinks request 2 spans one page
    errors.device_errors(dev)
    out1, lse1 = call(kv_page_indptr=torch.tensor(short, dtype=torch.int32, device=dev), num_kv_pages=short[-1])
    assert errors.device_errors(dev) & errors.PAGE_LAYOUT
    lo, hi = new[0] + new[1], new[0] + new[1] + new[2]
    assert torch.isnan(out1[lo:hi]).all() and torch.isnan(lse1[lo:hi]).all()
    for a, b in ((out1, compact[0]), (lse1, compact[1])):
        assert torch.equal(a[:lo], b[:lo]) and torch.equal(a[hi:], b[hi:])


def _hopper_fp8_case(kv_format, lens, q_len, heads, key):
    """A GPU FP8 decode case on the Hopper kernel's pages (64): (q, cache, seqlens, metadata, keywords)."""
    cache, kw = _cache(kv_format, lens, 64, key)
    q = (torch.randn(len(lens), q_len, heads, 576, generator=gen("triton-fp8-sm90-q", key)) * 2).bfloat16().cuda()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    md, ns = pagedmla.get_mla_metadata(seqlens, q_len * heads, 1, kv_format=kv_format)
    kw = {k: v.cuda() for k, v in kw.items() if isinstance(v, torch.Tensor)} | (
        {"is_fp8_kvcache": True} if kv_format == "fp8_ds_mla" else {})
    return q, cache, seqlens, (md, ns), kw


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("q_len, heads", [(1, 4), (1, 16), (2, 8), (3, 8), (2, 16), (1, 32), (1, 64), (2, 64),
                                          (1, 128), (2, 128)])
def test_gpu_hopper_fp8_decode_matches_the_oracle(kv_format, q_len, heads):
    """An FP8 cache runs the Hopper kernel (converted in shared memory) on sm_90: its narrow form (S^T = K Q^T
    over a 16- or 32-row Q tile, padding rows included at 4 / 24 rows) where ``narrow_block`` picks it, the
    64-row tiles above 32 rows, and the portable kernel for fp8_e4m3 up to 16 rows under a schedule planned
    for that format (two parts per SM); a schedule planned without the format (one part per SM) runs the
    narrow form there, and the narrow form is also forced on every request of up to 32 rows. Against the
    float64 oracle on the dequantised rows, lengths 0 / 1 / 63 / 64 / 65 and long ones, scattered pages, NaN
    in every unused slot (of the requests' last pages too), bf16 queries of magnitude ~2."""
    if not torch.cuda.is_available() or not sm90_fp8_supported(
            torch.empty(1, 576, dtype=torch.bfloat16, device="cuda"),
            torch.empty(1, 64, 1, 576 if kv_format == "fp8_e4m3" else 656, dtype=torch.uint8, device="cuda"), 512,
            kv_format):
        pytest.skip("needs an sm_90 GPU with Gluon")
    lens = [0, 1, 63, 64, 65, 700, 1500]
    q, cache, seqlens, (md, ns), kw = _hopper_fp8_case(kv_format, lens, q_len, heads, (q_len, heads))
    k_cache = cache.k_cache.cuda()
    rows = q_len * heads
    narrow = narrow_block(rows, kv_format)
    cfg = select_config(q, k_cache, 512, None, kv_format, md.shape[0])
    assert cfg.use_sm90 == (rows > 16 or narrow is not None) and cfg.block_m == (narrow or (64 if rows > 16 else 16))
    plain_md, plain_ns = pagedmla.get_mla_metadata(seqlens, rows, 1)  # planned as for a 16-bit cache
    plain = select_config(q, k_cache, 512, None, kv_format, plain_md.shape[0])
    assert plain.use_sm90 and plain.block_m == (16 if rows <= 16 else 32 if rows <= 32 else 64), plain
    b = len(lens)
    qo = [q_len * i for i in range(b + 1)]
    ref_out, ref_lse = dense_paged(q.cpu().reshape(b * q_len, heads, 576), qo, cache.rows, 576 ** -0.5, True, 512)
    ref_out = ref_out.reshape(b, q_len, heads, 512)
    ref_lse = ref_lse.reshape(b, q_len, heads).transpose(1, 2)
    live = torch.tensor(lens) > 0
    results = [pagedmla.flash_mla_with_kvcache(q, k_cache, cache.block_table.cuda(), seqlens, 512, md, ns,
                                               causal=True, provider="triton", **kw)]
    if plain != cfg:
        results.append(pagedmla.flash_mla_with_kvcache(q, k_cache, cache.block_table.cuda(), seqlens, 512, plain_md,
                                                       plain_ns, causal=True, provider="triton", **kw))
    if rows <= 32:
        forced = DecodeConfig(block_m=16 if rows <= 16 else 32, use_sm90=True)
        results.append(paged_decode_triton(q, k_cache, cache.block_table.cuda(), seqlens, 512, md, ns, 576 ** -0.5,
                                           True, config=forced, kv_format=kv_format, k_scale=kw.get("k_scale")))
    for out, lse in results:
        assert_attention_close(out.cpu(), lse.cpu(), ref_out, ref_lse, TOLERANCES[torch.bfloat16], kv_format)
        assert cos_diff(out.cpu()[live], ref_out[live]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 64])
def test_gpu_hopper_fp8_decode_poisons_a_bad_page_only(kv_format, heads):
    """A page id beyond the cache in one request's block table: that request's rows are NaN and the error word
    names the block table; every other request's result is bit-identical to a clean run's (16 heads: the
    narrow form on fp8_ds_mla, the portable kernel on fp8_e4m3 and, under a schedule planned without the
    format, its narrow form; 64 heads: the 64-row tiles)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lens = [300, 200, 130]
    q, cache, seqlens, schedule, kw = _hopper_fp8_case(kv_format, lens, 1, heads, ("bad-page", heads))
    k_cache, table = cache.k_cache.cuda(), cache.block_table.cuda()
    if not sm90_fp8_supported(q, k_cache, 512, kv_format):
        pytest.skip("needs an sm_90 GPU with Gluon")
    plain = pagedmla.get_mla_metadata(seqlens, heads, 1)  # planned without the format
    schedules = [schedule] + ([plain] if plain[0].shape != schedule[0].shape else [])
    bad = table.clone()
    bad[1, 2] = k_cache.shape[0] + 10 ** 6
    for md, ns in schedules:
        clean = pagedmla.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, md, ns, causal=True,
                                                provider="triton", **kw)
        errors.device_errors(q.device)
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, bad, seqlens, 512, md, ns, causal=True,
                                                   provider="triton", **kw)
        assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
        for i in (0, 2):
            assert torch.equal(out[i], clean[0][i]) and torch.equal(lse[i], clean[1][i])
        assert errors.device_errors(q.device) & errors.BLOCK_TABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 64])
def test_gpu_hopper_fp8_decode_takes_a_negative_k_scale(heads):
    """value = fp8 x k_scale whatever its sign: the Hopper kernel moves a negative scale's sign into Q (its
    softmax keeps unscaled row maxima, which need a positive score scale), so scores spread over hundreds in
    log2 units must still match the oracle instead of overflowing (32 heads: the narrow form; 64: the 64-row
    tiles)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lens = [700, 130]
    scale = torch.tensor([-0.004])
    cache = make_paged_cache(lens, 64, 576, generator=gen("triton-fp8-sm90-negative"), scale=0.3,
                             kv_format="fp8_e4m3", k_scale=scale.item(),
                             encode=lambda rows: pagedmla.quantize_latent(rows, "fp8_e4m3", k_scale=scale))
    q = (torch.randn(2, 1, heads, 576, generator=gen("triton-fp8-sm90-negative-q")) * 300).bfloat16()
    k_cache = cache.k_cache.cuda()
    if not sm90_fp8_supported(q.cuda(), k_cache, 512, "fp8_e4m3"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    md, ns = pagedmla.get_mla_metadata(seqlens, heads, 1)
    out, lse = pagedmla.flash_mla_with_kvcache(q.cuda(), k_cache, cache.block_table.cuda(), seqlens, 512, md, ns,
                                               causal=True, provider="triton", k_scale=scale.cuda())
    ref_out, ref_lse = dense_paged(q.reshape(2, heads, 576), [0, 1, 2], cache.rows, 576 ** -0.5, True, 512)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_attention_close(out.cpu(), lse.cpu(), ref_out.reshape(2, 1, heads, 512),
                           ref_lse.reshape(2, 1, heads).transpose(1, 2), TOLERANCES[torch.bfloat16], "fp8_e4m3")
