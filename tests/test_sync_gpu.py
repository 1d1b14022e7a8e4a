"""No host synchronisation on any CUDA path (the contract in pagedmla.errors and the README): every public op and every
backend mode, eager and as CUDA graphs, inside ``torch.cuda.set_sync_debug_mode("error")``; the compiled
kernels' value guards in bf16 (the CPU file test_guards.py runs them under the interpreter); the lean
decode and paged prefill launches (second call of a shape) equal to the full path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from oracle import gen, make_paged_cache
from test_backend import Harness

import pagedmla
from pagedmla import errors
from pagedmla.backend import ForwardBatch, ForwardMode
from pagedmla.kernels.triton import paged_varlen
from pagedmla.kernels.triton.decode import paged_decode_triton
from pagedmla.kernels.triton.rows import dequantize_pages
from pagedmla.kernels.triton.sm90.paged_varlen import launch_bound_paged_varlen_sm90 as paged_varlen_sm90_bound

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2


@contextlib.contextmanager
def no_sync():
    """Any synchronising CUDA call inside raises (PyTorch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _decode_inputs(b, q_len, heads, lens, seed):
    g = gen("sync decode", seed)
    c = make_paged_cache(lens, 64, 576, torch.bfloat16, generator=g, extra_pages=2)
    q = (torch.randn(b, q_len, heads, 576, generator=g) / 4).bfloat16().cuda()
    return q, c.k_cache.cuda(), c.block_table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()


@pytest.mark.parametrize("q_len,heads", [(1, 16), (1, 128), (2, 64), (4, 16)])
def test_public_ops_never_synchronise(q_len, heads):
    b = 6
    lens = [int(x) for x in torch.randint(1, 900, (b,), generator=gen("lens", heads))]
    q, k_cache, table, seqlens = _decode_inputs(b, q_len, heads, lens, heads)
    t = 40
    qv = (torch.randn(t, heads, 576, generator=gen("qv")) / 4).bfloat16().cuda()
    qo = torch.tensor([0, 7, 7, 20, 30, 31, 40], dtype=torch.int32).cuda()
    qm, km = (torch.randn(2, 300, 16, 192, generator=gen("mha")) / 4).bfloat16().cuda()
    vm = (torch.randn(300, 16, 128, generator=gen("mha v")) / 4).bfloat16().cuda()
    cu = torch.tensor([0, 100, 220, 300], dtype=torch.int32).cuda()
    o1, s1 = torch.randn(300, 16, 128).bfloat16().cuda(), torch.randn(300, 16).cuda()

    def calls():
        meta, splits = pagedmla.get_mla_metadata(seqlens, q_len * heads, 1)
        out = pagedmla.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits, causal=True)
        pv = pagedmla.flash_mla_varlen_with_kvcache(qv, k_cache, table, seqlens, qo, 512, causal=True)
        ov = pagedmla.flash_attn_varlen_func(qm, km, vm, cu, cu, 120, 120, causal=True)
        ovp = pagedmla.flash_attn_varlen_func(qm[:30], km[:30], vm[:30], cu.clamp(max=30), cu.clamp(max=30), 100, 100,
                                              causal=True)  # short queries: the portable kernel
        mg = pagedmla.merge_state(ov, s1, o1, s1)
        return out, pv, ov, ovp, mg

    first = calls()  # compiles the kernels and builds the launch plans
    with no_sync():
        eager = calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    with no_sync():
        graph.replay()
    torch.cuda.synchronize()
    for a, b_, c in zip(torch.utils._pytree.tree_leaves(first), torch.utils._pytree.tree_leaves(eager),
                        torch.utils._pytree.tree_leaves(captured)):
        assert torch.equal(a, b_) and torch.equal(a, c)
    assert errors.device_errors() == 0


