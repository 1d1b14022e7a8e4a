"""The Triton prefill kernels (ragged varlen attention, variable-q paged absorbed attention): what is specific
to them.

Correctness over shapes, lengths, page sizes and dtypes is test_conformance.py's (every provider against the
float64 oracle); here the kernels' input guards, typed configs and default kernel choice, the Hopper ragged
kernel's tile numbering, and (``gpu``) each kernel forced: the portable ones, the Hopper ones on ragged tails,
many persistent tiles, skewed batches, CUDA-graph replays and a negative length. Inputs and checks come from
test_conformance (one cache builder).
"""

from __future__ import annotations

import pytest
import torch
from oracle import dense_paged, dense_varlen
from test_conformance import (
    BF16,
    F16,
    PREFILL_BOUNDS,
    Bounds,
    PagedVarlenCase,
    assert_matches,
    check_paged_varlen,
    check_varlen,
    paged_varlen_inputs,
    varlen_inputs,
)

from pagedmla import errors
from pagedmla.kernels.triton import paged_varlen as tpaged
from pagedmla.kernels.triton import varlen as tvarlen
from pagedmla.kernels.triton.common import PrefillConfig
from pagedmla.kernels.triton.sm90 import varlen as sm90varlen
from pagedmla.kernels.triton.sm90.mla import sm90_supported
from pagedmla.kernels.triton.sm90.paged_varlen import paged_varlen_sm90
from pagedmla.kernels.triton.sm90.varlen import varlen_sm90_plan, varlen_sm90_supported

# The forced Hopper kernels' bounds (bf16 / fp16 against the float64 oracle).
HOPPER = Bounds(norm=1e-2, row=0.3, lse_atol=1e-2)
HOPPER_PAGED = HOPPER._replace(cos=1e-4)
SM90 = PrefillConfig(use_sm90=True)


def _lens(gen: torch.Generator, n: int, hi: int) -> list[int]:
    return torch.randint(0, hi + 1, (n,), generator=gen).tolist()


def _varlen_sm90_or_skip(dk: int, dv: int, dtype: torch.dtype) -> None:
    x = torch.empty(1, 1, dk, dtype=dtype, device="cuda")
    if not varlen_sm90_supported(x, x, torch.empty(1, 1, dv, dtype=dtype, device="cuda")):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")


# ``CTA_SEQLEN`` ranges that force each Hopper ragged consumer form whatever the prompt lengths.
FORCED_FORMS = {"one-partition": (-1, 2 ** 31), "wg-partitions": (0, -1)}


@pytest.fixture(params=list(FORCED_FORMS))
def varlen_form(request, monkeypatch):
    """Each Hopper ragged test runs both consumer forms, whatever its prompt lengths (``CTA_SEQLEN`` picks
    one per call by max_seqlen_q)."""
    monkeypatch.setattr(sm90varlen, "CTA_SEQLEN", FORCED_FORMS[request.param])
    return request.param


def _paged_sm90_or_skip(dtype: torch.dtype) -> None:
    cache = torch.empty(1, 64, 1, 576, dtype=dtype, device="cuda")
    if not sm90_supported(cache[0, :1], cache, 512):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")


def varlen_kernel(config: PrefillConfig | None = None):
    """A check_varlen call running the kernel entry point with ``config``."""

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, out):
        return tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, out, config=config)

    return call


def paged_kernel(config: PrefillConfig | None = None):
    """A check_paged_varlen call running the kernel entry point with ``config``."""

    def call(q, k_cache, table, lens, qo, dv, scale, causal, max_q_len):
        return tpaged.paged_varlen_attention(q, k_cache, table, lens, qo, dv, q.shape[-1] ** -0.5 if scale is None
                                             else scale, causal, max_q_len, config=config)

    return call


