"""The Triton split-KV MLA decode kernels and their schedule.

On CPU the kernels run under the Triton interpreter (fp16, small shapes) against the float64 reference
on the same rounded inputs; ``gpu`` tests run bf16 at FlashMLA's test sizes and a captured CUDA graph.
Every case poisons what the kernel must not read (cache slots past each sequence, block-table entries
past each request's pages, which point at a NaN page) and what it must write (the output buffers).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from pagedmla.kernels.triton.decode import DecodeConfig, few_requests_block_r, launch_combine, paged_decode_triton
from pagedmla.kernels.triton.metadata import schedule_into as schedule_kernel_into
from pagedmla.kernels.triton.sm90.mla import sm90_supported
from pagedmla.ops import flash_mla_with_kvcache, get_mla_metadata
from pagedmla.ops import schedule as ops_schedule
from pagedmla.reference import paged_mla_attention
from pagedmla.split_plan import BLOCK_N as SCHED_N
from pagedmla.split_plan import PIECE_COST_RATIO, min_part_units, overhead_blocks, plan_into

# fp16 elementwise bounds: P is rounded to fp16 before P @ V and the output to fp16 (2**-11 relative each);
# the largest error seen on the CPU cases was 3e-4 at |out| ~ 1.
FP16_ATOL, FP16_RTOL = 6e-4, 4e-3


def make_case(lens: list[int], q_len: int, heads: int, page: int, *, d: int = 576, dtype=torch.float16,
              device: str = "cpu", seed: int = 0, spare_pages: int = 1):
    """Random q and a paged cache (randomly permuted pages) whose unused slots hold NaN; block-table
    entries past each request's pages point at an all-NaN page. Built on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    b = len(lens)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    pages_needed = (seqlens.long() + page - 1) // page
    max_pages = max(lens + [0]) // page + 1 + spare_pages
    total = int(pages_needed.sum())
    num_pages = total + 2  # page 0 reserved, the last page is the NaN page
    cache = (torch.randn(num_pages, page, 1, d, generator=g, device=device) / 4).to(dtype)
    j = torch.arange(max_pages, device=device)
    owned = j.unsqueeze(0) < pages_needed.unsqueeze(1)
    table = torch.full((b, max_pages), num_pages - 1, dtype=torch.int32, device=device)
    table[owned] = (torch.randperm(num_pages - 2, generator=g, device=device) + 1).int()[:total]
    filled = (seqlens.long().unsqueeze(1) - j * page).clamp(0, page)  # tokens in each owned page
    used = torch.zeros(num_pages, page, dtype=torch.bool, device=device)
    used[table[owned].long()] = torch.arange(page, device=device) < filled[owned].unsqueeze(1)
    cache[~used] = float("nan")
    q = (torch.randn(b, q_len, heads, d, generator=g, device=device) / 4).to(dtype)
    return q, cache, table, seqlens