@pytest.mark.parametrize("heads", [16, 128])
def test_every_backend_mode_never_synchronises(heads):
    h = Harness(heads=heads, page_size=64, num_pages=20000 // 64 + 8, max_context=4096, num_draft_tokens=3,
                seed=heads, device="cuda", dtype=torch.bfloat16, provider="triton", tol=BF16_TOL)
    lens = [1, 65, 700, 1500, 63]
    slots = [h.add() for _ in lens]
    for _ in range(2):  # the first pass compiles and plans, the second runs the warm path
        h.step(ForwardMode.EXTEND, slots, lens, around=no_sync)
        h.step(ForwardMode.DECODE, slots, [1] * len(slots), around=no_sync)
        h.step(ForwardMode.TARGET_VERIFY, slots, [3] * len(slots), around=no_sync)
        h.backend.config.extend_prefix_mode = "absorbed"
        h.step(ForwardMode.EXTEND, slots, [200, 1, 5, 64, 0], around=no_sync)
        h.backend.config.extend_prefix_mode = "chunked"
        h.backend.config.chunked_prefix_capacity = 1024
        h.step(ForwardMode.EXTEND, slots, [300, 2, 17, 1, 9], around=no_sync)
        for kernel in ("varlen", "decode"):  # the decodes in the varlen launch, then split off
            h.backend.config.mixed_decode_kernel = kernel
            h.step(ForwardMode.MIXED, slots, [50, 7, 1, 1, 1], num_extends=2, around=no_sync)
            assert h.backend.metadata.split_decodes == (3 if kernel == "decode" else 0)
        h.step(ForwardMode.MIXED, slots, [1] * len(slots), num_extends=0, around=no_sync)  # decodes alone
        h.backend.config.extend_prefix_mode = "auto"
        lens = [1] * len(slots)
    draft = Harness(heads=heads, page_size=64, num_pages=400, max_context=4096, num_draft_tokens=3, is_draft=True,
                    seed=heads + 1, device="cuda", dtype=torch.bfloat16, provider="triton", tol=BF16_TOL)
    dslots = [draft.add() for _ in range(3)]
    draft.step(ForwardMode.EXTEND, dslots, [40, 90, 7])
    for _ in range(2):
        draft.step(ForwardMode.DRAFT_EXTEND, dslots, [2, 3, 1], around=no_sync)
    assert errors.device_errors() == 0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_ds_mla"])