def test_varlen_all_empty_and_bad_input():
    q, k, v, cu_q, cu_k = varlen_inputs([0, 0], [3, 0], 2, 2, 64, 64, F16, "cpu", "empty")
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, 0, 3, 0.1, False)
    assert o.shape == (0, 2, 64) and lse.shape == (0, 2)
    q, k, v, cu_q, cu_k = varlen_inputs([2], [3], 2, 2, 64, 64, F16, "cpu", "bad")
    with pytest.raises(ValueError, match="q"):
        tvarlen.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 2, 3, 0.1, False)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        tvarlen.varlen_attention(q, k, v, cu_q.long(), cu_k, 2, 3, 0.1, False)
    with pytest.raises(ValueError, match="k"):
        tvarlen.varlen_attention(q, k[:, :1].repeat(1, 3, 1), v, cu_q, cu_k, 2, 3, 0.1, False)
    with pytest.raises(ValueError, match="out"):
        tvarlen.varlen_attention(q, k, v, cu_q, cu_k, 2, 3, 0.1, False, torch.empty(2, 2, 32, dtype=q.dtype))


def test_paged_prefill_hopper_kernel_rejects_other_value_widths():
    q, _, cache, bt, lens, qo = paged_varlen_inputs(PagedVarlenCase("page64", [4, 1], [9, 30], 4, 64), F16, "cpu", 0)
    with pytest.raises(ValueError, match="head_dim_v 256"):
        tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 256, 0.1, True, None, config=PrefillConfig(use_sm90=True))


def test_paged_prefill_bad_input():
    q, _, cache, bt, lens, qo = paged_varlen_inputs(PagedVarlenCase("page16", [4, 1], [9, 30], 4, 16), F16, "cpu", 0)
    with pytest.raises(ValueError, match="head_dim_v"):
        tpaged.paged_varlen_attention(q, cache, bt, lens, qo, 576, 0.1, True, None)
    with pytest.raises(ValueError, match="qo_indptr"):
        tpaged.paged_varlen_attention(q, cache, bt, lens, qo.long(), 512, 0.1, True, None)
    with pytest.raises(ValueError, match="k_cache"):
        tpaged.paged_varlen_attention(q, cache.float(), bt, lens, qo, 512, 0.1, True, None)


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


def test_tail_window_is_the_last_rounds_of_tiles_whose_kv_fits():
    """The padded causal order's last window of (sequence, head) pairs: enough for ``TAIL_WINDOW_ROUNDS``
    tiles per program, within ``TAIL_WINDOW_BYTES`` of K/V (mean keys per sequence x (dk + dv) x 2 bytes,
    shared by a GQA group); at least one pair, at most every pair; none (1) without a causal mask or with one
    row tile per pair."""
    assert (sm90varlen.TAIL_WINDOW_BYTES, sm90varlen.TAIL_WINDOW_ROUNDS) == (8 << 20, 3)
    window = sm90varlen.tail_window
    assert window(16, 16, 8, 8 * 4096, 192, 128, 2, True, 32, 132) == (8 << 20) // (4096 * 320 * 2) == 3
    assert window(16, 16, 64, 64 * 512, 192, 128, 2, True, 4, 132) == (8 << 20) // (512 * 320 * 2) == 25
    assert window(128, 128, 16, 16 * 1024, 192, 128, 2, True, 8, 132) == 12  # 50 rounds' pairs > 8 MB's 12
    assert window(128, 128, 16, 16 * 256, 192, 128, 2, True, 2, 132) == 51
    assert window(128, 128, 16, 16 * 150, 64, 64, 2, True, 2, 132) == 198  # 3 rounds of 132 programs
    assert window(32, 8, 8, 8 * 4096, 192, 128, 2, True, 32, 132) == 12  # four query heads per K/V head
    assert window(4, 4, 2, 2 * 300, 192, 128, 2, True, 3, 132) == 8  # small launches: one window
    assert window(16, 16, 1, 32768, 192, 128, 2, True, 256, 132) == 1  # one pair's 21 MB
    assert window(16, 16, 8, 8 * 4096, 192, 128, 2, False, 32, 132) == 1
    assert window(16, 16, 64, 64 * 100, 192, 128, 2, True, 1, 132) == 1
    assert window(16, 16, 8, 0, 192, 128, 2, True, 32, 132) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["portable", "sm90"])
