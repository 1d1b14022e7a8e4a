"""The Triton split-KV MLA decode kernels and their schedule: what is specific to them.

Correctness over shapes, lengths, page sizes and dtypes is test_conformance.py's (every provider against the
float64 oracle); here the kernel's configs, carried page ids, NaN-filled launch buffers (every output row
written), the one-launch scheduler kernel, the combine kernel's tiles, the forced Hopper kernel, CUDA-graph
replay and the Hopper descriptors. Inputs and checks come from test_conformance (one cache builder).
"""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest
import torch
from oracle import cos_diff, dense_paged, gather_rows
from test_conformance import (
    BF16,
    DECODE_BOUNDS,
    DECODE_CASES,
    F16,
    DecodeCase,
    assert_matches,
    check_paged_decode,
    decode_inputs,
    fp8_args,
)

from pagedmla import split_plan
from pagedmla.device import pdl_available
from pagedmla.kernels.triton.decode import (
    DecodeConfig,
    _DecodePlan,
    few_requests_block_r,
    launch_combine,
    paged_decode_triton,
    partials_size,
)
from pagedmla.kernels.triton.metadata import schedule_into as schedule_kernel_into
from pagedmla.kernels.triton.sm90.mla import sm90_supported
from pagedmla.ops import flash_mla_with_kvcache, get_mla_metadata
from pagedmla.split_plan import narrow_block, overhead_blocks, plan_into, tile_plan

CPU_F16 = DECODE_BOUNDS[("cpu", F16)]


def launcher(config: DecodeConfig | None = None):
    """A check_paged_decode call running paged_decode_triton with ``config`` into NaN-filled out / lse buffers,
    so a row the kernels do not write stays NaN (and fails the check)."""

    def call(q, k_cache, table, seqlens, dv, meta, splits, causal):
        b, q_len, heads, d = q.shape
        out = torch.full((b, q_len, heads, dv), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((b, heads, q_len), float("nan"), dtype=torch.float32, device=q.device)
        got = paged_decode_triton(q, k_cache, table, seqlens, dv, meta, splits, d ** -0.5, causal, config, out=out,
                                  lse=lse)
        assert got[0] is out and got[1] is lse
        return out, lse

    return call


@pytest.mark.parametrize("name", ["heads64-short", "empty-last", "two-empty"])
def test_decode_writes_every_output_row(name):
    """Rows without keys (an empty request past every part's range, requests shorter than q_len) are written
    too: 0 and LSE -inf, not left as the NaN the buffers start with."""
    case = next(c for c in DECODE_CASES if c.name == name)
    check_paged_decode(launcher(), case, case.causal[0], F16, "cpu", CPU_F16, key="launcher")


@pytest.mark.parametrize("config", [
    DecodeConfig(block_m=32, block_n=32, num_warps=4),
    DecodeConfig(block_m=16, block_n=64, num_warps=4, chunks=4),
    DecodeConfig(block_m=64, block_n=32, num_warps=8, chunks=2),
])
def test_decode_configs(config):
    case = DecodeCase("configs", [0, 1, 64, 97, 190], 1, 16, 16, 4)
    check_paged_decode(launcher(config), case, True, F16, "cpu", CPU_F16, key=config.spec)


def test_config_spec_round_trip_and_errors():
    config = DecodeConfig(block_m=32, block_n=32, num_warps=4, num_stages=3, chunks=4, carry_pages=True)
    assert config.spec == "m32n32w4s3c4p" and DecodeConfig.from_spec(config.spec) == config
    assert DecodeConfig.from_spec("m64n64w8s2c2t").use_tma
    assert DecodeConfig.from_spec("m64n64w8s2c1h").use_sm90 and DecodeConfig(64, use_sm90=True).spec.endswith("h")
    with pytest.raises(ValueError, match="spec"):
        DecodeConfig.from_spec("m64n64w8s2")


@pytest.mark.parametrize("page,block_n,block_m", [(64, 32, 16), (16, 16, 16), (32, 32, 32), (128, 64, 64)])
def test_decode_carried_page_ids(page, block_n, block_m):
    """carry_pages reads each tile's page id one step ahead; lengths cross pages, parts start mid-request,
    and the last step of a range must not read a page id past it."""
    config = DecodeConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=3, chunks=4, carry_pages=True)
    case = DecodeCase(f"carried-page{page}", [0, 1, page - 1, page, page + 1, 3 * page + 5], 2, 16, page, 5)
    check_paged_decode(launcher(config), case, True, F16, "cpu", CPU_F16, key=config.spec)