def test_fp8_absorbed_steps_never_synchronise(kv_cache_dtype, monkeypatch):
    """Absorbed EXTEND and MIXED steps over an FP8 cache, one long request among short ones: the pages each host
    length spans are planned and staged with qo_indptr (a workspace of one page per table entry, 5 x 63 pages,
    would exceed the cache's 120 and run the portable kernel), the Hopper kernel runs over them, and nothing
    synchronises; each step against the oracle on the rows decoded from the cache."""
    h = Harness(heads=16, page_size=64, num_pages=120, max_context=8192, seed=5, device="cuda",
                dtype=torch.bfloat16, provider="triton", tol=BF16_TOL, kv_cache_dtype=kv_cache_dtype,
                kv_cache_scale=6 / 448 if kv_cache_dtype == "fp8_e4m3" else None)
    layouts = []  # the page counts the Hopper path's workspaces were sized by

    def spy(*args):
        layouts.append(args[-1])
        return dequantize_pages(*args)

    monkeypatch.setattr(paged_varlen, "dequantize_pages", spy)
    slots = [h.add() for _ in range(5)]
    h.step(ForwardMode.EXTEND, slots, [3900, 20, 70, 1, 130])
    h.backend.config.extend_prefix_mode = "absorbed"
    for new in ([16, 3, 5, 1, 64], [2, 1, 1, 7, 9]):  # the first pass compiles and plans, the second runs warm
        assert h.step(ForwardMode.EXTEND, slots, new, around=no_sync) == "absorbed"
        assert h.backend.metadata.num_kv_pages < h.cache.num_pages < 5 * h.backend.metadata.block_table.shape[1]
        h.backend.config.mixed_decode_kernel = "varlen"
        h.step(ForwardMode.MIXED, slots, [9, 4, 1, 1, 1], num_extends=2, around=no_sync)
        h.backend.config.mixed_decode_kernel = "decode"  # the decodes read the FP8 cache in the decode kernel
        h.step(ForwardMode.MIXED, slots, [9, 4, 1, 1, 1], num_extends=2, around=no_sync)
        assert h.backend.metadata.num_kv_pages == sum(-(-h.hist[s].shape[0] // 64) for s in slots[:2])
    assert len(layouts) == 6 and all(0 < n < h.cache.num_pages for n in layouts), layouts
    assert errors.device_errors() == 0


@pytest.mark.parametrize("mode,q_len", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)])
def test_graph_replay_planning_never_synchronises(mode, q_len):
    h = Harness(heads=16, page_size=64, num_pages=600, max_context=8192, num_draft_tokens=3, seed=q_len,
                device="cuda", dtype=torch.bfloat16, provider="triton", tol=BF16_TOL, max_bs=32)
    slots = [h.add() for _ in range(8)]
    h.step(ForwardMode.EXTEND, slots, [h.rng.randint(1, 2000) for _ in slots])
    be, dev, bs = h.backend, h.device, 16
    be.init_cuda_graph_state(32)
    be.init_forward_metadata_capture_cuda_graph(bs, torch.zeros(bs, dtype=torch.int64, device=dev),
                                                torch.ones(bs, dtype=torch.int32, device=dev), mode)
    q = torch.zeros(bs * q_len, 16, 576, dtype=torch.bfloat16, device=dev)
    lat = torch.zeros(bs * q_len, 1, 576, dtype=torch.bfloat16, device=dev)
    loc = torch.zeros(bs * q_len, dtype=torch.int64, device=dev)
    be.forward(q, lat, None, 0, loc, h.cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = be.forward(q, lat, None, 0, loc, h.cache)
    real = torch.tensor(slots, device=dev)
    pre = [h.hist[s].shape[0] for s in slots]
    seq = torch.tensor([p + q_len for p in pre], dtype=torch.int32, device=dev)
    for s, p in zip(slots, pre):
        h.table.ensure_capacity(s, p + q_len)
    # The new tokens' latent rows go to their own slots (the cache holds NaN everywhere else).
    loc[: len(slots) * q_len].copy_(torch.cat([h.table.token_slots(s, p, p + q_len) for s, p in zip(slots, pre)]))
    lat.copy_(h.dev(h.rand(bs * q_len, 1, 576)))
    q.copy_(h.dev(h.rand(bs * q_len, 16, 576)))
    with no_sync():
        be.init_forward_metadata_replay_cuda_graph(bs, real, seq, mode, block_table=h.table.block_table,
                                                   raw_bs=len(slots))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out[: len(slots) * q_len].float()).all()


@pytest.mark.parametrize("heads", [16, 128])
def test_bound_launch_equals_first_call(heads):
    """The second call of a shape launches through BoundLaunch (addresses as integers, cached tensor maps):
    exactly the first, JIT-launched call's results, also for new tensors at other addresses."""
    lens = [300, 1, 5000, 64, 65]
    q, k_cache, table, seqlens = _decode_inputs(5, 1, heads, lens, 7)
    meta, splits = pagedmla.get_mla_metadata(seqlens, heads, 1)
    first = paged_decode_triton(q, k_cache, table, seqlens, 512, meta, splits, 576 ** -0.5, True)
    second = paged_decode_triton(q, k_cache, table, seqlens, 512, meta, splits, 576 ** -0.5, True)
    third = paged_decode_triton(q.clone(), k_cache.clone(), table.clone(), seqlens.clone(), 512, meta.clone(),
                                splits.clone(), 576 ** -0.5, True)
    for a, b_, c in zip(first, second, third):
        assert torch.equal(a, b_) and torch.equal(a, c)


