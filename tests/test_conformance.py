"""Every op x every available provider against the float64 oracle (``tests/oracle.py``), on one cache builder.

The public calls (``pagedmla.flash_mla_with_kvcache``, ``flash_mla_varlen_with_kvcache``,
``flash_attn_varlen_func``, ``merge_state``) with ``provider=`` set: ``torch`` everywhere; ``triton`` on CPU
under the interpreter (fp16 / fp32, small shapes: the interpreter's dot is wrong for bf16) and compiled on
CUDA (the ``gpu`` mark: bf16 / fp16 at FlashMLA's test sizes). Paged caches come from
``oracle.make_paged_cache``: pages in permuted order, page 0, spare pages and every slot past a request's
tokens NaN, so a read outside a request's tokens poisons its rows. Each case lists the devices and dtypes it
runs in; every provider runs every case.

Besides the oracle's relative tolerances, each op has the bounds the Triton kernel files held before they
moved here (``Bounds``: elementwise, norm and per-row errors, FlashMLA's cosine metric, absolute LSE error,
exact zeros for rows without keys). The kernel files reuse the input builders and ``check_*`` runners below
for what is specific to them (configs, launch buffers, forced Hopper paths).

FP8 caches (cases with a ``kv_format``: ``fp8_e4m3`` with its k_scale, ``fp8_ds_mla`` behind ``is_fp8_kvcache``)
come from the same builder through ``pagedmla.quantize_latent``; the oracle attends over the rows decoded from
their bytes by hand (``oracle.decode_fp8_rows``), and every provider's result must also be within FlashMLA's
cosine difference of 1e-5 of it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

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
    merge_inputs,
)

import pagedmla
from pagedmla.ops import available_providers

F16, F32, BF16, F64 = torch.float16, torch.float32, torch.bfloat16, torch.float64
CPU, CUDA, BOTH = ("cpu",), ("cuda",), ("cpu", "cuda")
DTYPES = {"cpu": (F32, F16), "cuda": (BF16, F16)}
PROVIDERS = ("torch", "triton")


# ----------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------

class Bounds(NamedTuple):
    """Checks on top of ``assert_attention_close``; a None field is not checked."""

    atol: float | None = None  # elementwise: |out - ref| <= atol + rtol |ref|
    rtol: float = 0.0
    norm: float | None = None  # ||out - ref|| / ||ref|| < norm
    row: float | None = None  # per row: max |out - ref| / max(max |ref|, 1e-3) < row
    cos: float | None = None  # cos_diff of out, and of the finite LSEs, < cos
    lse_atol: float = 0.0  # finite LSEs: |lse - ref| <= lse_atol + lse_rtol |ref|
    lse_rtol: float = 0.0


# The former Triton kernel files' checks, by (device, dtype); CPU cases compare with the oracle on the same
# rounded inputs, so fp16 P / output rounding (2**-11 relative each) is all that is left.
DECODE_BOUNDS = {
    ("cpu", F16): Bounds(atol=6e-4, rtol=4e-3, cos=1e-5, lse_atol=1e-4, lse_rtol=1e-5),
    ("cpu", F32): Bounds(atol=1e-5, rtol=1e-5, cos=1e-5, lse_atol=1e-4, lse_rtol=1e-5),
    ("cuda", BF16): Bounds(atol=1e-2, rtol=2e-2, cos=1e-5, lse_atol=1e-4, lse_rtol=1e-5),
    ("cuda", F16): Bounds(atol=1e-2, rtol=2e-2, cos=1e-5, lse_atol=1e-4, lse_rtol=1e-5),
}
PREFILL_BOUNDS = {
    ("cpu", F16): Bounds(norm=2e-3, row=6e-2, lse_atol=1e-4),
    ("cpu", F32): Bounds(norm=1e-5, row=3e-4, lse_atol=1e-4),
    ("cuda", BF16): Bounds(norm=1e-2, cos=1e-4, lse_atol=1e-2),
}
MERGE_BOUNDS = {
    ("cpu", F16): Bounds(norm=1e-3, lse_atol=1e-5),
    ("cpu", F32): Bounds(norm=1e-6, lse_atol=1e-5),
    ("cuda", BF16): Bounds(norm=1e-2, lse_atol=1e-4),
}


def assert_bounds(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                  bounds: Bounds | None, what: str = "") -> None:
    """``bounds`` on out [..., Dv] and lse [...] (one LSE per out row) against the oracle's float64 results."""
    if bounds is None:
        return
    tag = f" [{what}]" if what else ""
    o, r = out.detach().double().cpu(), ref_out.double()
    s, e = lse.detach().double().cpu(), ref_lse.double()
    empty = torch.isneginf(e)
    assert (o[empty] == 0).all(), f"rows without keys must output exactly 0{tag}"
    if bounds.atol is not None:
        torch.testing.assert_close(o, r, atol=bounds.atol, rtol=bounds.rtol, msg=lambda m: m + tag)
    if bounds.norm is not None and r.numel():
        err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < bounds.norm, f"out norm-relative error {err:.3e} >= {bounds.norm:.1e}{tag}"
    if bounds.row is not None and r.numel():
        err = ((o - r).abs().amax(dim=-1) / r.abs().amax(dim=-1).clamp_min(1e-3)).max().item()
        assert err < bounds.row, f"out per-row relative error {err:.3e} >= {bounds.row:.1e}{tag}"
    finite = ~empty
    if bounds.cos is not None:
        assert cos_diff(o, r) < bounds.cos, f"out cos_diff {cos_diff(o, r):.3e}{tag}"
        if finite.any():
            err = cos_diff(s[finite], e[finite])
            assert err < bounds.cos, f"lse cos_diff {err:.3e}{tag}"
    if finite.any():
        err = ((s[finite] - e[finite]).abs() - bounds.lse_rtol * e[finite].abs()).max().item()
        assert err <= bounds.lse_atol, f"lse error {err:.3e} > {bounds.lse_atol:.1e} (+ rtol){tag}"


