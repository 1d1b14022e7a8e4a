"""Every public call rejects bad arguments with the right exception type and a message naming the argument.

Each test starts from a valid call (checked to succeed) and breaks exactly one thing, so a failure to
raise, or a raise for the wrong reason, both show up.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from oracle import gen

import pagedmla
from pagedmla import MLAConfig, MLAKVCache, OutOfPagesError, PageAllocator, RequestTable

F32, F64 = torch.float32, torch.float64
I32, I64 = torch.int32, torch.int64


def names(argument: str) -> str:
    """Pattern of an error message that starts by naming ``argument``, alone or in a slash-separated list
    of the arguments at fault (not merely containing its letters somewhere)."""
    return rf"^(\w+/)*{re.escape(argument)}(:|/| )"


def t32(x):
    return torch.tensor(x, dtype=I32)


# ----------------------------------------------------------------------------------------------------
# Valid argument sets
# ----------------------------------------------------------------------------------------------------

D, DV, H, PS, NUM_PAGES = 48, 32, 3, 16, 8


def decode_args(g=None):
    """Valid flash_mla_with_kvcache arguments as a dict: b = 2, q_len = 2, pages 1..5 in use."""
    g = g or gen("decode_args")
    lens = t32([20, 33])
    meta, splits = pagedmla.get_mla_metadata(lens, 2 * H, 1)
    return dict(q=torch.randn(2, 2, H, D, generator=g), k_cache=torch.randn(NUM_PAGES, PS, 1, D, generator=g),
                block_table=t32([[3, 1, 0], [2, 5, 4]]), cache_seqlens=lens, head_dim_v=DV,
                tile_scheduler_metadata=meta, num_splits=splits)


def call_decode(a, **kw):
    return pagedmla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], a["head_dim_v"],
                                           a["tile_scheduler_metadata"], a["num_splits"], provider="torch", **kw)


def varlen_paged_args(g=None):
    g = g or gen("varlen_paged_args")
    return dict(q=torch.randn(5, H, D, generator=g), k_cache=torch.randn(NUM_PAGES, PS, 1, D, generator=g),
                block_table=t32([[3, 1, 0], [2, 5, 4]]), cache_seqlens=t32([20, 33]), qo_indptr=t32([0, 2, 5]),
                head_dim_v=DV)


def call_varlen_paged(a, **kw):
    return pagedmla.flash_mla_varlen_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"],
                                                  a["qo_indptr"], a["head_dim_v"], provider="torch", **kw)


def mha_args(g=None):
    g = g or gen("mha_args")
    return dict(q=torch.randn(7, 4, 24, generator=g), k=torch.randn(9, 2, 24, generator=g),
                v=torch.randn(9, 2, 16, generator=g), cu_seqlens_q=t32([0, 3, 7]), cu_seqlens_k=t32([0, 4, 9]),
                max_seqlen_q=4, max_seqlen_k=5)


def call_mha(a, **kw):
    return pagedmla.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                           a["max_seqlen_q"], a["max_seqlen_k"], provider="torch", **kw)


def merge_args(g=None):
    g = g or gen("merge_args")
    return dict(v_a=torch.randn(5, 3, 8, generator=g), s_a=torch.randn(5, 3, generator=g),
                v_b=torch.randn(5, 3, 8, generator=g), s_b=torch.randn(5, 3, generator=g))


def call_merge(a, **kw):
    return pagedmla.merge_state(a["v_a"], a["s_a"], a["v_b"], a["s_b"], provider="torch", **kw)


def test_valid_argument_sets_are_accepted():
    out, lse = call_decode(decode_args())
    assert torch.isfinite(out).all() and tuple(lse.shape) == (2, H, 2)
    out, lse = call_varlen_paged(varlen_paged_args())
    assert torch.isfinite(out).all() and tuple(out.shape) == (5, H, DV)
    assert tuple(call_mha(mha_args()).shape) == (7, 4, 16)
    v, s = call_merge(merge_args())
    assert tuple(v.shape) == (5, 3, 8)


def replace(a: dict, **changes) -> dict:
    b = dict(a)
    b.update(changes)
    return b


# ----------------------------------------------------------------------------------------------------
# flash_mla_with_kvcache
# ----------------------------------------------------------------------------------------------------

def _decode_cases():
    a = decode_args()
    q, kc, bt, lens = a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"]
    meta, splits = a["tile_scheduler_metadata"], a["num_splits"]
    return {
        "q int dtype": (replace(a, q=q.to(I32)), "q"),
        "q float16 vs float32 cache": (replace(a, q=q.half()), "k_cache"),
        "q rank 3": (replace(a, q=q[0]), "q"),
        "q rank 5": (replace(a, q=q[None]), "q"),
        "q_len 0": (replace(a, q=q[:, :0]), "q"),
        "k_cache dtype differs": (replace(a, k_cache=kc.double()), "k_cache"),
        "k_cache int": (replace(a, k_cache=kc.to(I32)), "k_cache"),
        "k_cache rank 3": (replace(a, k_cache=kc.reshape(NUM_PAGES * PS, 1, D)), "k_cache"),
        "k_cache head dim != q's": (replace(a, k_cache=kc[..., :40].contiguous()), "k_cache"),
        "k_cache two heads": (replace(a, k_cache=kc.expand(NUM_PAGES, PS, 2, D).contiguous()), "k_cache"),
        "page size 12": (replace(a, k_cache=kc[:, :12].contiguous()), "k_cache"),
        "page size 512": (replace(a, k_cache=torch.randn(2, 512, 1, D)), "k_cache"),
        "head_dim_v > D": (replace(a, head_dim_v=D + 1), "head_dim_v"),
        "head_dim_v 0": (replace(a, head_dim_v=0), "head_dim_v"),
        "head_dim_v float": (replace(a, head_dim_v=32.0), "head_dim_v"),
        "block_table int64": (replace(a, block_table=bt.long()), "block_table"),
        "block_table rank 1": (replace(a, block_table=bt.flatten()), "block_table"),
        "block_table rows != b": (replace(a, block_table=bt[:1]), "block_table"),
        "cache_seqlens int64": (replace(a, cache_seqlens=lens.long()), "cache_seqlens"),
        "cache_seqlens rank 2": (replace(a, cache_seqlens=lens[None]), "cache_seqlens"),
        "cache_seqlens wrong length": (replace(a, cache_seqlens=t32([20, 33, 1])), "cache_seqlens"),
        "cache_seqlens beyond capacity": (replace(a, cache_seqlens=t32([20, 3 * PS + 1])), "cache_seqlens"),
        "cache_seqlens negative": (replace(a, cache_seqlens=t32([-1, 33])), "cache_seqlens"),
        "page id too large": (replace(a, block_table=t32([[3, NUM_PAGES, 0], [2, 5, 4]])), "block_table"),
        "page id negative": (replace(a, block_table=t32([[3, 1, 0], [2, -1, 4]])), "block_table"),
        "metadata int64": (replace(a, tile_scheduler_metadata=meta.long()), "tile_scheduler_metadata"),
        "metadata rank 1": (replace(a, tile_scheduler_metadata=meta.flatten()), "tile_scheduler_metadata"),
        "metadata row width": (replace(a, tile_scheduler_metadata=meta[:, :5].contiguous()), "tile_scheduler_metadata"),
        "num_splits int64": (replace(a, num_splits=splits.long()), "num_splits"),
        "num_splits wrong size": (replace(a, num_splits=splits[:-1]), "num_splits"),
    }


DECODE_CASES = _decode_cases()


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_flash_mla_with_kvcache_rejects(case):
    args, name = DECODE_CASES[case]
    with pytest.raises(ValueError, match=names(name)):
        call_decode(args)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), "0.1", True])
def test_flash_mla_with_kvcache_rejects_softmax_scale(scale):
    with pytest.raises(ValueError, match=names("softmax_scale")):
        call_decode(decode_args(), softmax_scale=scale)


def test_flash_mla_with_kvcache_rejects_non_tensor_q():
    a = decode_args()
    with pytest.raises(TypeError, match=names("q")):
        call_decode(replace(a, q=a["q"].tolist()))


def test_out_of_range_page_ids_are_fine_where_no_request_reads():
    """Entries past a request's last page are never read: out-of-range junk there must be accepted and
    must not change the result."""
    a = decode_args()
    ref_out, ref_lse = call_decode(a)
    junk = replace(a, block_table=t32([[3, 1, 10_000], [2, 5, 4]]))  # request 0 (20 tokens) uses 2 pages
    out, lse = call_decode(junk)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # A zero-length request reads no page at all.
    empty = replace(a, block_table=t32([[-7, 99, 10_000], [2, 5, 4]]), cache_seqlens=t32([0, 33]))
    out, _ = call_decode(empty)
    assert (out[0] == 0).all()


def test_cache_seqlens_exactly_at_capacity_is_accepted():
    a = decode_args()
    out, _ = call_decode(replace(a, cache_seqlens=t32([20, 3 * PS])))
    assert torch.isfinite(out).all()


# FP8 caches (both paged calls): 576-wide rows, FlashMLA's 656-byte format behind is_fp8_kvcache=True.

def _fp8_args(kv_format: str) -> dict:
    """Valid flash_mla_with_kvcache arguments over an FP8 cache (the keywords under "kw")."""
    g = gen("fp8_args", kv_format)
    a = decode_args(g)
    rows = torch.randn(NUM_PAGES, PS, 1, 576, generator=g)
    ks = torch.full((1,), 0.01)
    cache = pagedmla.quantize_latent(rows, kv_format, k_scale=ks if kv_format == "fp8_e4m3" else None)
    kw = dict(k_scale=ks) if kv_format == "fp8_e4m3" else dict(is_fp8_kvcache=True)
    return replace(a, q=torch.randn(2, 2, H, 576, generator=g), k_cache=cache, head_dim_v=512, kw=kw)


def _fp8_cases():
    e4, ds = _fp8_args("fp8_e4m3"), _fp8_args("fp8_ds_mla")
    ks = e4["kw"]["k_scale"]
    return {
        "e4m3 without k_scale": (replace(e4, kw={}), "k_scale"),
        "e4m3 k_scale float": (replace(e4, kw=dict(k_scale=0.01)), "k_scale"),
        "e4m3 k_scale two elements": (replace(e4, kw=dict(k_scale=ks.repeat(2))), "k_scale"),
        "e4m3 k_scale float64": (replace(e4, kw=dict(k_scale=ks.double())), "k_scale"),
        "e4m3 with is_fp8_kvcache": (replace(e4, kw=dict(k_scale=ks, is_fp8_kvcache=True)), "k_cache"),
        "e4m3 width != q's": (replace(e4, k_cache=e4["k_cache"][..., :512]), "k_cache"),
        "k_scale with a float cache": (replace(decode_args(), kw=dict(k_scale=ks)), "k_scale"),
        "ds without is_fp8_kvcache": (replace(ds, kw={}), "k_cache"),
        "ds float8 view without is_fp8_kvcache": (replace(ds, k_cache=ds["k_cache"].view(torch.float8_e4m3fn),
                                                          kw={}), "k_cache"),
        "ds with k_scale": (replace(ds, kw=dict(is_fp8_kvcache=True, k_scale=ks)), "k_scale"),
        "ds width 655": (replace(ds, k_cache=ds["k_cache"][..., :655]), "k_cache"),
        "ds float16 bytes": (replace(ds, k_cache=ds["k_cache"][..., :328].contiguous().view(torch.float16)),
                             "k_cache"),
        "ds head_dim_v 256": (replace(ds, head_dim_v=256), "q"),
        "is_fp8_kvcache not a bool": (replace(ds, kw=dict(is_fp8_kvcache=1)), "is_fp8_kvcache"),
    }


FP8_CASES = _fp8_cases()


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_fp8_argument_sets_are_accepted(kv_format):
    a = _fp8_args(kv_format)
    out, lse = call_decode(a, **a["kw"])
    assert torch.isfinite(out).all() and out.dtype == a["q"].dtype and lse.dtype == F32
    v = dict(q=a["q"].reshape(4, H, 576), k_cache=a["k_cache"], block_table=a["block_table"],
             cache_seqlens=a["cache_seqlens"], qo_indptr=t32([0, 2, 4]), head_dim_v=512)
    out, lse = call_varlen_paged(v, **a["kw"])
    assert torch.isfinite(out).all() and tuple(out.shape) == (4, H, 512)


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_paged_calls_reject_fp8_mismatches(case):
    args, name = FP8_CASES[case]
    exc = TypeError if case == "e4m3 k_scale float" else ValueError
    with pytest.raises(exc, match=names(name)):
        call_decode(args, **args["kw"])
    v = dict(q=args["q"].reshape(4, H, -1), k_cache=args["k_cache"], block_table=args["block_table"],
             cache_seqlens=args["cache_seqlens"], qo_indptr=t32([0, 2, 4]), head_dim_v=args["head_dim_v"])
    with pytest.raises(exc, match=names(name)):
        call_varlen_paged(v, **args["kw"])


# ----------------------------------------------------------------------------------------------------
# flash_mla_varlen_with_kvcache
# ----------------------------------------------------------------------------------------------------

def _varlen_paged_cases():
    a = varlen_paged_args()
    q, kc, bt = a["q"], a["k_cache"], a["block_table"]
    return {
        "q int dtype": (replace(a, q=q.to(I64)), "q"),
        "q rank 4": (replace(a, q=q[None]), "q"),
        "q dtype differs from cache": (replace(a, q=q.double()), "k_cache"),
        "k_cache head dim != q's": (replace(a, k_cache=kc[..., :D - 1].contiguous()), "k_cache"),
        "k_cache page size 3": (replace(a, k_cache=kc[:, :3].contiguous()), "k_cache"),
        "head_dim_v too large": (replace(a, head_dim_v=D + 16), "head_dim_v"),
        "qo_indptr int64": (replace(a, qo_indptr=a["qo_indptr"].long()), "qo_indptr"),
        "qo_indptr rank 2": (replace(a, qo_indptr=a["qo_indptr"][None]), "qo_indptr"),
        "qo_indptr empty": (replace(a, qo_indptr=t32([])), "qo_indptr"),
        "qo_indptr decreasing": (replace(a, qo_indptr=t32([0, 4, 3, 5]),
                                         block_table=t32([[3, 1, 0], [2, 5, 4], [6, 0, 0]]),
                                         cache_seqlens=t32([20, 33, 4])), "qo_indptr"),
        "qo_indptr not starting at 0": (replace(a, qo_indptr=t32([1, 2, 5])), "qo_indptr"),
        "qo_indptr end != T": (replace(a, qo_indptr=t32([0, 2, 4])), "qo_indptr"),
        "block_table rows != b": (replace(a, block_table=bt[:1]), "block_table"),
        "block_table int64": (replace(a, block_table=bt.long()), "block_table"),
        "cache_seqlens wrong length": (replace(a, cache_seqlens=t32([20])), "cache_seqlens"),
        "cache_seqlens int64": (replace(a, cache_seqlens=t32([20, 33]).long()), "cache_seqlens"),
        "cache_seqlens beyond capacity": (replace(a, cache_seqlens=t32([49, 33])), "cache_seqlens"),
        "cache_seqlens negative": (replace(a, cache_seqlens=t32([20, -3])), "cache_seqlens"),
        "page id too large": (replace(a, block_table=t32([[3, 1, 0], [2, 5, 99]])), "block_table"),
        "page id negative": (replace(a, block_table=t32([[-3, 1, 0], [2, 5, 4]])), "block_table"),
    }


VARLEN_PAGED_CASES = _varlen_paged_cases()


@pytest.mark.parametrize("case", list(VARLEN_PAGED_CASES))
def test_flash_mla_varlen_with_kvcache_rejects(case):
    args, name = VARLEN_PAGED_CASES[case]
    with pytest.raises(ValueError, match=names(name)):
        call_varlen_paged(args)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_flash_mla_varlen_rejects_bad_max_q_len(value):
    with pytest.raises(ValueError, match=names("max_q_len")):
        call_varlen_paged(varlen_paged_args(), max_q_len=value)


def test_flash_mla_varlen_rejects_max_q_len_below_longest_request():
    """max_q_len is a bound a kernel may size its grid by: one below the real maximum must be refused,
    as flash_attn_varlen_func refuses a short max_seqlen_q."""
    a = varlen_paged_args()
    call_varlen_paged(a, max_q_len=3)
    with pytest.raises(ValueError, match=names("max_q_len")):
        call_varlen_paged(a, max_q_len=2)


@pytest.mark.parametrize("kw,name", [
    (dict(kv_page_indptr=t32([0, 2, 5])), "kv_page_indptr"),  # without num_kv_pages
    (dict(num_kv_pages=5), "kv_page_indptr"),  # without kv_page_indptr
    (dict(kv_page_indptr=t32([0, 2]), num_kv_pages=2), "kv_page_indptr"),  # one entry short
    (dict(kv_page_indptr=t32([0, 2, 5]).long(), num_kv_pages=5), "kv_page_indptr"),
    (dict(kv_page_indptr=t32([0, 2, 5]), num_kv_pages=-1), "num_kv_pages"),
    (dict(kv_page_indptr=t32([0, 2, 5]), num_kv_pages=True), "num_kv_pages"),
    (dict(kv_page_indptr=t32([0, 2, 5]), num_kv_pages=6), "kv_page_indptr"),  # last entry != num_kv_pages
    (dict(kv_page_indptr=t32([1, 2, 5]), num_kv_pages=5), "kv_page_indptr"),  # not from 0
    (dict(kv_page_indptr=t32([0, 1, 4]), num_kv_pages=4), "kv_page_indptr"),  # request 0 reads 2 pages
])
def test_flash_mla_varlen_rejects_bad_page_layout(kw, name):
    """The page layout (FP8 caches' workspace on sm_90): both or neither, int32 [b + 1] on q's device, and on
    the host (CPU tensors) values from 0 to num_kv_pages whose spans cover each request's pages."""
    with pytest.raises(ValueError, match=names(name)):
        call_varlen_paged(varlen_paged_args(), **kw)


def test_flash_mla_varlen_accepts_a_page_layout():
    """A layout whose spans cover the lengths, exactly or with pages to spare, passes the host value checks."""
    a = varlen_paged_args()
    call_varlen_paged(a, kv_page_indptr=t32([0, 2, 5]), num_kv_pages=5)
    call_varlen_paged(a, kv_page_indptr=t32([0, 3, 7]), num_kv_pages=7)


def test_flash_mla_varlen_rejects_bad_softmax_scale():
    with pytest.raises(ValueError, match=names("softmax_scale")):
        call_varlen_paged(varlen_paged_args(), softmax_scale=-1.0)


# ----------------------------------------------------------------------------------------------------
# flash_attn_varlen_func
# ----------------------------------------------------------------------------------------------------

def _mha_cases():
    a = mha_args()
    q, k, v = a["q"], a["k"], a["v"]
    return {
        "q int dtype": (replace(a, q=q.to(I32)), "q"),
        "q rank 2": (replace(a, q=q.reshape(7, -1)), "q"),
        "k dtype differs": (replace(a, k=k.double()), "k"),
        "v dtype differs": (replace(a, v=v.half()), "v"),
        "k rank 4": (replace(a, k=k[None]), "k"),
        "v rank 2": (replace(a, v=v.reshape(9, -1)), "v"),
        "k head dim != q's": (replace(a, k=k[..., :20].contiguous()), "k"),
        "v heads != k heads": (replace(a, v=torch.randn(9, 1, 16)), "v"),
        "v rows != k rows": (replace(a, v=v[:8]), "v"),
        "q heads not a multiple of k heads": (replace(a, k=torch.randn(9, 3, 24), v=torch.randn(9, 3, 16)), "k"),
        "cu_seqlens_q int64": (replace(a, cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q"),
        "cu_seqlens_q decreasing": (replace(a, cu_seqlens_q=t32([0, 5, 4, 7]), cu_seqlens_k=t32([0, 4, 4, 9])),
                                    "cu_seqlens_q"),
        "cu_seqlens_q end != total": (replace(a, cu_seqlens_q=t32([0, 3, 6])), "cu_seqlens_q"),
        "cu_seqlens_q not from 0": (replace(a, cu_seqlens_q=t32([1, 3, 7])), "cu_seqlens_q"),
        "cu_seqlens_k decreasing": (replace(a, cu_seqlens_k=t32([0, 10, 9])), "cu_seqlens_k"),
        "cu_seqlens_k wrong size": (replace(a, cu_seqlens_k=t32([0, 9])), "cu_seqlens_k"),
        "cu_seqlens_k int64": (replace(a, cu_seqlens_k=a["cu_seqlens_k"].long()), "cu_seqlens_k"),
        "cu_seqlens_k past k": (replace(a, cu_seqlens_k=t32([0, 4, 10])), "cu_seqlens_k"),
        "cu_seqlens_k negative": (replace(a, cu_seqlens_k=t32([-1, 4, 9])), "cu_seqlens_k"),
        "max_seqlen_q too small": (replace(a, max_seqlen_q=3), "max_seqlen_q"),
        "max_seqlen_k too small": (replace(a, max_seqlen_k=4), "max_seqlen_k"),
        "max_seqlen_q negative": (replace(a, max_seqlen_q=-1), "max_seqlen_q"),
        "max_seqlen_k float": (replace(a, max_seqlen_k=5.0), "max_seqlen_k"),
    }


MHA_CASES = _mha_cases()


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_flash_attn_varlen_func_rejects(case):
    args, name = MHA_CASES[case]
    with pytest.raises(ValueError, match=names(name)):
        call_mha(args)


def test_flash_attn_varlen_func_takes_key_ranges_inside_k():
    """cu_seqlens_k need not cover k (a padded key buffer): ranges from 1 and up to 8 of k's 9 rows give what
    the same sequences give on k cut to those rows, with the host's value checks on (the CPU default)."""
    a = mha_args()
    padded = call_mha(replace(a, cu_seqlens_k=t32([1, 4, 8])), causal=True)
    cut = call_mha(replace(a, k=a["k"][1:8], v=a["v"][1:8], cu_seqlens_k=t32([0, 3, 7])), causal=True)
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, cut, rtol=0, atol=0)


@pytest.mark.parametrize("call,args,argument", [
    (call_decode, decode_args, "block_table"),
    (call_varlen_paged, varlen_paged_args, "cache_seqlens"),
    (call_mha, mha_args, "cu_seqlens_k"),
])
def test_meta_tensor_after_a_valid_call_is_rejected(call, args, argument):
    """The memoised checks key a tensor by its device: a meta tensor after a valid CPU call of the same shapes
    gets the ValueError naming it, not the CPU call's checks (``get_device()`` is -1 for both)."""
    a = args()
    call(a)
    with pytest.raises(ValueError, match=names(argument)):
        call(replace(a, **{argument: a[argument].to("meta")}))


@pytest.mark.parametrize("out", [torch.zeros(7, 4, 24), torch.zeros(7, 4, 16, dtype=F64), torch.zeros(7, 16)])
def test_flash_attn_varlen_func_rejects_bad_out(out):
    with pytest.raises(ValueError, match=names("out")):
        call_mha(mha_args(), out=out)


def test_flash_attn_varlen_func_rejects_bad_softmax_scale():
    with pytest.raises(ValueError, match=names("softmax_scale")):
        call_mha(mha_args(), softmax_scale=0)


def test_flash_attn_varlen_func_rejects_non_tensor_cu_seqlens():
    with pytest.raises(TypeError, match=names("cu_seqlens_q")):
        call_mha(replace(mha_args(), cu_seqlens_q=[0, 3, 7]))


# ----------------------------------------------------------------------------------------------------
# merge_state
# ----------------------------------------------------------------------------------------------------

def _merge_cases():
    a = merge_args()
    return {
        "v_a int": (replace(a, v_a=a["v_a"].to(I32)), {}, "v_a"),
        "v_a rank 2": (replace(a, v_a=a["v_a"][0]), {}, "v_a"),
        "v_b dtype differs": (replace(a, v_b=a["v_b"].double()), {}, "v_b"),
        "v_b shape differs": (replace(a, v_b=a["v_b"][:4]), {}, "v_b"),
        "v_b head dim differs": (replace(a, v_b=torch.randn(5, 3, 9)), {}, "v_b"),
        "s_a shape": (replace(a, s_a=a["s_a"][:, :2]), {}, "s_a"),
        "s_a rank 3": (replace(a, s_a=a["s_a"][..., None]), {}, "s_a"),
        "s_b float16": (replace(a, s_b=a["s_b"].half()), {}, "s_b"),
        "s_b int": (replace(a, s_b=a["s_b"].to(I32)), {}, "s_b"),
        "out shape": (a, {"out": torch.zeros(5, 3, 7)}, "out"),
        "out dtype": (a, {"out": torch.zeros(5, 3, 8, dtype=F64)}, "out"),
        "out_lse shape": (a, {"out_lse": torch.zeros(5, 4)}, "out_lse"),
        "out_lse dtype": (a, {"out_lse": torch.zeros(5, 3, dtype=torch.bfloat16)}, "out_lse"),
    }


MERGE_CASES = _merge_cases()


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merge_state_rejects(case):
    args, kw, name = MERGE_CASES[case]
    with pytest.raises(ValueError, match=names(name)):
        call_merge(args, **kw)


# ----------------------------------------------------------------------------------------------------
# get_mla_metadata
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens,q_tokens,heads_k,parts,exc,name", [
    (torch.tensor([3, 4]), 16, 1, None, ValueError, "cache_seqlens"),            # int64
    (t32([[3, 4]]), 16, 1, None, ValueError, "cache_seqlens"),                  # rank 2
    (torch.tensor([3.0, 4.0]), 16, 1, None, ValueError, "cache_seqlens"),       # float
    ([3, 4], 16, 1, None, TypeError, "cache_seqlens"),                          # not a tensor
    (t32([3, 4]), 0, 1, None, ValueError, "num_q_tokens_per_head_k"),
    (t32([3, 4]), 16.0, 1, None, ValueError, "num_q_tokens_per_head_k"),
    (t32([3, 4]), 16, 0, None, ValueError, "num_heads_k"),
    (t32([3, 4]), 16, True, None, ValueError, "num_heads_k"),
    (t32([3, 4]), 16, 1, 0, ValueError, "num_sm_parts"),
    (t32([3, 4]), 16, 1, 2.0, ValueError, "num_sm_parts"),
])
def test_get_mla_metadata_rejects(lens, q_tokens, heads_k, parts, exc, name):
    with pytest.raises(exc, match=names(name)):
        pagedmla.get_mla_metadata(lens, q_tokens, heads_k, num_sm_parts=parts)