@pytest.mark.parametrize("heads", [16, 128])
def test_bound_launch_per_alignment_of_the_lengths(heads, monkeypatch):
    """Lengths passed as a slice 4 bytes into a buffer (``buf[1:]``) get a bound launch of their own, compiled
    for that alignment, from their second call on (they used to rebuild the launch on every call: 121 µs of
    host time against 44 on an H100 machine); calls with aligned lengths keep theirs. Every call's results equal
    a fresh plan's full path on the same values, which change between calls."""
    from pagedmla.kernels.triton import decode, launch

    lens = [300, 1, 5000, 64, 65]
    q, k_cache, table, seqlens = _decode_inputs(5, 1, heads, lens, 11)
    sliced = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")[1:]
    assert sliced.data_ptr() % 16 == 4
    monkeypatch.setattr(decode, "_PLANS", {})
    bound_launches = []
    direct = launch.BoundLaunch.launch
    monkeypatch.setattr(launch.BoundLaunch, "launch", lambda self, *a: bound_launches.append(1) or direct(self, *a))
    for call in range(3):
        seqlens.copy_(torch.tensor([max(1, n - 7 * call) for n in lens], dtype=torch.int32))
        sliced.copy_(seqlens)
        meta, splits = pagedmla.get_mla_metadata(seqlens, heads, 1)
        for lengths in (seqlens, sliced):
            plans = decode._PLANS
            decode._PLANS = {}  # a fresh plan: its first call takes the full path
            full = paged_decode_triton(q, k_cache, table, lengths, 512, meta, splits, 576 ** -0.5, True)
            decode._PLANS = plans
            before = len(bound_launches)
            out = paged_decode_triton(q, k_cache, table, lengths, 512, meta, splits, 576 ** -0.5, True)
            # main + combine through their bound launches from each alignment's second call on
            assert len(bound_launches) - before == (2 if call else 0), (call, lengths is sliced)
            assert torch.equal(out[0], full[0]) and torch.equal(out[1], full[1]), (call, lengths is sliced)
    (plan,) = decode._PLANS.values()
    assert sorted(plan.bound) == [0, 0b10]  # all aligned; the lengths (second plain pointer) 4 bytes off


@pytest.mark.parametrize("heads", [16, 128])
def test_bound_paged_prefill_equals_full_path(heads, monkeypatch):
    """A 16-bit paged prefill call shaped like an earlier one launches through BoundLaunch: on other tensors
    (other values, other addresses) exactly what the full path gives on them; an unaligned lengths slice takes
    the full path once, then a launch bound for its alignment."""
    kv_lens, q_lens = [400, 900, 130, 1], [100, 37, 64, 1]
    qo = torch.tensor([0, 100, 137, 201, 202], dtype=torch.int32).cuda()

    def inputs(seed):
        g = gen("bound paged prefill", heads, seed)
        c = make_paged_cache(kv_lens, 64, 576, torch.bfloat16, generator=g, extra_pages=2)
        q = (torch.randn(sum(q_lens), heads, 576, generator=g) / 4).bfloat16().cuda()
        return q, c.k_cache.cuda(), c.block_table.cuda(), torch.tensor(kv_lens, dtype=torch.int32).cuda()

    paged_varlen._sm90_bound.clear()
    launched = []
    monkeypatch.setattr(paged_varlen, "launch_bound_paged_varlen_sm90",
                        lambda *a: launched.append(1) or paged_varlen_sm90_bound(*a))
    kept = inputs(0)  # alive, so that the second call's tensors live at other addresses
    first = pagedmla.flash_mla_varlen_with_kvcache(*kept, qo, 512, causal=True)
    if not paged_varlen._sm90_bound:
        pytest.skip("the Hopper paged prefill kernel does not run here")
    q, k_cache, table, lens = inputs(1)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(kept, (q, k_cache, table, lens)))
    bound = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, lens, qo, 512, causal=True)
    assert launched == [1]
    paged_varlen._sm90_bound.clear()
    full = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, lens, qo, 512, causal=True)
    assert not torch.equal(first[0], full[0])
    assert torch.equal(bound[0], full[0]) and torch.equal(bound[1], full[1])
    padded = torch.cat([lens.new_zeros(1), lens])
    shifted = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, padded[1:], qo, 512, causal=True)
    assert launched == [1] and torch.equal(shifted[0], full[0])
    shifted = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, padded[1:], qo, 512, causal=True)
    assert launched == [1, 1] and torch.equal(shifted[0], full[0]) and torch.equal(shifted[1], full[1])