def assert_matches(out, lse, ref_out, ref_lse, dtype, bounds: Bounds | None, what: str = "") -> None:
    """The oracle's comparison at ``TOLERANCES[dtype]``, then ``bounds``; lse holds one entry per out row."""
    assert_attention_close(out, lse, ref_out, ref_lse, TOLERANCES[dtype], what)
    assert_bounds(out, lse, ref_out, ref_lse, bounds, what)


# FP8 caches: an fp8_e4m3 layer scale that is not a power of two (fp8 x k_scale is then inexact in bf16: the
# kernels must fold it, not round it into the tiles); FlashMLA's FP8 acceptance, a cosine difference, on top.
FP8_K_SCALE = 1.3 / 448
FP8_COS = 1e-5


def paged_cache(lens: list[int], page: int, d: int, dtype: torch.dtype, g: torch.Generator, scale: float,
                kv_format: str | None):
    """``oracle.make_paged_cache`` of rows of ``dtype`` (kv_format None) or of an FP8 format's rows, stored by
    ``pagedmla.quantize_latent`` (fp8_e4m3 with ``FP8_K_SCALE``)."""
    if kv_format is None:
        return make_paged_cache(lens, page, d, dtype, generator=g, scale=scale)
    k_scale = torch.tensor([FP8_K_SCALE]) if kv_format == "fp8_e4m3" else None
    return make_paged_cache(lens, page, d, generator=g, scale=scale, kv_format=kv_format, k_scale=FP8_K_SCALE,
                            encode=lambda rows: pagedmla.quantize_latent(rows, kv_format, k_scale=k_scale))


def fp8_args(kv_format: str | None, device: str) -> dict:
    """The paged calls' keyword arguments for a ``paged_cache`` of ``kv_format`` (none for rows of q's dtype)."""
    if kv_format is None:
        return {}
    if kv_format == "fp8_e4m3":
        return {"k_scale": torch.tensor([FP8_K_SCALE], device=device)}
    return {"is_fp8_kvcache": True}


def assert_fp8_cos(out: torch.Tensor, ref_out: torch.Tensor, kv_format: str | None, what: str) -> None:
    """FlashMLA's FP8 acceptance on an FP8 case's output (nothing for a float cache)."""
    if kv_format is not None:
        diff = cos_diff(out, ref_out)
        assert diff < FP8_COS, f"cos diff {diff:.2e} [{what}]"


def strided_int32(values: list[int], device: str) -> torch.Tensor:
    """An int32 view with stride 2 whose skipped entries are huge: reading them would go far out of bounds."""
    return torch.tensor([[v, 1 << 20] for v in values], dtype=torch.int32, device=device)[:, 0]


def _int32(values: list[int], device: str, strided: bool) -> torch.Tensor:
    return strided_int32(values, device) if strided else torch.tensor(values, dtype=torch.int32, device=device)