def _buffers(bs=2, parts=3):
    return (t32([3] * bs), torch.zeros(parts, 8, dtype=torch.int32), torch.zeros(bs + 1, dtype=torch.int32))


@pytest.mark.parametrize("bad,name", [
    (lambda lens, md, ns: (lens, md.t().contiguous(), ns), "metadata"),        # [8, parts]
    (lambda lens, md, ns: (lens, torch.zeros(8, 3, dtype=torch.int32).t(), ns), "metadata"),  # strided
    (lambda lens, md, ns: (lens, md.long(), ns), "metadata"),
    (lambda lens, md, ns: (lens, md, ns[:-1]), "num_splits"),                  # one entry short
    (lambda lens, md, ns: (lens, md, torch.zeros(3, 2, dtype=torch.int32)[:, 0]), "num_splits"),  # strided
    (lambda lens, md, ns: (lens.long(), md, ns), "cache_seqlens"),
    (lambda lens, md, ns: (lens[None], md, ns), "cache_seqlens"),
])
def test_schedule_into_rejects(bad, name):
    """The buffer form (CUDA-graph state) checks what the kernel would otherwise write past or misorder."""
    from pagedmla.ops.schedule import schedule_into

    with pytest.raises(ValueError, match=name):
        schedule_into(*bad(*_buffers()), 16)
    lens, md, ns = _buffers()
    schedule_into(lens, md, ns, 16)
    want_md, want_ns = pagedmla.get_mla_metadata(lens, 16, 1, num_sm_parts=3)
    assert torch.equal(md, want_md) and torch.equal(ns, want_ns)