def test_bound_ragged_prefill_equals_full_path(monkeypatch):
    """A ragged prefill call shaped like an earlier one launches through BoundLaunch and gives what the full
    path gives on its tensors; cumulative lengths passed as a slice 4 bytes into a buffer get a launch bound for
    their alignment from their second call on; q whose rows are not contiguous (copied per call) never binds, so
    the caller's strided rows are never read as dense ones."""
    from pagedmla.kernels.triton import launch, varlen

    g = gen("bound ragged prefill")
    t, heads = 700, 16
    cu = torch.tensor([0, 250, 251, 700], dtype=torch.int32).cuda()
    q, k = (torch.randn(2, t, heads, 192, generator=g) / 4).bfloat16().cuda()
    v = (torch.randn(t, heads, 128, generator=g) / 4).bfloat16().cuda()
    monkeypatch.setattr(varlen, "_sm90_bound", {})
    launched = []
    direct = launch.BoundLaunch.launch
    monkeypatch.setattr(launch.BoundLaunch, "launch", lambda self, *a: launched.append(1) or direct(self, *a))

    def call(qx, cux):
        return pagedmla.flash_attn_varlen_func(qx, k, v, cux, cux, 450, 450, causal=True, return_attn_probs=True)[:2]

    def full(qx, cux):
        keep, varlen._sm90_bound = varlen._sm90_bound, {}
        try:
            return call(qx, cux)
        finally:
            varlen._sm90_bound = keep

    ref = full(q, cu)
    call(q, cu)
    if not varlen._sm90_bound:
        pytest.skip("the Hopper ragged prefill kernel does not run here")
    sliced = torch.cat([cu[:1], cu])[1:]
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, last-dim stride 16
    assert sliced.data_ptr() % 16 == 4 and strided.stride(-1) != 1
    for step in range(2):
        for name, qx, cux, bound in (("aligned", q, cu, True), ("sliced", q, sliced, step > 0),
                                     ("strided", strided, cu, False)):
            before = len(launched)
            out, lse = call(qx, cux)
            assert len(launched) - before == int(bound), (step, name)
            assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), (step, name)
    assert torch.equal(full(strided, cu)[0], ref[0])


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("bad", ["page", "negative", "beyond", "schedule", "schedule_two_parts"])
def test_compiled_decode_guards(heads, bad):
    """The guards compiled (bf16, portable and Hopper kernels): the bad request NaN, the others exact, the
    bit set, no device assert (the context stays usable). ``schedule_two_parts``: a bad schedule of two
    parts, so that requests past the first are in one piece and the combine runs as the main kernel's
    programmatic dependent, whose one-piece programs leave before its wait (request 0's write their NaN)."""
    lens = [300, 1000, 70, 2000]
    q, k_cache, table, seqlens = _decode_inputs(4, 1, heads, lens, 11)
    meta, splits = pagedmla.get_mla_metadata(seqlens, heads, 1)
    clean_out, clean_lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits, causal=True)
    errors.device_errors()
    if bad == "page":
        table[1, 3] = 10 ** 6
    elif bad == "schedule":
        meta, splits = pagedmla.get_mla_metadata(seqlens.flip(0), heads, 1)
    elif bad == "schedule_two_parts":
        meta, splits = pagedmla.get_mla_metadata(seqlens.flip(0), heads, 1, num_sm_parts=2)
        assert (splits.diff() == 1).sum() >= 2  # one-piece requests past request 0
    if bad in ("negative", "beyond"):
        bad_lens = seqlens.clone()
        bad_lens[1] = -5 if bad == "negative" else 10 ** 9
        # The default plan depends on every length: schedule both runs alike (one part per request) to compare.
        meta, splits = pagedmla.get_mla_metadata(bad_lens, heads, 1, num_sm_parts=1)
        cm, cs = pagedmla.get_mla_metadata(seqlens, heads, 1, num_sm_parts=1)
        clean_out, clean_lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, cm, cs, causal=True)
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, bad_lens, 512, meta, splits, causal=True)
    else:
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits, causal=True)
    torch.cuda.synchronize()
    bits = errors.device_errors()
    if bad.startswith("schedule"):
        assert out.isnan().all() and lse.isnan().all() and bits & errors.SCHEDULE
        return
    assert out[1].isnan().all() and lse[1].isnan().all()
    keep = [0, 2, 3]
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
    assert bits == {"page": errors.BLOCK_TABLE, "negative": errors.NEGATIVE_LENGTH,
                    "beyond": errors.LENGTH_BEYOND_TABLE}[bad]