@pytest.mark.parametrize("kv_format", [None, "fp8_e4m3"])
@pytest.mark.parametrize("q_gain", [1.0, 32.0, 256.0])
def test_decode_running_max_rises_by_small_and_large_steps(q_gain, kv_format):
    """Scores spread over tens of log2 units (q scaled up by powers of two, exact in fp16), so the running max
    rises from tile to tile by more than ``RESCALE_SLACK`` and by less, for some rows and not others: FP8 tiles
    rescale their accumulators only past the slack, 16-bit ones at every step."""
    config = DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, chunks=4, carry_pages=True)
    case = DecodeCase(f"rising-max-{kv_format}", [1, 31, 33, 200, 333], 2, 8, 64, 3, kv_format=kv_format)
    q, cache, k_cache, table, seqlens = decode_inputs(case, F16, "cpu", q_gain)
    q = q * q_gain
    b, q_len, heads, d = q.shape
    meta, splits = get_mla_metadata(seqlens, q_len * heads, 1, num_sm_parts=case.parts)
    out, lse = paged_decode_triton(q, k_cache, table, seqlens, case.dv, meta, splits, d ** -0.5, True, config,
                                   kv_format=kv_format, **fp8_args(kv_format, "cpu"))
    ref_out, ref_lse = dense_paged(q.reshape(b * q_len, heads, d), list(range(0, (b + 1) * q_len, q_len)),
                                   cache.rows, d ** -0.5, True, case.dv)
    assert_matches(out, lse.transpose(1, 2), ref_out.reshape(b, q_len, heads, case.dv),
                   ref_lse.reshape(b, q_len, heads), F16, CPU_F16, f"q x {q_gain}")


def test_decode_rejects_unsupported_dims():
    q, _, cache, table, seqlens = decode_inputs(DecodeCase("d100", [4], 1, 16, 16, None, d=100), F16, "cpu", 0)
    meta, splits = get_mla_metadata(seqlens, 16, 1)
    with pytest.raises(ValueError, match="head_dim_v"):
        paged_decode_triton(q, cache, table, seqlens, 48, meta, splits, 0.1, False)
    with pytest.raises(ValueError, match="q: head dim"):
        paged_decode_triton(q, cache, table, seqlens, 64, meta, splits, 0.1, False)


def _random_lengths(rng: random.Random, b: int) -> list[int]:
    return [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000), rng.randint(0, 200000)]) for _ in range(b)]


def test_narrow_block_and_tile_plan_follow_the_measured_row_ranges(monkeypatch):
    """The narrow form's Q tile by request rows and cache format: 16 rows up to 16, 32 up to 32, none above or
    outside the format's ``NARROW_ROWS`` (fp8_e4m3 keeps the portable kernel up to 16 rows); ``tile_plan``
    gives it one program per SM on sm_90, the portable small tiles two elsewhere; a benchmark can move the
    ranges, never past the form's 32 rows."""
    for fmt in (None, "fp8_ds_mla"):
        assert [narrow_block(r, fmt) for r in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, None, None]
    assert [narrow_block(r, "fp8_e4m3") for r in (1, 16, 17, 24, 32, 33)] == [None, None, 32, 32, 32, None]
    assert [tile_plan(r, True) for r in (1, 16, 17, 32, 33, 128)] == [(16, 1), (16, 1), (32, 1), (32, 1), (64, 1),
                                                                     (64, 1)]
    assert [tile_plan(r, True, "fp8_e4m3") for r in (16, 17)] == [(16, 2), (32, 1)]
    assert [tile_plan(r) for r in (1, 16, 17, 32, 33)] == [(16, 2), (16, 2), (32, 2), (32, 2), (64, 1)]
    monkeypatch.setitem(split_plan.NARROW_ROWS, "fp8_e4m3", (1, 64))
    assert [narrow_block(r, "fp8_e4m3") for r in (8, 32, 33)] == [16, 32, None]