@pytest.mark.parametrize("rows", [0, -2, 1.5, True, None])
def test_schedule_into_rejects_rows(rows):
    from pagedmla.ops.schedule import schedule_into

    with pytest.raises(ValueError, match="num_q_tokens_per_head_k"):
        schedule_into(*_buffers(), rows)


# ----------------------------------------------------------------------------------------------------
# MLAKVCache
# ----------------------------------------------------------------------------------------------------

def small_cache():
    return MLAKVCache(num_layers=2, num_pages=4, page_size=4, kv_dim=24, dtype=F32)


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_layers=0), "num_layers"),
    (dict(num_pages=0), "num_pages"),
    (dict(kv_dim=0), "kv_dim"),
    (dict(page_size=3), "page_size"),
    (dict(page_size=512), "page_size"),
    (dict(page_size=0), "page_size"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(dtype=torch.float8_e5m2), "dtype"),
    (dict(dtype="fp8_ds_mla"), "kv_dim"),  # 656-byte rows hold 576 columns
    (dict(k_scale=0.5), "k_scale"),  # only an fp8_e4m3 cache has one
    (dict(dtype="fp8_e4m3", k_scale=-1.0), "k_scale"),
    (dict(dtype="fp8_e4m3", k_scale=True), "k_scale"),
])
def test_kv_cache_constructor_rejects(kwargs, name):
    base = dict(num_layers=2, num_pages=4, page_size=4, kv_dim=24, dtype=F32)
    base.update(kwargs)
    with pytest.raises(ValueError, match=names(name)):
        MLAKVCache(**base)