@pytest.mark.parametrize("bad", ["page", "negative", "qo"])
def test_compiled_paged_prefill_guards(bad):
    g = gen("paged prefill guards", bad)
    kv_lens, q_lens = [400, 900, 130], [100, 37, 64]
    c = make_paged_cache(kv_lens, 64, 576, torch.bfloat16, generator=g, extra_pages=2)
    k_cache, table = c.k_cache.cuda(), c.block_table.cuda()
    q = (torch.randn(sum(q_lens), 16, 576, generator=g) / 4).bfloat16().cuda()
    qo = torch.tensor([0, 100, 137, 201], dtype=torch.int32).cuda()
    lens = torch.tensor(kv_lens, dtype=torch.int32).cuda()
    clean_out, clean_lse = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, lens, qo, 512)
    errors.device_errors()
    if bad == "page":
        table[1, 5] = -3
    elif bad == "negative":
        lens[1] = -1
    else:
        qo[2] = 90
    out, lse = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, lens, qo, 512)
    bits = errors.device_errors()
    if bad == "qo":
        assert out.isnan().all() and lse.isnan().all() and bits == errors.QUERY_INDPTR
        return
    mine = slice(100, 137)
    assert out[mine].isnan().all() and lse[mine].isnan().all()
    keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep[mine] = False
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
    assert bits == (errors.BLOCK_TABLE if bad == "page" else errors.NEGATIVE_LENGTH)


@pytest.mark.parametrize("bad", ["keys", "max_seqlen", "cu_q"])
@pytest.mark.parametrize("lengths", [(600, 130, 900), (100, 3000, 50)])
def test_compiled_varlen_guards(bad, lengths):
    """The Hopper ragged kernel (both tile numberings: equal-ish and skewed lengths)."""
    g = gen("varlen guards", bad, lengths)
    t = sum(lengths)
    q, k = (torch.randn(2, t, 16, 192, generator=g) / 4).bfloat16().cuda()
    v = (torch.randn(t, 16, 128, generator=g) / 4).bfloat16().cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    top = max(lengths)
    clean = pagedmla.flash_attn_varlen_func(q, k, v, cu, cu, top, top, causal=True)
    errors.device_errors()
    cu_q, cu_k, max_q = cu.clone(), cu.clone(), top
    if bad == "keys":
        cu_k[3] = 10 ** 7
        bad_seq = 2
    elif bad == "max_seqlen":
        max_q = lengths[1] - 1
        bad_seq = next(i for i, n in enumerate(lengths) if n > max_q)
    else:
        cu_q[1] = cu_q[2] + 1
    out = pagedmla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, top, causal=True)
    bits = errors.device_errors()
    if bad == "cu_q":
        assert out.isnan().all() and bits == errors.QUERY_INDPTR
        return
    rows = torch.zeros(t, dtype=torch.bool, device="cuda")
    if bad == "max_seqlen":
        rows[:] = torch.tensor([n > max_q for n in lengths for _ in range(n)], device="cuda")
    else:
        rows[int(cu[bad_seq]): int(cu[bad_seq + 1])] = True
    assert out[rows].isnan().all()
    assert torch.equal(out[~rows], clean[~rows])
    assert bits == (errors.KEY_INDPTR if bad == "keys" else errors.MAX_SEQLEN)