def test_schedule_part_count_follows_the_cache_format(monkeypatch):
    """``get_mla_metadata(kv_format=...)`` on sm_90 (patched in: the plan's arithmetic is the same anywhere; 8
    SMs off CUDA): one part per SM for the narrow form's rows on 16-bit and fp8_ds_mla caches, two for
    fp8_e4m3 up to 16 rows (the portable kernel), one for every format at 17-32 rows and above; aliases
    resolve, an unknown format is refused by name, and the schedule is a valid one for its part count."""
    monkeypatch.setattr(split_plan, "sm90_available", lambda device: True)
    lens = torch.tensor([100, 3000, 0], dtype=torch.int32)
    parts = {}
    for fmt in (None, "bf16", "fp16", torch.bfloat16, "fp8_ds_mla", "fp8_e4m3", "fp8", torch.float8_e4m3fn):
        for rows in (16, 32, 64):
            md, ns = get_mla_metadata(lens, rows, 1, kv_format=fmt)
            assert int(ns[-1]) >= 2 and md.shape == (md.shape[0], 8)
            parts[str(fmt), rows] = md.shape[0]
    e4m3 = ("fp8_e4m3", "fp8", "torch.float8_e4m3fn")
    assert {k: v for k, v in parts.items() if k[0] in e4m3 and k[1] == 16} == {(f, 16): 16 for f in e4m3}
    assert all(v == 8 for k, v in parts.items() if not (k[0] in e4m3 and k[1] == 16))
    for forced in (None, 4):
        with pytest.raises(ValueError, match="kv_format"):
            get_mla_metadata(lens, 16, 1, num_sm_parts=forced, kv_format="int4")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(3))
def test_schedule_kernel_equals_tensor_ops(seed, device):
    """The one-launch Triton scheduler (what CUDA runs) writes exactly what the tensor-op version does,
    including batches longer than its request chunk (32 under the interpreter, 1024 compiled) and more
    parts than requests."""
    rng = random.Random(seed)
    big = device == "cuda"
    for b in (1, 2, 7, 40, rng.randint(1, 100)) + ((2500,) if big else ()):
        lens = torch.tensor(_random_lengths(rng, b), dtype=torch.int32, device=device)
        # Many parts over one or two requests: where the default plan's minimum part length binds.
        part_counts = (1, 3, 66, 132, 264) if big else (1, 3, 20) + ((132,) if b <= 2 else ())
        for parts, rows, default_plan in itertools.product(part_counts, (16, 128), (False, True)):
            want_md = torch.empty(parts, 8, dtype=torch.int32)
            want_ns = torch.empty(b + 1, dtype=torch.int32)
            plan_into(lens.cpu(), want_md, want_ns, overhead_blocks(rows), default_plan)  # tensor ops
            md = torch.full((parts, 8), -7, dtype=torch.int32, device=device)
            ns = torch.full((b + 1,), -7, dtype=torch.int32, device=device)
            schedule_kernel_into(lens, md, ns, overhead_blocks(rows), default_plan)
            assert torch.equal(md.cpu(), want_md), (b, parts, rows, default_plan)
            assert torch.equal(ns.cpu(), want_ns), (b, parts, rows, default_plan)


def test_few_requests_combine_rows():
    """Rows per combine program for requests with many pieces: 4 unless that leaves fewer than three
    programs per SM (512 value columns are four column blocks)."""
    assert few_requests_block_r(1, 128, 512, 132) == 1  # 4 rows: 128 programs, 2 rows: 256, 1 row: 512
    assert few_requests_block_r(2, 128, 512, 132) == 2
    assert few_requests_block_r(4, 128, 512, 132) == 4
    assert few_requests_block_r(1, 16, 512, 132) == 1
    assert few_requests_block_r(1, 128, 512, 8) == 4


# ---------------------------------------------------------------------------------------------- GPU


def varlen_lens(b: int, mean: int, q_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.normal(float(mean), mean / 2, (b,), generator=g).clamp(min=q_len).int().tolist()


CUDA_BF16 = DECODE_BOUNDS[("cuda", BF16)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, chunks=4, carry_pages=True),
    DecodeConfig(block_m=32, block_n=32, num_warps=4, num_stages=3, chunks=4, carry_pages=True),
    DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, chunks=2, use_tma=True, carry_pages=True),
], ids=["m16", "m32", "m64-tma"])
def test_gpu_carried_page_ids(config):
    case = DecodeCase("carried", varlen_lens(32, 2000, 2, seed=9) + [0, 1, 63, 64, 65], 2, 16, 64, None)
    check_paged_decode(launcher(config), case, True, BF16, "cuda", CUDA_BF16, key=config.spec)