def _write_cases():
    g = gen("write_cases")
    rows = torch.randn(3, 24, generator=g)
    loc = torch.tensor([1, 5, 9])
    return {
        "latent int": (dict(latent=rows.to(I32)), "latent"),
        "latent width": (dict(latent=rows[:, :23]), "latent"),
        "latent [T, 2, D]": (dict(latent=rows.reshape(3, 2, 12)), "latent"),
        "latent rank 1": (dict(latent=rows.flatten()), "latent"),
        "loc int32": (dict(out_cache_loc=loc.to(I32)), "out_cache_loc"),
        "loc rank 2": (dict(out_cache_loc=loc[None]), "out_cache_loc"),
        "loc count": (dict(out_cache_loc=loc[:2]), "out_cache_loc"),
        "loc beyond cache": (dict(out_cache_loc=torch.tensor([1, 5, 16])), "out_cache_loc"),
        "loc negative": (dict(out_cache_loc=torch.tensor([1, -1, 9])), "out_cache_loc"),
        "layer out of range": (dict(layer_id=2), "layer_id"),
        "layer negative": (dict(layer_id=-1), "layer_id"),
    }, rows, loc


WRITE_CASES, _ROWS, _LOC = _write_cases()


@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_kv_cache_write_rejects_and_leaves_buffer_untouched(case):
    cache = small_cache()
    for b in cache.buffers:
        b.copy_(torch.randn(b.shape, generator=gen("fill", case)))
    before = [b.clone() for b in cache.buffers]
    kw, name = WRITE_CASES[case]
    args = dict(layer_id=1, out_cache_loc=_LOC, latent=_ROWS)
    args.update(kw)
    with pytest.raises(ValueError, match=names(name)):
        cache.write(args["layer_id"], args["out_cache_loc"], args["latent"])
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers))