@pytest.mark.parametrize("h,hk,lens", [(16, 16, [1024, 2500, 3]), (128, 128, [777, 1])])
def test_gpu_varlen_each_kernel_bf16(kernel, h, hk, lens):
    """Both kernels on the GPU whatever the default picks (the portable one runs off sm_90 and for
    fp32 / other head dims there)."""
    if kernel == "sm90":
        _varlen_sm90_or_skip(192, 128, BF16)
    check_varlen(varlen_kernel(PrefillConfig(use_sm90=kernel == "sm90")), lens, lens, h, hk, 192, 128, True, BF16,
                 "cuda", HOPPER, ("each", kernel, h), scale=192 ** -0.5, stds=(0.5, 1.0, 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
def test_gpu_paged_prefill_portable_bf16(h):
    case = PagedVarlenCase(f"portable-h{h}", [512, 1, 37, 300], [2048 + 512, 4000, 37, 1300], h, 64, kv_std=1.0)
    check_paged_varlen(paged_kernel(PrefillConfig(use_sm90=False)), case, True, BF16, "cuda",
                       PREFILL_BOUNDS[("cuda", BF16)])


SM90_VARLEN_CASES = [
    # (q lengths, k lengths, H, Hk, Dqk, Dv): ragged tails around the 64-row warpgroup and 128-row program
    # tiles, q shorter and longer than k, GQA 1, 2, 8
    ([0, 1, 15, 16, 17, 64, 65, 127, 128, 129, 1000], None, 4, 4, 192, 128),
    ([300, 5, 190], [700, 2, 190], 16, 2, 192, 128),
    ([33, 5, 260], [70, 2, 100], 8, 1, 128, 128),
    ([20, 200, 0], [7, 500, 9], 4, 2, 64, 64),
    # sequences without keys between ones with keys: tiles with no key tile (output stored from the MMA
    # layout) among staged ones, both warpgroups still meeting at every tile's end
    ([30, 100, 64, 7, 129], [0, 150, 0, 7, 0], 4, 4, 192, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(SM90_VARLEN_CASES)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_varlen_hopper_kernel(case, causal, dtype, varlen_form):
    """The Hopper ragged kernel against the oracle on ragged tails, GQA and every supported head dim; spare
    rows after the last sequence (an engine's buffers have capacity) hold NaN, never to be used; the output
    buffer starts NaN."""
    lq, lk, h, hk, dk, dv = SM90_VARLEN_CASES[case]
    _varlen_sm90_or_skip(dk, dv, dtype)
    check_varlen(varlen_kernel(SM90), lq, lk or lq, h, hk, dk, dv, causal, dtype, "cuda", HOPPER, ("sm90", case),
                 scale=dk ** -0.5, out=True, stds=(0.5, 1.0, 1.0), spare_kv_rows=70)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_hopper_kernel_many_tiles(causal, varlen_form):
    """The persistent kernel's tile hand-off: thousands of work tiles (far more than SMs) over 60 sequences
    of 0-1500 tokens, q shorter and longer than k, GQA 4; a second call (the tile counter starts again)
    and CUDA-graph replays with new inputs give the same results."""
    _varlen_sm90_or_skip(192, 128, BF16)
    gen = torch.Generator().manual_seed(7)
    lq, lk = _lens(gen, 60, 1500), _lens(gen, 60, 1500)
    assert not varlen_sm90_plan(max(lq), sum(lq), 32, len(lq))[1]  # the padded numbering runs
    q, k, v, cu_q, cu_k = varlen_inputs(lq, lk, 32, 8, 192, 128, BF16, "cuda", ("many", causal), stds=(0.5, 1, 1))

    def call():
        return tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 192 ** -0.5, causal, config=SM90)

    o, lse = call()
    ref, ref_lse = dense_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), 192 ** -0.5, causal)
    assert_matches(o, lse, ref, ref_lse, BF16, HOPPER)
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
def test_gpu_varlen_hopper_kernel_tail_windows(causal, varlen_form, monkeypatch):
    """The padded numbering claimed a (sequence, head) pair at a time but for the last window of pairs, whose
    row tiles go heaviest first across the window: every tile computed once whatever the window (none, 7 of
    96 pairs, all 96): each output bit-identical to the pair-at-a-time order's and that one matching the
    oracle; the output buffer starts NaN, so a tile never claimed would show."""
    _varlen_sm90_or_skip(192, 128, BF16)
    gen = torch.Generator().manual_seed(5)
    lq = _lens(gen, 12, 700)
    assert not varlen_sm90_plan(max(lq), sum(lq), 8, len(lq))[1]
    q, k, v, cu_q, cu_k = varlen_inputs(lq, lq, 8, 4, 192, 128, BF16, "cuda", ("windows", causal), stds=(0.5, 1, 1))
    outs = []
    for window in (1, 7, 12 * 8):
        monkeypatch.setattr(sm90varlen, "tail_window", lambda *args, w=window: w)
        out = torch.full((sum(lq), 8, 128), float("nan"), dtype=BF16, device="cuda")
        outs.append(tvarlen.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lq), 192 ** -0.5, causal, out,
                                             config=SM90))
    ref, ref_lse = dense_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), 192 ** -0.5, causal)
    assert_matches(*outs[0], ref, ref_lse, BF16, HOPPER)
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_varlen_hopper_forms_agree_eager_and_replayed(heads, monkeypatch):
    """Both consumer forms give the same bits, called eagerly and replayed as CUDA graphs (the arithmetic is
    the same: the one-partition form's extra key tiles are fully masked, P = 0 and the rescale 1). A scratch
    script once saw the forms' replayed outputs differ at 16 heads while eager ones agreed (NOTES, Prefill
    v14); this checks every one of 20 replays per form on each device run."""
    _varlen_sm90_or_skip(192, 128, BF16)
    n, batch = 256, 16
    q, k, v, cu_q, cu_k = varlen_inputs([n] * batch, [n] * batch, heads, heads, 192, 128, BF16, "cuda",
                                        ("forms", heads))
    outs = []
    for form in FORCED_FORMS.values():
        monkeypatch.setattr(sm90varlen, "CTA_SEQLEN", form)
        eager = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, n, n, 192 ** -0.5, True, config=SM90)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_o, g_lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, n, n, 192 ** -0.5, True, config=SM90)
        # As the scratch script ran them: replays back to back, each after a 256 MB write (do_bench's L2 flush).
        flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")
        for i in range(20):
            flush.zero_()
            graph.replay()
            assert torch.equal(g_o, eager[0]) and torch.equal(g_lse, eager[1]), (form, i)
        outs.append(eager)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_hopper_kernel_skewed_batch(causal, varlen_form):
    """One long prompt among many short ones (a chunked-prefill batch): the per-sequence tile numbering,
    every row of every sequence computed once (lengths around the 128-row tiles,
    sequences that start mid-tile, empty ones, GQA 4, q shorter than k for some)."""
    _varlen_sm90_or_skip(192, 128, BF16)
    gen = torch.Generator().manual_seed(11)
    short = [0, 1, 17, 127, 128, 129, 255, 64]
    lq = [3001] + [short[i % len(short)] for i in range(60)] + [700]
    lk = [n + int(torch.randint(0, 3, (1,), generator=gen)) * 40 for n in lq]
    assert varlen_sm90_plan(max(lq), sum(lq), 16, len(lq))[1]  # the per-sequence numbering runs
    check_varlen(varlen_kernel(SM90), lq, lk, 16, 4, 192, 128, causal, BF16, "cuda", HOPPER, ("skewed", causal),
                 scale=192 ** -0.5, out=True, stds=(0.5, 1.0, 1.0))