SM90 = DecodeConfig(block_m=64, use_sm90=True)


def _sm90_or_skip():
    if not sm90_supported(torch.empty(1, 1, 1, 576, dtype=torch.bfloat16, device="cuda"),
                          torch.empty(1, 64, 1, 576, dtype=torch.bfloat16, device="cuda"), 512):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len", [(128, 1), (16, 1), (3, 4), (64, 2)])
@pytest.mark.parametrize("page", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sm90_kernel(heads, q_len, page, dtype):
    """The Hopper main kernels forced on every shape they take: the seesaw kernel at 128 rows (128 x 1, 64 x
    2), the one-softmax kernel below with padded row tiles (16, 12 rows); pages of 64-256 tokens, empty and
    one-token requests, sequence ends inside a tile (NaN slots behind them), slices of one tile, of whole
    pairs and of pairs plus one tile (128, 129, 192, 193), parts cut mid-request and parts holding many
    requests."""
    _sm90_or_skip()
    lens = [0, 1, 63, 64, 65, 128, 129, 192, 193, q_len - 1 if q_len > 1 else 2, 1000, 3001] + varlen_lens(
        12, 700, q_len, seed=heads)
    bounds = DECODE_BOUNDS[("cuda", dtype)]
    for parts in (3, 19, 132):
        case = DecodeCase(f"sm90-parts{parts}", lens, q_len, heads, page, parts)
        check_paged_decode(launcher(SM90), case, True, dtype, "cuda", bounds)
    check_paged_decode(launcher(SM90), DecodeCase("sm90", lens, q_len, heads, page, None), False, dtype, "cuda",
                       bounds)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,block_m", [(16, 1, 16), (3, 4, 16), (8, 3, 32), (32, 1, 32), (16, 2, 32)])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sm90_transposed_kernel(heads, q_len, block_m, page, dtype):
    """The one-softmax Hopper kernel's transposed form (``DecodeConfig(block_m=16 | 32, use_sm90=True)``: S^T =
    K Q^T over a Q tile of 16 or 32 rows, padding rows included at 12 and 24 rows) on the same lengths, pages
    and part counts as ``test_gpu_sm90_kernel``; a request with more rows than the tile is refused."""
    _sm90_or_skip()
    lens = [0, 1, 63, 64, 65, 128, 129, 192, 193, q_len - 1 if q_len > 1 else 2, 1000, 3001] + varlen_lens(
        12, 700, q_len, seed=heads)
    bounds = DECODE_BOUNDS[("cuda", dtype)]
    config = DecodeConfig(block_m=block_m, use_sm90=True)
    for parts in (3, 19, 132):
        case = DecodeCase(f"sm90t-parts{parts}", lens, q_len, heads, page, parts)
        check_paged_decode(launcher(config), case, True, dtype, "cuda", bounds)
    check_paged_decode(launcher(config), DecodeCase("sm90t", lens, q_len, heads, page, None), False, dtype, "cuda",
                       bounds)
    q, _, cache, table, seqlens = decode_inputs(DecodeCase("sm90t-wide", [10, 40], q_len, 2 * block_m, page, None),
                                                dtype, "cuda", 0)
    meta, splits = get_mla_metadata(seqlens, q_len * 2 * block_m, 1)
    with pytest.raises(ValueError, match="block_m"):
        paged_decode_triton(q, cache, table, seqlens, 512, meta, splits, 0.1, True, config)


@pytest.mark.gpu
@pytest.mark.parametrize("b,heads,pdl", [(128, 16, True), (128, 64, True), (48, 64, True), (4, 16, False),
                                         (8, 64, False)])
def test_gpu_combine_launch_follows_the_batch(b, heads, pdl):
    """From a request per four SMs the combine launches as the main kernel's programmatic dependent (PDL; the
    cases hold on GPUs of 33-192 SMs), after the portable kernel (16 rows, two parts per SM) and the Hopper one
    (64 rows) alike; results match the reference either way, requests in one piece (written by the main
    kernel itself) included: every combine program waits for the main grid's end, so the next launch cannot
    overtake it."""
    case = DecodeCase(f"pdl-b{b}", varlen_lens(b, 600, 1, seed=b), 1, heads, 64, None)
    check_paged_decode(launcher(), case, True, BF16, "cuda", DECODE_BOUNDS[("cuda", BF16)])
    q, _, cache, table, seqlens = decode_inputs(case, BF16, "cuda", 0)
    meta, _ = get_mla_metadata(seqlens, heads, 1)
    plan = _DecodePlan(q, cache, table, 512, meta, 576 ** -0.5, True, None, None)
    assert plan.pdl == (pdl and pdl_available(q.device))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len", [(16, 1), (64, 1), (64, 2)])
def test_gpu_main_kernel_waits_for_the_kernel_before_it(heads, q_len):
    """The main kernels launch as the stream's previous kernel's programmatic dependent (their programs start
    while it ends, ``common.wait_prior_options``) and read nothing before its end: calls queued back to back
    with no sync, each right after kernels that rewrite its q, cache and lengths and then its schedule (the
    metadata kernel, the launch just before the main one), give bit for bit what the same inputs give with
    the GPU idle before the call; the portable (16 rows), one-softmax (64) and seesaw (128) kernels."""
    b, page = 32, 64
    sets = []
    for seed in range(4):
        lens = varlen_lens(b, 900, q_len, seed=100 + seed)
        q, _, cache, table, seqlens = decode_inputs(DecodeCase(f"prior-{seed}", lens, q_len, heads, page, None),
                                                    BF16, "cuda", seed)
        sets.append((q.clone(), cache.clone(), table.clone(), seqlens.clone()))
    pages = max(s[1].shape[0] for s in sets)
    width = max(s[2].shape[1] for s in sets)
    static_q = torch.empty_like(sets[0][0])
    static_cache = torch.full((pages, *sets[0][1].shape[1:]), float("nan"), dtype=BF16, device="cuda")
    static_table = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    static_lens = torch.empty_like(sets[0][3])

    def load(i):
        q, cache, table, seqlens = sets[i]
        static_q.copy_(q)
        static_cache[: cache.shape[0]].copy_(cache)
        static_table[:, : table.shape[1]].copy_(table)
        static_lens.copy_(seqlens)

    def call():
        meta, splits = get_mla_metadata(static_lens, q_len * heads, 1)
        return flash_mla_with_kvcache(static_q, static_cache, static_table, static_lens, 512, meta, splits,
                                      causal=True, provider="triton")

    expected = []
    for i in range(len(sets)):
        load(i)
        torch.cuda.synchronize()
        out, lse = call()
        expected.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    got = []
    for _ in range(3):
        for i in range(len(sets)):
            load(i)
            out, lse = call()
            got.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    for k, (out, lse) in enumerate(got):
        want = expected[k % len(sets)]
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), k
    meta, _ = get_mla_metadata(static_lens, q_len * heads, 1)
    plan = _DecodePlan(static_q, static_cache, static_table, 512, meta, 576 ** -0.5, True, None, None)
    assert plan.wait_prior == pdl_available(static_q.device)