def _write_split_cases():
    g = gen("write_split_cases")
    c, r = torch.randn(3, 16, generator=g), torch.randn(3, 8, generator=g)
    loc = torch.tensor([0, 7, 15])
    return {
        "c_kv int": (dict(c_kv=c.to(I32)), "c_kv"),
        "k_pe int": (dict(k_pe=r.to(I64)), "k_pe"),
        "widths do not add up": (dict(k_pe=r[:, :7]), "c_kv"),
        "row counts differ": (dict(k_pe=r[:2]), "k_pe"),
        "c_kv rank 1": (dict(c_kv=c.flatten()), "c_kv"),
        "loc count": (dict(out_cache_loc=loc[:2]), "out_cache_loc"),
        "loc beyond cache": (dict(out_cache_loc=torch.tensor([0, 7, 16])), "out_cache_loc"),
        "loc negative": (dict(out_cache_loc=torch.tensor([-2, 7, 8])), "out_cache_loc"),
        "loc int32": (dict(out_cache_loc=loc.to(I32)), "out_cache_loc"),
    }, c, r, loc


SPLIT_CASES, _C, _R, _SLOC = _write_split_cases()


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_kv_cache_write_split_rejects_and_leaves_buffer_untouched(case):
    cache = small_cache()
    for b in cache.buffers:
        b.copy_(torch.randn(b.shape, generator=gen("fill_split", case)))
    before = [b.clone() for b in cache.buffers]
    kw, name = SPLIT_CASES[case]
    args = dict(layer_id=0, out_cache_loc=_SLOC, c_kv=_C, k_pe=_R)
    args.update(kw)
    with pytest.raises(ValueError, match=names(name)):
        cache.write_split(args["layer_id"], args["out_cache_loc"], args["c_kv"], args["k_pe"])
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers))