def _indptr(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _bounds(table: dict, provider: str, device: str, dtype: torch.dtype) -> Bounds | None:
    # The kernel bounds were written for the Triton kernels; on CPU the torch provider meets them too.
    return table.get((device, dtype)) if provider == "triton" or device == "cpu" else None


def _skip_unavailable(op: str, provider: str) -> None:
    if provider not in available_providers(op):
        pytest.skip(f"{provider} does not implement {op} in this installation")


def _params(cases: list, variants: Callable | None = None) -> list:
    """pytest params (provider, device, dtype, case, variant) for every provider on each case's devices and
    dtypes, one per ``variants(case, device)`` (the case's causal values by default); CUDA ones carry the gpu
    mark."""
    out = []
    for case in cases:
        for device in case.devices:
            for variant in (variants(case, device) if variants else case.causal):
                for dtype in case.dtypes or DTYPES[device]:
                    for provider in getattr(case, "providers", PROVIDERS):
                        marks = [pytest.mark.gpu] if device == "cuda" else []
                        tag = {True: "causal", False: "full"}.get(variant, variant)
                        out.append(pytest.param(provider, device, dtype, case, variant, marks=marks,
                                                id=f"{case.name}-{tag}-{provider}-{device}-{str(dtype)[6:]}"))
    return out


# ----------------------------------------------------------------------------------------------------
# flash_mla_with_kvcache (op paged_decode)
# ----------------------------------------------------------------------------------------------------

class DecodeCase(NamedTuple):
    """Request KV lengths, q_len, heads, page size, forced parts (None: the default plan), dims; causal
    values, devices, dtypes (None: the device's) and providers to run; lengths as a strided view; the cache's
    FP8 format (None: rows of q's dtype)."""

    name: str
    lens: list
    q_len: int
    heads: int
    page: int
    parts: int | None
    d: int = 576
    dv: int = 512
    causal: tuple = (True, False)
    devices: tuple = CPU
    dtypes: tuple | None = None
    strided: bool = False
    providers: tuple = PROVIDERS
    kv_format: str | None = None


# The last decode case built: its causal and full variants (adjacent parameters) share one set of inputs, which
# for FlashMLA's batch-128 sizes (a million cached tokens) takes seconds to build and check.
_last_decode_inputs: dict = {}


def decode_inputs(case: DecodeCase, dtype: torch.dtype, device: str, key) -> tuple:
    """q [b, q_len, heads, d] and a poisoned paged cache (scale 0.25), on ``device``:
    (q, cache (oracle.PagedCache, CPU), k_cache, block_table, cache_seqlens). Read-only for the callers."""
    memo = (repr(case), str(dtype), device, repr(key))
    if memo not in _last_decode_inputs:
        _last_decode_inputs.clear()
        _last_decode_inputs[memo] = _build_decode_inputs(case, dtype, device, key)
    return _last_decode_inputs[memo]


def _build_decode_inputs(case: DecodeCase, dtype: torch.dtype, device: str, key) -> tuple:
    g = gen("decode", case.name, key, str(dtype))
    cache = paged_cache(case.lens, case.page, case.d, dtype, g, 0.25, case.kv_format)
    q = (torch.randn(len(case.lens), case.q_len, case.heads, case.d, generator=g, dtype=F64) * 0.25).to(dtype)
    return (q.to(device), cache, cache.k_cache.to(device), cache.block_table.to(device),
            _int32(case.lens, device, case.strided))


def check_paged_decode(call: Callable, case: DecodeCase, causal: bool, dtype: torch.dtype, device: str,
                       bounds: Bounds | None, key=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the case, schedule it (``case.parts``), run ``call(q, k_cache, block_table, cache_seqlens,
    head_dim_v, metadata, num_splits, causal) -> (out [b, q_len, h, dv], lse [b, h, q_len])`` (with an FP8
    case's ``fp8_args`` as keywords) and check it against the oracle. Returns (out, lse)."""
    q, cache, k_cache, table, seqlens = decode_inputs(case, dtype, device, key)
    b, q_len, heads, d = q.shape
    meta, splits = pagedmla.get_mla_metadata(seqlens, q_len * heads, 1, num_sm_parts=case.parts)
    out, lse = call(q, k_cache, table, seqlens, case.dv, meta, splits, causal, **fp8_args(case.kv_format, device))
    ref_out, ref_lse = dense_paged(q.reshape(b * q_len, heads, d), list(range(0, (b + 1) * q_len, q_len)),
                                   cache.rows, d ** -0.5, causal, case.dv)
    what = f"{case.name} causal={causal}"
    ref_out = ref_out.reshape(b, q_len, heads, case.dv)
    assert_matches(out, lse.transpose(1, 2), ref_out, ref_lse.reshape(b, q_len, heads), dtype, bounds, what)
    assert_fp8_cos(out, ref_out, case.kv_format, what)
    return out, lse


def _gpu_lens(b: int, mean: int, q_len: int, seed: int) -> list[int]:
    """Normal lengths around ``mean`` (FlashMLA's test batches), at least q_len."""
    g = torch.Generator().manual_seed(seed)
    return torch.normal(float(mean), mean / 2, (b,), generator=g).clamp(min=q_len).int().tolist()


def _random_decode_lens() -> list[int]:
    rng = random.Random(3)
    return [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 300)]) for _ in range(6)]