@pytest.mark.gpu
def test_gpu_varlen_hopper_kernel_many_sequences(varlen_form):
    """Over 1024 sequences (an 11-step search per tile), most of them a few rows or empty: their numbered
    tiles past the rows are claimed again by the loader, not handed over."""
    _varlen_sm90_or_skip(192, 128, BF16)
    lq = [1500] + [i % 5 for i in range(1100)] + [200]
    assert varlen_sm90_plan(max(lq), sum(lq), 2, len(lq))[1]
    check_varlen(varlen_kernel(SM90), lq, lq, 2, 2, 192, 128, True, BF16, "cuda", HOPPER, ("many", True),
                 scale=192 ** -0.5, out=True, stds=(0.5, 1.0, 1.0))


@pytest.mark.gpu
def test_gpu_varlen_hopper_kernel_without_keys(varlen_form):
    _varlen_sm90_or_skip(192, 128, BF16)
    q, k, v, cu_q, cu_k = varlen_inputs([5, 3], [0, 0], 4, 4, 192, 128, BF16, "cuda", "no keys")
    o, lse = tvarlen.varlen_attention(q, k, v, cu_q, cu_k, 5, 0, 0.1, True, config=SM90)
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
    _paged_sm90_or_skip(dtype)
    case = PagedVarlenCase(f"sm90-h{h}-page{page}", [0, 1, 15, 16, 17, 300, 6, 3, 130],
                           [40, 1000, 15, 80, 17, 2300, 2, 0, 700], h, page, kv_std=1.0)

    def call(q, k_cache, table, lens, qo, dv, scale, causal, max_q_len):
        # The op allocates its output: leave a NaN-filled block of that size for the caching allocator to hand
        # back, so that a row the kernel does not write cannot pass as 0.
        torch.full((q.shape[0], h, dv), float("nan"), dtype=dtype, device="cuda")
        return paged_kernel(SM90)(q, k_cache, table, lens, qo, dv, scale, causal, max_q_len)

    check_paged_varlen(call, case, causal, dtype, "cuda", HOPPER_PAGED)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_paged_prefill_hopper_kernel_many_tiles_per_program(causal):
    """The persistent kernel's hand-off: 5 programs for 117 tiles, so each runs tiles of several requests in
    a row (empty ones, rows that see no key, an empty KV among them: the Q and ring bookkeeping must carry
    across); a second call (its counter starts again) and CUDA-graph replays with new inputs agree."""
    _paged_sm90_or_skip(BF16)
    case = PagedVarlenCase("many-tiles", [7, 0, 200, 1, 33, 6, 64, 120, 3], [300, 50, 900, 0, 33, 2, 1000, 130, 70],
                           16, 64, kv_std=1.0)
    q, cache, k_cache, bt, lens, qo = paged_varlen_inputs(case, BF16, "cuda", causal)
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], 16), float("nan"), dtype=torch.float32, device="cuda")

    def call():
        paged_varlen_sm90(q, k_cache, bt, lens, qo, 576 ** -0.5, causal, out, lse, programs=5)
        return out.clone(), lse.clone()

    o, o_lse = call()
    ref, ref_lse = dense_paged(q, qo.tolist(), cache.rows, 576 ** -0.5, causal, 512)
    assert_matches(o, o_lse, ref, ref_lse, BF16, HOPPER)
    o2, lse2 = call()
    assert torch.equal(o2, o) and torch.equal(lse2, o_lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_varlen_sm90(q, k_cache, bt, lens, qo, 576 ** -0.5, causal, out, lse, programs=5)
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
    _paged_sm90_or_skip(BF16)
    case = PagedVarlenCase("negative", [40, 9, 70, 5], [100, 0, 200, 64], 16, 64, kv_std=1.0)
    q, cache, k_cache, bt, lens, qo = paged_varlen_inputs(case, BF16, "cuda", causal)
    ref, ref_lse = dense_paged(q, qo.tolist(), cache.rows, 576 ** -0.5, causal, 512)
    lens[1] = -7
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], 16), float("nan"), dtype=torch.float32, device="cuda")
    errors.device_errors()
    paged_varlen_sm90(q, k_cache, bt, lens, qo, 576 ** -0.5, causal, out, lse, programs=3)
    torch.cuda.synchronize()
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[40:49] = False
    assert_matches(out[keep.cuda()], lse[keep.cuda()], ref[keep], ref_lse[keep], BF16, HOPPER)
    assert out[40:49].isnan().all() and lse[40:49].isnan().all()
    assert errors.device_errors() == errors.NEGATIVE_LENGTH