def test_wait_prior_options():
    """Launched as a programmatic dependent exactly when the kernel is compiled to wait."""
    from pagedmla.kernels.triton.common import wait_prior_options

    assert wait_prior_options(True) == {"WAIT_PRIOR": True, "launch_pdl": True}
    assert wait_prior_options(False) == {"WAIT_PRIOR": False}


def test_pdl_only_on_compiled_cuda_kernels():
    assert not pdl_available(torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_hopper_decode_kernels_run_with_evict_first_tma_loads():
    """Both Hopper decode kernels as launched (the one-softmax kernel at 16 rows, the seesaw at 128) run the
    PTX whose every TMA load carries the L2 evict-first policy (``pipeline.tma_loads_evict_first``), and
    give the reference's output from it."""
    _sm90_or_skip()
    from pagedmla.kernels.triton.sm90 import decode as sm90_decode
    from pagedmla.kernels.triton.sm90 import seesaw

    for heads in (16, 128):
        case = DecodeCase(f"sm90-hinted-h{heads}", [1, 65, 700, 3001], 1, heads, 64, None)
        check_paged_decode(launcher(SM90), case, True, BF16, "cuda", CUDA_BF16)
    for cached in (sm90_decode._MAIN, seesaw._SEESAW):
        assert cached.compiled, cached.fn
        for kernel in cached.compiled.values():
            ptx = kernel.asm["ptx"]
            loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\S*", ptx)
            assert loads and all(op.endswith(".L2::cache_hint") for op in loads), loads[:3]
            assert "createpolicy.fractional.L2::evict_first" in ptx


@pytest.mark.gpu
def test_gpu_sm90_kernel_rejects_what_it_cannot_run():
    _sm90_or_skip()
    q, _, cache, table, seqlens = decode_inputs(DecodeCase("sm90-page16", [10, 40], 1, 16, 16, None), BF16, "cuda",
                                                0)
    meta, splits = get_mla_metadata(seqlens, 16, 1)
    with pytest.raises(ValueError, match="use_sm90"):
        paged_decode_triton(q, cache, table, seqlens, 512, meta, splits, 0.1, True, SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 2)])