_RANDOM_DECODE = _random_decode_lens()
CAUSAL, FULL = (True,), (False,)
# FP8 caches: lengths at the page and 64-token edges, page sizes 1 / 16 / 64, both formats; the torch provider
# also with bf16 queries (the oracle's rows are the dequantised ones, so the tolerance is the query dtype's).
FP8_FORMATS = ("fp8_e4m3", "fp8_ds_mla")
FP8_LENS = [0, 1, 63, 64, 65]
FP8_PAGES = (1, 16, 64)
DECODE_CASES = [
    # Empty requests, lengths at and around page and 64-token block edges, forced splits over several parts.
    DecodeCase("edges", [0, 1, 63, 65, 130], 1, 16, 16, 4, devices=BOTH),
    DecodeCase("q2-page64", [64, 0, 17], 2, 3, 64, 3, devices=BOTH),
    DecodeCase("short-rows", [2, 70, 1], 3, 4, 16, 2, d=80, dv=64, devices=BOTH),  # request 0 shorter than q_len
    DecodeCase("blocks", [0, 1, 63, 64, 65], 1, 16, 16, 4, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("page1", [65, 0, 17, 64], 2, 3, 1, 3, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("q4", [64, 1, 63], 4, 16, 64, 5, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("heads128", [1, 63, 130], 1, 128, 64, 5, causal=FULL, dtypes=(F16,)),
    DecodeCase("heads64-short", [2, 70, 1], 3, 64, 16, 4, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("one-head-page1", [33, 0], 1, 1, 1, 2, causal=FULL, dtypes=(F16,)),
    DecodeCase("parts7", [200, 5, 129], 2, 16, 16, 7, causal=FULL, dtypes=(F16,)),
    DecodeCase("all-empty", [0, 0], 1, 16, 64, 3, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("one-request", [150], 1, 16, 64, 1, causal=CAUSAL, dtypes=(F16,)),
    # The empty request lies past every part's request range: the combine kernel writes it.
    DecodeCase("empty-last", [64, 0], 1, 16, 64, 1, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("two-empty", [65, 64, 0, 0, 3], 2, 16, 16, 3, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("random-parts6", _RANDOM_DECODE, 2, 16, 16, 6, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("random-default", _RANDOM_DECODE, 1, 64, 64, None, causal=FULL, dtypes=(F16,)),
    DecodeCase("d80", [0, 40, 100], 2, 3, 16, 3, d=80, dv=64, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("d64", [0, 40, 100], 2, 3, 16, 3, d=64, dv=64, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("fp32", [1, 65, 100], 1, 16, 16, 3, causal=CAUSAL, dtypes=(F32,)),
    DecodeCase("default-plan", [5, 64, 120], 2, 16, 16, None, causal=CAUSAL, dtypes=(F16,)),
    DecodeCase("strided-lens", [40, 70], 1, 4, 16, 3, d=128, dv=64, causal=CAUSAL, strided=True),
    DecodeCase("contiguous-lens", [40, 70], 1, 4, 16, 3, d=128, dv=64, causal=CAUSAL, dtypes=(F32,)),
    # CUDA: FlashMLA's test sizes (the Triton kernels: the torch provider on CUDA is the reference's own code),
    # every page size, odd head counts and q lengths.
    *[DecodeCase(f"flashmla-b{b}-mean{mean}-h{heads}-q{q_len}", _gpu_lens(b, mean, q_len, b * 7 + heads), q_len,
                 heads, 64, None, devices=CUDA, dtypes=(BF16,), providers=("triton",))
      for b in (1, 16, 128) for mean in (4096, 8193) for heads in (16, 64, 128) for q_len in (1, 2)],
    *[DecodeCase(f"page{page}", [0, 1, 63, 64, 65, 1000, 3000, 2], 2, 32, page, None, causal=CAUSAL, devices=CUDA)
      for page in (1, 16, 32, 128, 256)],
    *[DecodeCase(f"odd-h{heads}-q{q_len}", [0, 1, 7, 64, 65, 513, 4000], q_len, heads, 64, None, causal=CAUSAL,
                 devices=CUDA, dtypes=(BF16,)) for heads, q_len in ((3, 4), (128, 2), (16, 8))],
    *[DecodeCase(f"{fmt}-page{page}", FP8_LENS, 2, 4, page, 3, causal=CAUSAL, devices=BOTH, kv_format=fmt)
      for fmt in FP8_FORMATS for page in FP8_PAGES],
    *[DecodeCase(f"{fmt}-page{page}-bf16", FP8_LENS, 2, 4, page, 3, causal=CAUSAL, dtypes=(BF16,),
                 providers=("torch",), kv_format=fmt) for fmt in FP8_FORMATS for page in FP8_PAGES],
]


@pytest.mark.parametrize("provider,device,dtype,case,causal", _params(DECODE_CASES))
def test_paged_decode(provider, device, dtype, case, causal):
    _skip_unavailable("paged_decode", provider)

    def call(q, k_cache, table, seqlens, dv, meta, splits, causal, **fp8):
        return pagedmla.flash_mla_with_kvcache(q, k_cache, table, seqlens, dv, meta, splits, causal=causal,
                                               provider=provider, **fp8)

    check_paged_decode(call, case, causal, dtype, device, _bounds(DECODE_BOUNDS, provider, device, dtype))


# ----------------------------------------------------------------------------------------------------
# flash_mla_varlen_with_kvcache (op paged_varlen)
# ----------------------------------------------------------------------------------------------------

class PagedVarlenCase(NamedTuple):
    """Per-request new-token and KV lengths, heads, page size; causal values, devices, dtypes (None: the
    device's) and providers to run; input scales of q and the cache; softmax scale (None: D ** -0.5); whether
    max_q_len is passed; dims; lengths and qo_indptr as strided views; the cache's FP8 format (None: rows of
    q's dtype)."""

    name: str
    q_lens: list
    kv_lens: list
    heads: int
    page: int
    causal: tuple = (True, False)
    devices: tuple = CPU
    dtypes: tuple | None = None
    q_std: float = 0.25
    kv_std: float = 0.25
    scale: float | None = None
    pass_max: bool = False
    d: int = 576
    dv: int = 512
    strided: bool = False
    providers: tuple = PROVIDERS
    kv_format: str | None = None


def paged_varlen_inputs(case: PagedVarlenCase, dtype: torch.dtype, device: str, key) -> tuple:
    """(q [T, heads, d], cache (oracle.PagedCache), k_cache, block_table, cache_seqlens, qo_indptr), on device."""
    g = gen("paged-varlen", case.name, key, str(dtype))
    cache = paged_cache(case.kv_lens, case.page, case.d, dtype, g, case.kv_std, case.kv_format)
    qo = _indptr(case.q_lens)
    q = (torch.randn(qo[-1], case.heads, case.d, generator=g, dtype=F64) * case.q_std).to(dtype)
    return (q.to(device), cache, cache.k_cache.to(device), cache.block_table.to(device),
            _int32(case.kv_lens, device, case.strided), _int32(qo, device, case.strided))


def check_paged_varlen(call: Callable, case: PagedVarlenCase, causal: bool, dtype: torch.dtype, device: str,
                       bounds: Bounds | None, key=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the case, run ``call(q, k_cache, block_table, cache_seqlens, qo_indptr, head_dim_v, scale, causal,
    max_q_len) -> (out [T, h, dv], lse [T, h])`` (with an FP8 case's ``fp8_args`` as keywords) and check it
    against the oracle. Returns (out, lse)."""
    q, cache, k_cache, table, lens, qo = paged_varlen_inputs(case, dtype, device, (key, causal))
    scale = case.d ** -0.5 if case.scale is None else case.scale
    out, lse = call(q, k_cache, table, lens, qo, case.dv, case.scale, causal,
                    max(case.q_lens) if case.pass_max else None, **fp8_args(case.kv_format, device))
    ref_out, ref_lse = dense_paged(q, _indptr(case.q_lens), cache.rows, scale, causal, case.dv)
    what = f"{case.name} causal={causal}"
    assert_matches(out, lse, ref_out, ref_lse, dtype, bounds, what)
    assert_fp8_cos(out, ref_out, case.kv_format, what)
    return out, lse


def _random_paged_varlen(seed: int) -> PagedVarlenCase:
    g = torch.Generator().manual_seed(200 + seed)
    b = int(torch.randint(1, 5, (1,), generator=g))
    q_lens = [int(x) for x in torch.randint(1, 41, (b,), generator=g)]
    kv_lens = [n + int(torch.randint(0, 90, (1,), generator=g)) for n in q_lens]
    return PagedVarlenCase(f"random{seed}", q_lens, kv_lens, (16, 4, 8)[seed], (1, 16, 64)[seed], causal=CAUSAL,
                           dtypes=(F16,), q_std=1.0, kv_std=1.0, scale=0.05, pass_max=True)


PAGED_VARLEN_CASES = [
    # A request with no new tokens, more queries than keys (causal rows that see no key), an empty KV.
    PagedVarlenCase("mixed", [1, 5, 17, 40], [1, 20, 17, 100], 4, 16, devices=BOTH),
    PagedVarlenCase("no-new-tokens", [0, 9, 1], [5, 31, 3], 3, 64, devices=BOTH),
    PagedVarlenCase("more-q-than-kv", [6, 4, 3], [2, 0, 3], 4, 16, devices=BOTH),
    # Unit-scale inputs (peaked softmax), fp16 / fp32 as the Triton file had them.
    PagedVarlenCase("mixed-unit", [1, 5, 17, 40], [1, 20, 17, 100], 4, 16, dtypes=(F16,), q_std=1.0, kv_std=1.0),
    PagedVarlenCase("page1", [3, 1, 16], [70, 1, 16], 16, 1, dtypes=(F32,), q_std=1.0, kv_std=1.0),
    PagedVarlenCase("prefill", [33], [33], 2, 64, dtypes=(F16,), q_std=1.0, kv_std=1.0),
    PagedVarlenCase("page-edge", [1, 2], [64, 65], 8, 64, dtypes=(F32,), q_std=1.0, kv_std=1.0),
    PagedVarlenCase("no-new-tokens-page16", [0, 9, 1], [5, 31, 3], 3, 16, dtypes=(F16,), q_std=1.0, kv_std=1.0),
    PagedVarlenCase("more-q-than-kv-unit", [6, 4, 3], [2, 0, 3], 4, 16, dtypes=(F32,), q_std=1.0, kv_std=1.0),
    *[_random_paged_varlen(seed) for seed in range(3)],
    PagedVarlenCase("default-scale", [4, 1], [9, 30], 4, 16, causal=CAUSAL, dtypes=(F16,), q_std=1.0, kv_std=1.0),
    PagedVarlenCase("strided", [3, 2], [40, 70], 4, 16, causal=CAUSAL, d=128, dv=64, strided=True),
    # CUDA: long prompts over long cached prefixes (the Hopper kernel on sm_90).
    *[PagedVarlenCase(f"long-h{h}", [512, 1, 37, 300], [2048 + 512, 4000, 37, 1300], h, 64, causal=CAUSAL,
                      devices=CUDA, dtypes=(BF16,), kv_std=1.0, pass_max=True) for h in (16, 128)],
    *[PagedVarlenCase(f"{fmt}-page{page}", [0, 1, 5, 64, 3], FP8_LENS, 2, page, causal=CAUSAL, devices=BOTH,
                      kv_format=fmt) for fmt in FP8_FORMATS for page in FP8_PAGES],
    *[PagedVarlenCase(f"{fmt}-page{page}-bf16", [0, 1, 5, 64, 3], FP8_LENS, 2, page, causal=CAUSAL, dtypes=(BF16,),
                      providers=("torch",), kv_format=fmt) for fmt in FP8_FORMATS for page in FP8_PAGES],
]


@pytest.mark.parametrize("provider,device,dtype,case,causal", _params(PAGED_VARLEN_CASES))
def test_paged_varlen(provider, device, dtype, case, causal):
    _skip_unavailable("paged_varlen", provider)

    def call(q, k_cache, table, lens, qo, dv, scale, causal, max_q_len, **fp8):
        return pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, lens, qo, dv, softmax_scale=scale,
                                                      causal=causal, max_q_len=max_q_len, provider=provider, **fp8)

    check_paged_varlen(call, case, causal, dtype, device, _bounds(PREFILL_BOUNDS, provider, device, dtype))


# ----------------------------------------------------------------------------------------------------
# flash_attn_varlen_func (op varlen)
# ----------------------------------------------------------------------------------------------------

class VarlenCase(NamedTuple):
    """Per-sequence q and k lengths (None: k as q), heads, KV heads, Dqk, Dv; input scales of q, k, v; softmax scale
    (None: Dqk ** -0.5); whether a NaN-filled out= buffer is passed; v as the value half of a wider buffer;
    cumulative lengths as strided views."""

    name: str
    lq: list
    lk: list | None
    heads: int
    kv_heads: int
    dk: int
    dv: int
    causal: tuple = (True, False)
    devices: tuple = CPU
    dtypes: tuple | None = None
    stds: tuple = (0.5, 0.5, 0.5)
    scale: float | None = None
    out: bool = False
    v_view: bool = False
    strided: bool = False


def varlen_inputs(lq: list, lk: list, heads: int, kv_heads: int, dk: int, dv: int, dtype: torch.dtype,
                  device: str, key, *, stds: tuple = (0.5, 0.5, 0.5), spare_kv_rows: int = 0,
                  v_view: bool = False, strided: bool = False) -> tuple:
    """(q [Tq, heads, dk], k [Tk + spare, kv_heads, dk], v [Tk + spare, kv_heads, dv], cu_q, cu_k) on device,
    ``stds`` the scales of q, k and v; ``spare_kv_rows`` rows after the last sequence hold NaN (an engine's
    buffers have capacity); ``v_view`` makes v the value half of a [Tk, kv_heads, 64 + dv] buffer whose other
    half is NaN."""
    g = gen("varlen", key, str(dtype))
    cu_q, cu_k = _indptr(lq), _indptr(lk)
    q, k, v = ((torch.randn(n, h, dim, generator=g, dtype=F64) * std).to(dtype)
               for n, h, dim, std in zip((cu_q[-1], cu_k[-1], cu_k[-1]), (heads, kv_heads, kv_heads), (dk, dk, dv),
                                         stds))
    nan = float("nan")
    k = torch.cat([k, torch.full((spare_kv_rows, kv_heads, dk), nan, dtype=dtype)]).to(device)
    v = torch.cat([v, torch.full((spare_kv_rows, kv_heads, dv), nan, dtype=dtype)]).to(device)
    if v_view:
        v = torch.cat([torch.full((v.shape[0], kv_heads, 64), nan, dtype=dtype, device=device), v], -1)[..., 64:]
    return q.to(device), k, v, _int32(cu_q, device, strided), _int32(cu_k, device, strided)


def check_varlen(call: Callable, lq: list, lk: list, heads: int, kv_heads: int, dk: int, dv: int, causal: bool,
                 dtype: torch.dtype, device: str, bounds: Bounds | None, key, *, scale: float | None = None,
                 out: bool = False, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the inputs (``varlen_inputs(**inputs)``), run ``call(q, k, v, cu_q, cu_k, max_q, max_k, scale,
    causal, out) -> (out [Tq, h, dv], lse [Tq, h])`` with a NaN-filled ``out`` buffer if asked, check against
    the oracle. Returns (out, lse)."""
    q, k, v, cu_q, cu_k = varlen_inputs(lq, lk, heads, kv_heads, dk, dv, dtype, device, key, **inputs)
    buf = torch.full((q.shape[0], heads, dv), float("nan"), dtype=dtype, device=device) if out else None
    o, lse = call(q, k, v, cu_q, cu_k, max(lq, default=0), max(lk, default=0), scale, causal, buf)
    if out:
        assert o.data_ptr() == buf.data_ptr(), "out= must be the buffer written"
    ref_out, ref_lse = dense_varlen(q, k, v, _indptr(lq), _indptr(lk), dk ** -0.5 if scale is None else scale,
                                    causal)
    assert_matches(o, lse, ref_out, ref_lse, dtype, bounds, f"lq={lq} lk={lk} causal={causal}")
    return o, lse


def _random_varlen(seed: int) -> VarlenCase:
    g = torch.Generator().manual_seed(100 + seed)
    b = int(torch.randint(1, 5, (1,), generator=g))
    lq = torch.randint(0, 41, (b,), generator=g).tolist()
    lk = [x + int(torch.randint(0, 20, (1,), generator=g)) for x in lq] if seed % 2 else \
        torch.randint(0, 41, (b,), generator=g).tolist()
    hk = (1, 2, 4)[seed % 3]
    return VarlenCase(f"random{seed}", lq, lk, hk * (1, 2, 8)[seed % 3], hk, 192, 128, causal=(seed < 2,),
                      dtypes=(F16,), stds=UNIT, scale=0.1)


UNIT = (1.0, 1.0, 1.0)
VARLEN_CASES = [
    VarlenCase("edges", [0, 1, 15, 17], None, 4, 2, 64, 64, devices=BOTH),
    VarlenCase("gqa4", [33, 5], [70, 2], 4, 1, 192, 128, devices=BOTH),
    VarlenCase("no-keys", [18, 3], [18, 0], 2, 2, 96, 80, devices=BOTH),
    # Unit-scale inputs into a NaN-filled out= buffer, fp16 and fp32, as the Triton file had them.
    VarlenCase("tiles", [0, 1, 15, 16, 17, 40], None, 4, 4, 192, 128, stds=UNIT, out=True),
    VarlenCase("gqa2", [16, 17, 15, 1, 0], None, 4, 2, 128, 128, stds=UNIT, out=True),
    VarlenCase("gqa8", [33, 5], [70, 2], 8, 1, 64, 64, stds=UNIT, out=True),  # q shorter, then longer, than k
    VarlenCase("d256", [20, 3, 0], [7, 50, 9], 2, 2, 256, 256, stds=UNIT, out=True),
    VarlenCase("d96", [18], [18], 2, 1, 96, 80, stds=UNIT, out=True),  # 96 = 64 + 32; Dv padded and masked
    *[_random_varlen(seed) for seed in range(4)],
    VarlenCase("default-scale", [0, 17, 5], [3, 40, 5], 4, 2, 192, 128, causal=CAUSAL, dtypes=(F16,), stds=UNIT),
    VarlenCase("strided", [7, 12], None, 2, 2, 32, 16, causal=CAUSAL, stds=UNIT, strided=True),
    # CUDA: long sequences, contiguous or a strided value view (the portable kernel for short queries).
    *[VarlenCase(f"long-h{h}-hk{hk}-{len(lens)}{'' if cont else '-vview'}", lens, None, h, hk, 192, 128,
                 devices=CUDA, dtypes=(BF16,), stds=(0.5, 0.5, 1.0), out=True, v_view=not cont)
      for h, hk, lens in ((16, 16, [1024, 4096, 2500, 3]), (128, 128, [1024, 777]), (16, 2, [2048, 1]),
                          (16, 16, [300, 17])) for cont in (True, False)],
    *[VarlenCase(f"equal-d{d}", [300, 1, 1000], [700, 64, 1000], 8, 2, d, d, causal=CAUSAL, devices=CUDA,
                 dtypes=(BF16,), stds=UNIT) for d in (64, 128, 256)],
]


@pytest.mark.parametrize("provider,device,dtype,case,causal", _params(VARLEN_CASES))
def test_varlen(provider, device, dtype, case, causal):
    _skip_unavailable("varlen", provider)

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, out):
        o, lse, _ = pagedmla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                                    causal=causal, return_attn_probs=True, out=out,
                                                    provider=provider)
        return o, lse.transpose(0, 1)

    lk = case.lq if case.lk is None else case.lk
    check_varlen(call, case.lq, lk, case.heads, case.kv_heads, case.dk, case.dv, causal, dtype, device,
                 _bounds(PREFILL_BOUNDS, provider, device, dtype), (case.name, causal), scale=case.scale,
                 out=case.out, stds=case.stds, v_view=case.v_view, strided=case.strided)


# ----------------------------------------------------------------------------------------------------
# merge_state (op merge)
# ----------------------------------------------------------------------------------------------------

class MergeCase(NamedTuple):
    """States [T, H, D]; s_a as a transposed view (in-place merges write into contiguous inputs)."""

    name: str
    shape: tuple
    strided_lse: bool = False
    devices: tuple = CPU
    dtypes: tuple | None = None


MERGE_CASES = [
    MergeCase("t17", (17, 3, 128), devices=BOTH),
    MergeCase("t64-d512", (64, 16, 512)),
    MergeCase("d8", (7, 1, 8)),
    MergeCase("d40", (7, 1, 40), devices=BOTH),
    MergeCase("strided-d128", (37, 5, 128), strided_lse=True),
    MergeCase("strided-d40", (37, 5, 40), strided_lse=True),
    MergeCase("strided-d64", (9, 4, 64), strided_lse=True, dtypes=(F16,)),
    MergeCase("large", (4096, 16, 128), strided_lse=True, devices=CUDA, dtypes=(BF16,)),
]
MODES = ("plain", "out", "in_place")
# LSEs in float32; the torch provider also merges float64 states, with float64 or float32 LSEs.
MERGE_PARAMS = [pytest.param(*p.values, F32, marks=p.marks, id=p.id) for p in
                _params(MERGE_CASES, lambda case, device: MODES if device == "cpu" else ("plain",))]
MERGE_PARAMS += [pytest.param("torch", "cpu", F64, case, mode, lse, id=f"{case.name}-{mode}-torch-cpu-float64-{n}")
                 for case in MERGE_CASES if "cpu" in case.devices for mode in MODES
                 for lse, n in ((F64, "lse64"), (F32, "lse32"))]


@pytest.mark.parametrize("provider,device,dtype,case,mode,lse_dtype", MERGE_PARAMS)
def test_merge(provider, device, dtype, case, mode, lse_dtype):
    """merge_state returning new tensors (inputs untouched), into out= buffers, or in place into (v_a, s_a)."""
    _skip_unavailable("merge", provider)
    g = gen("merge", case.name, mode, str(dtype), str(lse_dtype))
    t, h, d = case.shape
    v_a, s_a, v_b, s_b = merge_inputs(g, t, h, d, dtype, lse_dtype, strided_lse=case.strided_lse and mode != "in_place")
    ref_v, ref_s = dense_merge(v_a, s_a, v_b, s_b)
    v_a, s_a, v_b, s_b = (x.to(device) for x in (v_a, s_a, v_b, s_b))
    if mode == "plain":
        before = [x.clone() for x in (v_a, s_a, v_b, s_b)]
        v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, provider=provider)
        for x, y in zip((v_a, s_a, v_b, s_b), before):
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), "input changed"
    elif mode == "out":
        out = torch.full((t, h, d), float("nan"), dtype=dtype, device=device)
        out_lse = torch.full((t, h), float("nan"), dtype=lse_dtype, device=device)
        v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse, provider=provider)
        assert v.data_ptr() == out.data_ptr() and s.data_ptr() == out_lse.data_ptr()
        v, s = out, out_lse
    else:
        v, s = pagedmla.merge_state(v_a, s_a, v_b, s_b, out=v_a, out_lse=s_a, provider=provider)
        assert v.data_ptr() == v_a.data_ptr() and s.data_ptr() == s_a.data_ptr()
        v, s = v_a, s_a
    assert v.dtype == dtype
    # Returned LSEs are computed in v's precision; an LSE written into a float32 buffer is rounded to it.
    assert s.dtype == (lse_dtype if mode != "plain" else (F64 if dtype == F64 else F32))
    what = f"{case.name} {mode}"
    assert_attention_close(v, None, ref_v, None, TOLERANCES[dtype], what)
    assert_attention_close(v, s, ref_v, ref_s, max(TOLERANCES[dtype], TOLERANCES[s.dtype]), what)
    assert_bounds(v, s, ref_v, ref_s, _bounds(MERGE_BOUNDS, provider, device, dtype), what)
    assert torch.isneginf(ref_s).any(), "the case must hold both-empty entries"