@pytest.mark.parametrize("slots,name", [
    (torch.tensor([0, 3], dtype=I32), "slots"),
    (torch.tensor([[0, 3]]), "slots"),
    (torch.tensor([0, 16]), "slots"),
    (torch.tensor([-1, 3]), "slots"),
    (torch.tensor([0.0, 3.0]), "slots"),
])
def test_kv_cache_gather_rejects(slots, name):
    with pytest.raises(ValueError, match=names(name)):
        small_cache().gather(0, slots)


def test_kv_cache_gather_rejects_bad_layer():
    with pytest.raises(ValueError, match=names("layer_id")):
        small_cache().gather(5, torch.tensor([0]))


# ----------------------------------------------------------------------------------------------------
# PageAllocator / RequestTable
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, -3, 2.0, True])
def test_allocator_constructor_rejects(n):
    with pytest.raises(ValueError, match=names("num_pages")):
        PageAllocator(n)


@pytest.mark.parametrize("n", [-1, 1.0, True])
def test_allocator_allocate_rejects_bad_count(n):
    with pytest.raises(ValueError, match="^n:"):
        PageAllocator(5).allocate(n)


@pytest.mark.parametrize("pages", [[0], [5], [-1], [2], [1, 1], [1.0]])
def test_allocator_free_rejects(pages):
    alloc = PageAllocator(5)
    alloc.allocate(1)  # page 1 live; 2, 3, 4 free
    with pytest.raises(ValueError, match="pages"):
        alloc.free(pages)
    assert alloc.num_free == 3 and alloc.refcount(1) == 1