def test_gpu_cuda_graph_replay(heads, q_len):
    """Capture metadata + main + combine once; replay with new lengths and block tables of the same batch."""
    b, page, max_pages = 8, 64, 40
    q, _, cache, table, seqlens = decode_inputs(DecodeCase("graph", varlen_lens(b, 1000, q_len, 1), q_len, heads,
                                                           page, None), BF16, "cuda", 0)
    # Replays point the requests at arbitrary pages: give every slot real data.
    cache = torch.where(cache.isnan(), torch.randn_like(cache) / 4, cache)
    num_pages = cache.shape[0]
    static_q = q.clone()
    static_lens = seqlens.clone()
    static_table = torch.zeros(b, max_pages, dtype=torch.int32, device="cuda")
    static_table[:, : table.shape[1]] = table

    def step():
        meta, splits = get_mla_metadata(static_lens, q_len * heads, 1)
        return flash_mla_with_kvcache(static_q, cache, static_table, static_lens, 512, meta, splits, causal=True,
                                      provider="triton")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = step()
    g = torch.Generator(device="cpu").manual_seed(11)
    for trial in range(3):
        # Trial 0 includes empty requests and ones shorter than q_len (rows with no key).
        lens = torch.randint(0, max_pages * page + 1, (b,), generator=g)
        if trial == 0:
            lens[:3] = torch.tensor([0, 1, q_len - 1])
        table_new = torch.randint(1, num_pages, (b, max_pages), generator=g)
        static_lens.copy_(lens.int())
        static_table.copy_(table_new.int())
        static_q.copy_(torch.randn_like(static_q) / 4)
        graph.replay()
        torch.cuda.synchronize()
        meta, splits = get_mla_metadata(static_lens, q_len * heads, 1)
        e_out, e_lse = paged_decode_triton(static_q, cache, static_table, static_lens, 512, meta, splits,
                                           576 ** -0.5, True)
        assert torch.equal(g_out, e_out)
        assert torch.equal(g_lse, e_lse)
        rows = gather_rows(cache.cpu(), static_table.cpu(), static_lens.tolist())
        qo = list(range(0, (b + 1) * q_len, q_len))
        ref_out, _ = dense_paged(static_q.reshape(b * q_len, heads, 576), qo, rows, 576 ** -0.5, True, 512)
        assert cos_diff(g_out, ref_out.reshape(g_out.shape)) < 1e-5