def reference(q, cache, table, seqlens, dv, scale, causal, dtype=torch.float64):
    b, q_len, h, d = q.shape
    qo = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    out, lse = paged_mla_attention(q.reshape(b * q_len, h, d).to(dtype), cache.to(dtype), table, seqlens, qo,
                                   scale, causal, dv, cache.shape[1])
    return out.reshape(b, q_len, h, dv), lse.reshape(b, q_len, h).transpose(1, 2)


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """FlashMLA's test metric: 1 - cosine similarity, on float64 copies."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def run_and_check(lens, q_len, heads, page, causal, *, parts=None, d=576, dv=512, dtype=torch.float16,
                  config=None, device="cpu", seed=0, atol=FP16_ATOL, rtol=FP16_RTOL, ref_dtype=torch.float64):
    q, cache, table, seqlens = make_case(lens, q_len, heads, page, d=d, dtype=dtype, device=device, seed=seed)
    scale = d ** -0.5
    meta, splits = get_mla_metadata(seqlens, q_len * heads, 1, num_sm_parts=parts)
    out = torch.full((len(lens), q_len, heads, dv), float("nan"), dtype=dtype, device=device)
    lse = torch.full((len(lens), heads, q_len), float("nan"), dtype=torch.float32, device=device)
    paged_decode_triton(q, cache, table, seqlens, dv, meta, splits, scale, causal, config, out=out, lse=lse)
    ref_out, ref_lse = reference(q, cache, table, seqlens, dv, scale, causal, ref_dtype)
    assert not out.isnan().any(), "an output row was not written (or NaN leaked from a poisoned slot)"
    assert not lse.isnan().any(), "an LSE entry was not written"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows without keys must have LSE -inf, and only those"
    assert (out.transpose(1, 2)[empty] == 0).all(), "rows without keys must output 0"
    assert cos_diff(out, ref_out) < 1e-5
    finite = ~empty
    if finite.any():
        assert cos_diff(lse[finite], ref_lse[finite]) < 1e-5
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite].double(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=rtol)
    return out, lse


CPU_CASES = [
    # (lens, q_len, heads, page, causal, parts)
    ([0, 1, 63, 64, 65], 1, 16, 16, True, 4),
    ([65, 0, 17, 64], 2, 3, 1, True, 3),
    ([64, 1, 63], 4, 16, 64, True, 5),
    ([1, 63, 130], 1, 128, 64, False, 5),
    ([2, 70, 1], 3, 64, 16, True, 4),  # seq 2 < q_len 3: the first query row sees nothing
    ([33, 0], 1, 1, 1, False, 2),
    ([200, 5, 129], 2, 16, 16, False, 7),
    ([0, 0], 1, 16, 64, True, 3),
    ([150], 1, 16, 64, True, 1),
    ([64, 0], 1, 16, 64, True, 1),  # the empty request lies past every part's request range (combine writes it)
    ([65, 64, 0, 0, 3], 2, 16, 16, True, 3),
]


@pytest.mark.parametrize("lens,q_len,heads,page,causal,parts", CPU_CASES)
def test_decode_matches_reference(lens, q_len, heads, page, causal, parts):
    run_and_check(lens, q_len, heads, page, causal, parts=parts)


def test_decode_random_batch():
    rng = random.Random(3)
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 300)]) for _ in range(6)]
    run_and_check(lens, 2, 16, 16, True, parts=6, seed=3)
    run_and_check(lens, 1, 64, 64, False, parts=None, seed=4)


@pytest.mark.parametrize("config", [
    DecodeConfig(block_m=32, block_n=32, num_warps=4),
    DecodeConfig(block_m=16, block_n=64, num_warps=4, chunks=4),
    DecodeConfig(block_m=64, block_n=32, num_warps=8, chunks=2),
])
def test_decode_configs(config):
    run_and_check([0, 1, 64, 97, 190], 1, 16, 16, True, parts=4, config=config, seed=5)


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
    run_and_check([0, 1, page - 1, page, page + 1, 3 * page + 5], 2, 16, page, True, parts=5, config=config,
                  seed=11)


@pytest.mark.parametrize("d,dv", [(80, 64), (64, 64)])
def test_decode_other_head_dims(d, dv):
    run_and_check([0, 40, 100], 2, 3, 16, True, parts=3, d=d, dv=dv)


def test_decode_float32():
    run_and_check([1, 65, 100], 1, 16, 16, True, parts=3, dtype=torch.float32, atol=1e-5, rtol=1e-5)


def test_decode_public_api_and_default_schedule():
    q, cache, table, seqlens = make_case([5, 64, 120], 2, 16, 16, seed=7)
    meta, splits = get_mla_metadata(seqlens, 32, 1)
    out, lse = flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, splits, causal=True, provider="triton")
    ref_out, ref_lse = reference(q, cache, table, seqlens, 512, 576 ** -0.5, True)
    assert cos_diff(out, ref_out) < 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_decode_rejects_unsupported_dims():
    q, cache, table, seqlens = make_case([4], 1, 16, 16, d=100)
    meta, splits = get_mla_metadata(seqlens, 16, 1)
    with pytest.raises(ValueError, match="head_dim_v"):
        paged_decode_triton(q, cache, table, seqlens, 48, meta, splits, 0.1, False)
    with pytest.raises(ValueError, match="q: head dim"):
        paged_decode_triton(q, cache, table, seqlens, 64, meta, splits, 0.1, False)


def enumerate_schedule(meta: torch.Tensor, splits: torch.Tensor, lens: list[int]):
    """Host walk of the metadata exactly as the kernel walks it: {(req, block): count}, pieces per request."""
    covered: dict[tuple[int, int], int] = {}
    pieces: dict[int, list[int]] = {}
    for begin_req, begin_blk, end_req, end_blk, begin_split, *_ in meta.tolist():
        for r in range(begin_req, end_req + 1):
            n = math.ceil(lens[r] / SCHED_N)
            lo = begin_blk if r == begin_req else 0
            hi = end_blk if r == end_req else n
            if lo >= hi:
                continue
            for blk in range(lo, hi):
                covered[(r, blk)] = covered.get((r, blk), 0) + 1
            pieces.setdefault(r, []).append(begin_split if r == begin_req else 0)
    return covered, pieces


def _random_lengths(rng: random.Random, b: int) -> list[int]:
    return [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000), rng.randint(0, 200000)]) for _ in range(b)]


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


def test_min_part_units_is_an_exact_integer_square_root():
    n = torch.arange(0, 20000, dtype=torch.int64)
    k = min_part_units(n)
    assert (k >= 1).all() and (k * k * PIECE_COST_RATIO >= n).all()
    assert ((k - 1) * (k - 1) * PIECE_COST_RATIO < n)[1:].all(), "not the smallest such k"
    assert min_part_units(torch.tensor(100)).item() == 4


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
        covered, _ = enumerate_schedule(meta, splits, lens.tolist())
        assert len(covered) == 100 and all(c == 1 for c in covered.values())
        assert splits.tolist() == [0, 102 // per_part - 3 // per_part + 1], default_plan
    # get_mla_metadata: the default plan unless num_sm_parts is given.
    md, ns = get_mla_metadata(lens, rows, 1)
    want_md = torch.empty_like(md)
    want_ns = torch.empty_like(ns)
    ops_schedule.schedule_into(lens, want_md, want_ns, rows, default_plan=True)
    assert torch.equal(md, want_md) and torch.equal(ns, want_ns)
    assert get_mla_metadata(lens, rows, 1, num_sm_parts=132)[1].tolist() == [0, 100]


def test_few_requests_combine_rows():
    """Rows per combine program for requests with many pieces: 4 unless that leaves fewer than three
    programs per SM (512 value columns are four column blocks)."""
    assert few_requests_block_r(1, 128, 512, 132) == 1  # 4 rows: 128 programs, 2 rows: 256, 1 row: 512
    assert few_requests_block_r(2, 128, 512, 132) == 2
    assert few_requests_block_r(4, 128, 512, 132) == 4
    assert few_requests_block_r(1, 16, 512, 132) == 1
    assert few_requests_block_r(1, 128, 512, 8) == 4


@pytest.mark.parametrize("seed", range(6))
def test_schedule_covers_every_block_once(seed):
    rng = random.Random(seed)
    for _ in range(8):
        b = rng.randint(1, 40)
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000)]) for _ in range(b)]
        for parts, rows in itertools.product((1, 2, 3, 7, 33, 66, 132, 200), (16, 128)):
            meta, splits = get_mla_metadata(torch.tensor(lens, dtype=torch.int32), rows, 1, num_sm_parts=parts)
            assert meta.shape == (parts, 8) and splits.shape == (b + 1,)
            covered, pieces = enumerate_schedule(meta, splits, lens)
            expected = {(r, blk) for r, n in enumerate(lens) for blk in range(math.ceil(n / SCHED_N))}
            assert set(covered) == expected and all(c == 1 for c in covered.values())
            counts = splits.tolist()
            assert counts[0] == 0 and counts[-1] <= b + parts - 1
            for r in range(b):
                got = sorted(pieces.get(r, []))
                assert got == list(range(counts[r + 1] - counts[r])), (r, got, counts[r:r + 2])


# ---------------------------------------------------------------------------------------------- GPU


def varlen_lens(b: int, mean: int, q_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.normal(float(mean), mean / 2, (b,), generator=g).clamp(min=q_len).int()
    return lens.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16, 128])
@pytest.mark.parametrize("mean", [4096, 8193])
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flashmla_sizes_bf16(b, mean, heads, q_len, causal):
    lens = varlen_lens(b, mean, q_len, seed=b * 7 + heads)
    run_and_check(lens, q_len, heads, 64, causal, dtype=torch.bfloat16, device="cuda", seed=heads + q_len,
                  ref_dtype=torch.float32, atol=1e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 16, 32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_page_sizes(page, dtype):
    lens = [0, 1, 63, 64, 65, 1000, 3000, 2]
    run_and_check(lens, 2, 32, page, True, dtype=dtype, device="cuda", ref_dtype=torch.float32,
                  atol=1e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, chunks=4, carry_pages=True),
    DecodeConfig(block_m=32, block_n=32, num_warps=4, num_stages=3, chunks=4, carry_pages=True),
    DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, chunks=2, use_tma=True, carry_pages=True),
], ids=["m16", "m32", "m64-tma"])
def test_gpu_carried_page_ids(config):
    lens = varlen_lens(32, 2000, 2, seed=9) + [0, 1, 63, 64, 65]
    run_and_check(lens, 2, 16, 64, True, config=config, dtype=torch.bfloat16, device="cuda", seed=9,
                  ref_dtype=torch.float32, atol=1e-2, rtol=2e-2)


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
    """The Hopper main kernel forced on every shape it takes: padded row tiles (16, 12 rows), pages of 64-256
    tokens, empty and one-token requests, sequence ends inside a tile (NaN slots behind them), parts cut
    mid-request and parts holding many requests."""
    _sm90_or_skip()
    lens = [0, 1, 63, 64, 65, q_len - 1 if q_len > 1 else 2, 1000, 3001] + varlen_lens(12, 700, q_len, seed=heads)
    for parts in (3, 19, 132):
        run_and_check(lens, q_len, heads, page, True, parts=parts, config=SM90, dtype=dtype, device="cuda",
                      seed=heads + page + parts, ref_dtype=torch.float32, atol=1e-2, rtol=2e-2)
    run_and_check(lens, q_len, heads, page, False, config=SM90, dtype=dtype, device="cuda", seed=page,
                  ref_dtype=torch.float32, atol=1e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_sm90_kernel_rejects_what_it_cannot_run():
    _sm90_or_skip()
    q, cache, table, seqlens = make_case([10, 40], 1, 16, 16, dtype=torch.bfloat16, device="cuda")
    meta, splits = get_mla_metadata(seqlens, 16, 1)
    with pytest.raises(ValueError, match="use_sm90"):
        paged_decode_triton(q, cache, table, seqlens, 512, meta, splits, 0.1, True, SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len", [(3, 4), (128, 2), (16, 8)])
def test_gpu_odd_shapes(heads, q_len):
    run_and_check([0, 1, 7, 64, 65, 513, 4000], q_len, heads, 64, True, dtype=torch.bfloat16, device="cuda",
                  ref_dtype=torch.float32, atol=1e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 2)])
def test_gpu_cuda_graph_replay(heads, q_len):
    """Capture metadata + main + combine once; replay with new lengths and block tables of the same batch."""
    b, page, max_pages = 8, 64, 40
    q, cache, table, seqlens = make_case(varlen_lens(b, 1000, q_len, 1), q_len, heads, page,
                                         dtype=torch.bfloat16, device="cuda")
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
        ref_out, _ = reference(static_q, cache, static_table, static_lens, 512, 576 ** -0.5, True, torch.float32)
        assert cos_diff(g_out, ref_out) < 1e-5


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


@pytest.mark.parametrize("block_r", [1, 2, 4, 16, 32])
def test_combine_kernel_tile_shapes(block_r):
    """The combine kernel alone, for every tile height the launcher may pick: requests with 0 (empty), 1
    (written by the main kernel: left untouched), 2 and 5 pieces, one piece with every row empty (LSE -inf),
    against a float64 merge of the same partials."""
    g = torch.Generator().manual_seed(block_r)
    q_len, heads, dv = 2, 12, 64
    rows = q_len * heads
    counts = [2, 0, 1, 5, 3]
    splits = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    pieces = int(splits[-1])
    po = torch.randn(pieces, rows, dv, generator=g)
    plse = torch.randn(pieces, rows, generator=g) * 3
    plse[splits[4]] = float("-inf")  # a piece that saw no key: it must not contribute
    out = torch.full((len(counts), q_len, heads, dv), float("nan"), dtype=torch.float16)
    lse = torch.full((len(counts), heads, q_len), float("nan"))
    # The partials buffer as the main kernel leaves it (decode.partials_size: b + parts pieces of values,
    # then their LSEs, then the schedule verdict 1.0), with lengths that need exactly ``counts`` pieces.
    parts = pieces - len(counts)
    partials = torch.cat([po.reshape(-1), plse.reshape(-1), torch.ones(1)])
    lens = torch.tensor([64 * n for n in counts], dtype=torch.int32)
    launch_combine(out, lse, partials, splits, lens, parts, capacity=1 << 20, block_r=block_r)
    for r, n in enumerate(counts):
        got_o, got_l = out[r].reshape(rows, dv), lse[r].transpose(0, 1).reshape(rows)
        if n == 1:
            assert got_o.isnan().all() and got_l.isnan().all(), "a one-piece request belongs to the main kernel"
            continue
        if n == 0:
            assert (got_o == 0).all() and torch.isneginf(got_l).all()
            continue
        s = slice(int(splits[r]), int(splits[r + 1]))
        w = torch.softmax(plse[s].double() * math.log(2), dim=0)
        want_o = (w[..., None] * po[s].double()).sum(0)
        want_l = torch.logsumexp(plse[s].double() * math.log(2), dim=0)
        torch.testing.assert_close(got_o.double(), want_o, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got_l.double(), want_l, atol=1e-5, rtol=1e-5)