@pytest.mark.parametrize("pages", [[0], [7], [3]])
def test_allocator_share_rejects(pages):
    alloc = PageAllocator(5)
    alloc.allocate(2)
    with pytest.raises(ValueError, match="pages"):
        alloc.share(pages)


@pytest.mark.parametrize("kwargs,name", [
    (dict(page_size=0), "page_size"),
    (dict(max_requests=0), "max_requests"),
    (dict(max_pages_per_request=0), "max_pages_per_request"),
    (dict(max_requests=2.0), "max_requests"),
])
def test_request_table_constructor_rejects(kwargs, name):
    base = dict(page_size=4, max_requests=2, max_pages_per_request=3)
    base.update(kwargs)
    with pytest.raises(ValueError, match=names(name)):
        RequestTable(PageAllocator(8), **base)


def test_request_table_rejects():
    table = RequestTable(PageAllocator(8), page_size=4, max_requests=2, max_pages_per_request=3)
    r = table.add_request()
    with pytest.raises(ValueError, match="num_tokens"):
        table.ensure_capacity(r, 13)  # 4 pages > 3
    with pytest.raises(ValueError, match="num_tokens"):
        table.ensure_capacity(r, -1)
    table.ensure_capacity(r, 5)
    with pytest.raises(ValueError, match="start"):
        table.token_slots(r, 0, 9)
    with pytest.raises(ValueError, match="start"):
        table.token_slots(r, -1, 2)
    with pytest.raises(ValueError, match="start"):
        table.token_slots(r, 3, 2)
    with pytest.raises(ValueError, match="^slot:"):
        table.token_slots(1, 0, 1)
    with pytest.raises(ValueError, match="^slot:"):
        table.free_request(1)
    with pytest.raises(ValueError, match="shared_pages"):
        table.add_request(shared_pages=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="pages"):
        table.add_request(shared_pages=[7])  # not allocated
    table.add_request()
    with pytest.raises(OutOfPagesError):
        table.add_request()


# ----------------------------------------------------------------------------------------------------
# MLAConfig
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(num_heads=16, attn_tp_size=3), "num_heads"),
    (dict(num_heads=0), "num_heads"),
    (dict(attn_tp_size=0), "attn_tp_size"),
    (dict(kv_lora_rank=-512), "kv_lora_rank"),
    (dict(v_head_dim=128.0), "v_head_dim"),
    (dict(dtype="float13"), "dtype"),
    (dict(dtype=torch.int32, kv_cache_dtype="bfloat16"), "dtype"),
    (dict(dtype=42), "dtype"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(dtype="fp8"), "dtype"),
    (dict(kv_cache_dtype=torch.float8_e5m2), "kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8_ds_mla", kv_lora_rank=256), "kv_cache_dtype"),
    (dict(kv_cache_scale=0.5), "kv_cache_scale"),
    (dict(kv_cache_dtype="fp8_ds_mla", kv_cache_scale=0.5), "kv_cache_scale"),
    (dict(kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.0), "kv_cache_scale"),
    (dict(kv_cache_dtype="fp8", kv_cache_scale=float("inf")), "kv_cache_scale"),
    (dict(page_size=48), "page_size"),
    (dict(page_size=512), "page_size"),
    (dict(page_size=0), "page_size"),
    (dict(page_size=3), "page_size"),
    (dict(extend_prefix_mode="eager"), "extend_prefix_mode"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
    (dict(is_draft=True, num_draft_tokens=0), "is_draft"),
    (dict(softmax_scale=-0.1), "softmax_scale"),
    (dict(softmax_scale=0.0), "softmax_scale"),
    (dict(softmax_scale=True), "softmax_scale"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_context_len=0), "max_context_len"),
])
def test_mla_config_rejects(kwargs, name):
    with pytest.raises(ValueError, match=names(name)):
        MLAConfig(**kwargs)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16, 64, 128, 256])
def test_mla_config_accepts_power_of_two_page_sizes(page_size):
    assert MLAConfig(page_size=page_size).page_size == page_size