def test_backend_bad_request_slot_and_cache_slot():
    """The backend given a request slot beyond its table and a cache slot beyond the cache (device values the
    host never reads): that request NaN, the others as in a clean step, no other cache row written."""
    h = Harness(heads=16, page_size=64, num_pages=200, max_context=4096, seed=5, device="cuda",
                dtype=torch.bfloat16, provider="triton", tol=BF16_TOL)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [100, 300, 50])
    be = h.backend
    seq = [h.hist[s].shape[0] + 1 for s in slots]
    for s, n in zip(slots, seq):
        h.table.ensure_capacity(s, n)
    loc = torch.cat([h.table.token_slots(s, n - 1, n) for s, n in zip(slots, seq)])
    q = (torch.randn(3, 16, 576, generator=gen("bad slot q")) / 4).bfloat16().cuda()
    lat = (torch.randn(3, 1, 576, generator=gen("bad slot lat")) / 4).bfloat16().cuda()
    seq_t = torch.tensor(seq, dtype=torch.int32, device="cuda")

    def run(req, locs):
        be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, req, seq_t, h.table.block_table,
                                              seq_lens_cpu=seq))
        return be.forward(q, lat, None, 0, locs, h.cache)

    clean = run(torch.tensor(slots, device="cuda"), loc)
    errors.device_errors()
    before = h.cache.buffers[0].clone()
    bad_loc = loc.clone()
    bad_loc[1] = h.cache.num_slots + 5
    out = run(torch.tensor([slots[0], 10 ** 5, slots[2]], device="cuda"), bad_loc)
    bits = errors.device_errors()
    assert out[1].isnan().all() and torch.equal(out[[0, 2]], clean[[0, 2]])
    assert bits == errors.REQUEST_SLOT | errors.CACHE_SLOT | errors.NEGATIVE_LENGTH
    # Only the two good requests' new rows changed (bit patterns: unused slots hold NaN).
    changed = torch.ones(h.cache.num_slots, dtype=torch.bool, device="cuda")
    changed[loc[[0, 2]]] = False
    after = h.cache.buffers[0].view(-1, 576).view(torch.int16)
    assert torch.equal(after[changed], before.view(-1, 576).view(torch.int16)[changed])


@pytest.mark.parametrize("form", ["mha", "chunked"])
def test_backend_mha_forms_bad_device_lengths(form):
    """The MHA forms' length check compiled (bf16, the Hopper ragged kernel beneath): device lengths negative,
    beyond the block-table row and shorter than seq_lens_cpu give those requests NaN rows (one longer than the
    check's programs per request) and their bits, without a synchronisation; the last request is bit-identical
    to the clean step."""
    h = Harness(heads=16, page_size=64, num_pages=200, max_context=4096, seed=7, device="cuda", dtype=torch.bfloat16,
                provider="triton", tol=BF16_TOL, extend_prefix_mode="chunked")
    slots = [h.add() for _ in range(4)]
    if form == "chunked":
        h.step(ForwardMode.EXTEND, slots, [300, 100, 50, 700])
    new = [600, 37, 64, 120]
    pre = [h.hist[s].shape[0] for s in slots]
    seq = [p + n for p, n in zip(pre, new)]
    for s, n in zip(slots, seq):
        h.table.ensure_capacity(s, n)
    loc = torch.cat([h.table.token_slots(s, p, n) for s, p, n in zip(slots, pre, seq)])
    g = gen("mha forms lengths", form)
    q = (torch.randn(sum(new), 16, 192, generator=g) / 4).bfloat16().cuda()
    latent = (torch.randn(sum(new), 576, generator=g) / 4).bfloat16().cuda()
    k, v = h.decompress(latent)

    def run(device_lens):
        batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(slots, device="cuda"),
                             torch.tensor(device_lens, dtype=torch.int32, device="cuda"), h.table.block_table,
                             seq_lens_cpu=seq, extend_seq_lens_cpu=new, extend_prefix_lens_cpu=pre)
        with no_sync():
            h.backend.init_forward_metadata(batch)
            return h.backend.forward(q, k, v, 0, loc, h.cache, latent=latent, kv_decompress=h.decompress)

    clean = run(seq)
    assert h.backend.attention_form == form and errors.device_errors() == 0 and torch.isfinite(clean).all()
    capacity = h.backend.metadata.block_table.shape[1] * 64
    out = run([-1, capacity + 1, seq[2] - 1, seq[3]])
    mine = sum(new[:3])
    assert out[:mine].isnan().all() and torch.equal(out[mine:], clean[mine:])
    assert errors.device_errors() == errors.NEGATIVE_LENGTH | errors.LENGTH_BEYOND_TABLE | errors.PAGE_LAYOUT