def test_hopper_descriptors_and_row_alignment():
    """The Hopper launchers build TMA descriptors without the dataclass's per-call checks: the object must
    equal ``from_tensor``'s, and ``tma_rows`` must hand them an aligned row-major tensor."""
    from pagedmla.kernels.triton.sm90 import pipeline

    if not pipeline.HAVE_GLUON:
        pytest.skip("needs Triton's Gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x = torch.randn(130, 576).to(torch.bfloat16)
    layout = pipeline.shared_layout(64, 512, torch.bfloat16)
    fast, ref = pipeline.descriptor(x, [64, 512], layout), TensorDescriptor.from_tensor(x, [64, 512], layout)
    for field in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(fast, field) == getattr(ref, field), field
    assert fast.base is ref.base
    assert pipeline.tma_rows(x) is x
    misaligned = torch.randn(131 * 576 + 1).to(torch.bfloat16)[1:].view(131, 576)
    assert misaligned.data_ptr() % 16
    fixed = pipeline.tma_rows(misaligned)
    assert fixed.data_ptr() % 16 == 0 and fixed.stride() == (576, 1) and torch.equal(fixed, misaligned)
    strided = torch.randn(4, 130, 576).to(torch.bfloat16)[:, 0]
    assert pipeline.tma_rows(strided).stride() == (576, 1)


def _run_combine(counts, plse, po, block_r, out_typed, per_step, verdict=1.0, start=float("nan")):
    """(out [b, q_len, h, dv] fp16, lse [b, h, q_len]) of the combine kernel alone over pieces ``po`` [pieces,
    rows, dv] / log2 LSEs ``plse`` [pieces, rows], ``counts`` of them per request, laid out as the main kernel
    leaves them (``common.partials_views``: the schedule verdict, from word 32 the b + parts pieces' values,
    then their LSEs), lengths that need exactly ``counts`` pieces; out and lse hold ``start`` before."""
    b, rows, dv = len(counts), po.shape[1], po.shape[2]
    q_len, heads = 2, rows // 2
    splits = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    pieces = int(splits[-1])
    out = torch.full((b, q_len, heads, dv), start, dtype=torch.float16)
    lse = torch.full((b, heads, q_len), start)
    parts = pieces - b
    vty = out.dtype if out_typed else torch.float32
    vbytes = torch.empty(0, dtype=vty).element_size()
    partials = torch.full((partials_size(b, parts, rows, dv, vbytes),), float("nan"))
    partials[0] = verdict
    value_words = (b + parts) * rows * dv * vbytes // 4  # room for b + parts pieces
    partials[32:32 + value_words].view(vty)[:pieces * rows * dv] = po.reshape(-1).to(vty)
    partials[32 + value_words:32 + value_words + pieces * rows] = plse.reshape(-1)
    lens = torch.tensor([64 * n for n in counts], dtype=torch.int32)
    launch_combine(out, lse, partials, splits, lens, parts, capacity=1 << 20, block_r=block_r, out_typed=out_typed,
                   pieces=per_step)
    return out, lse


@pytest.mark.parametrize("per_step", [1, 2, 4])
@pytest.mark.parametrize("out_typed", [False, True])
@pytest.mark.parametrize("block_r", [1, 2, 4, 16, 32])
def test_combine_kernel_tile_shapes(block_r, out_typed, per_step):
    """The combine kernel alone, for every tile height the launcher may pick, both value types (float32,
    the output's dtype) and 1, 2 or 4 pieces a step: requests with 0 (empty), 1 (written by the main kernel:
    left untouched), 2, 5, 3 and 6 pieces, a piece with every row empty (LSE -inf, the third of its request),
    in another's fourth piece a NaN LSE in one row (that row NaN, the others exact) and one 300 above the rest
    in another (the step's max must take it: exp2 of 300 overflows), against a float64 merge of the same
    partials."""
    g = torch.Generator().manual_seed(block_r)
    rows, dv = 24, 64
    counts = [2, 0, 1, 5, 3, 6]
    starts = [0] + list(itertools.accumulate(counts))
    po = torch.randn(starts[-1], rows, dv, generator=g)
    plse = torch.randn(starts[-1], rows, generator=g) * 3
    plse[starts[3] + 2] = float("-inf")  # a piece that saw no key: it must not contribute
    plse[starts[5] + 3, 7] = float("nan")  # a corrupt piece's row: that row only is NaN
    plse[starts[5] + 3, 8] = 300.0
    out, lse = _run_combine(counts, plse, po, block_r, out_typed, per_step)
    po = po.to(out.dtype if out_typed else torch.float32)  # the values the combine reads
    for r, n in enumerate(counts):
        got_o, got_l = out[r].reshape(rows, dv), lse[r].transpose(0, 1).reshape(rows)
        if n == 1:
            assert got_o.isnan().all() and got_l.isnan().all(), "a one-piece request belongs to the main kernel"
            continue
        if n == 0:
            assert (got_o == 0).all() and torch.isneginf(got_l).all()
            continue
        s = slice(starts[r], starts[r + 1])
        w = torch.softmax(plse[s].double() * math.log(2), dim=0)
        want_o = (w[..., None] * po[s].double()).sum(0)
        want_l = torch.logsumexp(plse[s].double() * math.log(2), dim=0)
        assert want_o.isnan().any() == (r == 5)
        torch.testing.assert_close(got_o.double(), want_o, atol=2e-3, rtol=2e-3, equal_nan=True)
        torch.testing.assert_close(got_l.double(), want_l, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("per_step", [1, 4])
def test_combine_kernel_bad_verdict_poisons_every_request(per_step):
    """A schedule verdict other than 1.0 (the main kernel found the schedule made for other lengths): every
    request's rows come out NaN, also those with no piece and those the main kernel wrote in one."""
    g = torch.Generator().manual_seed(per_step)
    counts = [2, 0, 1, 5]
    po = torch.randn(sum(counts), 24, 64, generator=g)
    out, lse = _run_combine(counts, torch.randn(sum(counts), 24, generator=g), po, 4, False, per_step, verdict=0.0,
                            start=0.0)
    assert out.isnan().all() and lse.isnan().all()
    out, lse = _run_combine(counts, torch.randn(sum(counts), 24, generator=g), po, 4, False, per_step)
    assert not out[0].isnan().any() and not lse[3].isnan().any()  # the same call with a good verdict


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", [None, "fp8_e4m3"])
@pytest.mark.parametrize("heads", [16, 64])
def test_repeated_calls_on_a_strided_q_read_each_q(kv_format, heads):
    """A q whose last dimension is strided is copied before the kernels run: the call shape's later calls must
    not take the bound launch (it would read the caller's q by address with the copy's strides). Three calls
    with other q values, each against the torch provider (16 heads: the portable kernel; 64: the Hopper one
    for bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import pagedmla

    lens = [70, 130, 1]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(heads)
    rows = (torch.randn(12 * 64, 576, generator=g) * 0.3).bfloat16().cuda()
    kw = {}
    cache = rows.view(12, 64, 1, 576)
    if kv_format == "fp8_e4m3":
        kw = {"k_scale": torch.tensor([0.01], device="cuda")}
        cache = pagedmla.quantize_latent(cache, kv_format, **kw)
    table = (torch.randperm(11, generator=g)[:9] + 1).int().view(3, 3).cuda()
    md, ns = get_mla_metadata(seqlens, heads, 1)
    for call in range(3):
        wide = torch.randn(3, 1, heads, 2 * 576, generator=g).bfloat16().cuda()
        q = wide[..., ::2]  # stride 2 in the last dimension
        out, lse = flash_mla_with_kvcache(q, cache, table, seqlens, 512, md, ns, causal=True, provider="triton", **kw)
        ref, ref_lse = flash_mla_with_kvcache(q.contiguous(), cache, table, seqlens, 512, md, ns, causal=True,
                                              provider="torch", **kw)
        assert cos_diff(out, ref) < 1e-5, call
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dv", [16, 32])
@pytest.mark.parametrize("heads", [4, 40])
def test_default_config_keeps_chunks_16_columns_wide(dv, heads):
    """Small value widths: the default tiles split the value into at most head_dim_v / 16 chunks (the dots'
    least depth, which the checked user configs already demand), and the result matches the torch provider
    (16- and 64-row tiles)."""
    from pagedmla.kernels.triton.decode import select_config

    d = dv + 16
    g = torch.Generator().manual_seed(dv + heads)
    lens = [9, 70]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    cache = (torch.randn(6, 16, 1, d, generator=g) * 0.5).half()
    table = (torch.randperm(5, generator=g) + 1).int().view(1, 5).repeat(2, 1)
    q = (torch.randn(2, 1, heads, d, generator=g) * 0.5).half()
    cfg = select_config(q, cache, dv)
    assert dv // cfg.chunks >= 16, cfg
    md, ns = get_mla_metadata(seqlens, heads, 1, num_sm_parts=2)
    out, lse = flash_mla_with_kvcache(q, cache, table, seqlens, dv, md, ns, causal=True, provider="triton")
    ref, ref_lse = flash_mla_with_kvcache(q, cache, table, seqlens, dv, md, ns, causal=True, provider="torch")
    assert cos_diff(out, ref) < 1e-5
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