@pytest.mark.parametrize("spelling,dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                            ("torch.float16", torch.float16), ("fp16", torch.float16),
                                            ("float32", torch.float32), (torch.float16, torch.float16)])
def test_mla_config_dtype_spellings(spelling, dtype):
    cfg = MLAConfig(dtype=spelling)
    assert cfg.dtype == dtype and cfg.kv_cache_dtype == dtype


@pytest.mark.parametrize("spelling,storage,fmt", [("fp8", torch.float8_e4m3fn, "fp8_e4m3"),
                                                  ("fp8_e4m3", torch.float8_e4m3fn, "fp8_e4m3"),
                                                  (torch.float8_e4m3fn, torch.float8_e4m3fn, "fp8_e4m3"),
                                                  ("fp8_ds_mla", torch.uint8, "fp8_ds_mla"),
                                                  (torch.uint8, torch.uint8, "fp8_ds_mla"),
                                                  ("bf16", torch.bfloat16, None)])
def test_mla_config_kv_cache_formats(spelling, storage, fmt):
    import dataclasses

    cfg = MLAConfig(kv_cache_dtype=spelling)
    assert (cfg.kv_cache_dtype, cfg.kv_format, cfg.dtype) == (storage, fmt, torch.bfloat16)
    again = dataclasses.replace(cfg)  # a checked config checks again to the same fields
    assert (again.kv_cache_dtype, again.kv_format) == (storage, fmt)


def test_mla_config_defaults_and_derived_fields():
    cfg = MLAConfig(num_heads=128, attn_tp_size=8, page_size=16, max_context_len=100)
    assert cfg.num_local_heads == 16 and cfg.kv_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.max_pages_per_request == 7
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)
    assert MLAConfig().page_size == 64


DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 61, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}


def yarn_scale(factor, mscale_all_dim, qk_head_dim=192):
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return qk_head_dim ** -0.5 * mscale ** 2


def test_from_hf_config_dict_with_yarn():
    cfg = MLAConfig.from_hf_config(DEEPSEEK_V3, attn_tp_size=8, page_size=32)
    assert (cfg.num_heads, cfg.num_local_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (128, 16, 512, 64)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_layers) == (128, 128, 61)
    assert cfg.page_size == 32 and cfg.max_context_len == 163840 and cfg.dtype == torch.bfloat16
    assert cfg.softmax_scale == pytest.approx(yarn_scale(40, 1.0), rel=1e-12)
    assert cfg.softmax_scale != pytest.approx(192 ** -0.5, rel=1e-3)


def test_from_hf_config_dict_v2_lite_mscale():
    d = dict(DEEPSEEK_V3, num_attention_heads=16, rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707,
                                                                "mscale_all_dim": 0.707})
    cfg = MLAConfig.from_hf_config(d)
    assert cfg.softmax_scale == pytest.approx(yarn_scale(40, 0.707), rel=1e-12)


def test_from_hf_config_dict_without_rope_scaling_and_overrides():
    d = {k: v for k, v in DEEPSEEK_V3.items() if k != "rope_scaling"}
    cfg = MLAConfig.from_hf_config(d, dtype="float16", attn_tp_size=2)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)
    assert cfg.dtype == torch.float16 and cfg.num_local_heads == 64


@pytest.mark.parametrize("field", ["num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                   "v_head_dim"])
def test_from_hf_config_missing_mla_field(field):
    d = {k: v for k, v in DEEPSEEK_V3.items() if k != field}
    with pytest.raises(ValueError, match=field):
        MLAConfig.from_hf_config(d)


def test_from_hf_config_rejects_llama_like_config():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig.from_hf_config({"num_attention_heads": 32, "hidden_size": 4096, "head_dim": 128})


def test_from_hf_config_override_is_still_validated():
    with pytest.raises(ValueError, match="num_heads"):
        MLAConfig.from_hf_config(DEEPSEEK_V3, attn_tp_size=3)
    with pytest.raises(ValueError, match="page_size"):
        MLAConfig.from_hf_config(DEEPSEEK_V3, page_size=100)


@pytest.fixture(scope="module")
def deepseek_v3_config_cls():
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config


def test_from_hf_config_transformers_object_with_yarn(deepseek_v3_config_cls):
    hf = deepseek_v3_config_cls(num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=3,
                                rope_scaling={"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                                              "original_max_position_embeddings": 4096, "beta_fast": 32,
                                              "beta_slow": 1, "rope_theta": 10000.0})
    cfg = MLAConfig.from_hf_config(hf, attn_tp_size=4)
    assert (cfg.num_heads, cfg.num_local_heads, cfg.num_layers) == (32, 8, 3)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (512, 64, 128, 128)
    assert cfg.softmax_scale == pytest.approx(yarn_scale(32.0, 0.8), rel=1e-12)


def test_from_hf_config_transformers_object_without_yarn(deepseek_v3_config_cls):
    hf = deepseek_v3_config_cls(num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=2,
                                qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=256)
    cfg = MLAConfig.from_hf_config(hf)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (256, 32, 64, 64)
    assert cfg.kv_dim == 288
    assert cfg.softmax_scale == pytest.approx(96 ** -0.5, rel=1e-15)


def test_from_hf_config_transformers_object_missing_fields():
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig.from_hf_config(transformers.LlamaConfig(num_attention_heads=8, hidden_size=256))


def test_available_providers_names_the_ops():
    assert "torch" in pagedmla.available_providers("paged_decode")
    with pytest.raises(ValueError, match=names("op")) as exc:
        pagedmla.available_providers("decode")
    for op in ("paged_decode", "paged_varlen", "varlen", "merge"):
        assert op in str(exc.value)
