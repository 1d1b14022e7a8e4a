"""Triton launchers take strided index tensors (views) and read the values the checks saw."""

import pytest
import torch
from oracle import gen

import pagedmla

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.float16


def _strided(values: list[int]) -> torch.Tensor:
    """An int32 view with stride 2 whose skipped entries are huge: reading them would go far out of bounds."""
    t = torch.tensor([[v, 1 << 20] for v in values], dtype=torch.int32, device=DEV)
    return t[:, 0]


def test_decode_and_paged_prefill_with_strided_lengths():
    g = gen("strided-paged")
    ps, pages = 16, 12
    cache = torch.randn(pages, ps, 1, 128, generator=g).to(DEV, DT)
    block_table = torch.randperm(pages - 1, generator=g).add(1)[:10].view(2, 5).to(DEV, torch.int32)
    lens = _strided([40, 70])
    q = torch.randn(2, 1, 4, 128, generator=g).to(DEV, DT)
    md, ns = pagedmla.get_mla_metadata(lens, 4, 1, num_sm_parts=3)
    got = pagedmla.flash_mla_with_kvcache(q, cache, block_table, lens, 64, md, ns, causal=True, provider="triton")
    ref = pagedmla.flash_mla_with_kvcache(q.float(), cache.float(), block_table, lens.contiguous(), 64, md, ns,
                                          causal=True, provider="torch")
    torch.testing.assert_close(got[0].float(), ref[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-3, atol=1e-3)
    qo = _strided([0, 3, 5])
    qv = torch.randn(5, 4, 128, generator=g).to(DEV, DT)
    got = pagedmla.flash_mla_varlen_with_kvcache(qv, cache, block_table, lens, qo, 64, provider="triton")
    ref = pagedmla.flash_mla_varlen_with_kvcache(qv.float(), cache.float(), block_table, lens, qo, 64,
                                                 provider="torch")
    torch.testing.assert_close(got[0].float(), ref[0], rtol=2e-3, atol=2e-3)


def test_varlen_with_strided_cumulative_lengths():
    g = gen("strided-varlen")
    cu = _strided([0, 7, 19])
    q, k = (torch.randn(19, 2, 32, generator=g).to(DEV, DT) for _ in range(2))
    v = torch.randn(19, 2, 16, generator=g).to(DEV, DT)
    got = pagedmla.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, provider="triton")
    ref = pagedmla.flash_attn_varlen_func(q.float(), k.float(), v.float(), cu, cu, 12, 12, causal=True,
                                          provider="torch")
    torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf"), 1e39, True, "0.1"])
def test_kernel_entry_points_reject_a_non_positive_scale(scale):
    """The Triton entry points (called by the backend without the public ops' checks) need a positive scale:
    the Hopper kernels keep unscaled row maxima, which are the maxima of the scaled scores only then."""
    from pagedmla.kernels.triton import paged_varlen as tpaged
    from pagedmla.kernels.triton import varlen as tvarlen
    from pagedmla.kernels.triton.decode import paged_decode_triton

    g = gen("scale-checks")
    cache = torch.randn(3, 16, 1, 128, generator=g).to(DEV, DT)
    table = torch.tensor([[1, 2]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([20], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, 4, 128, generator=g).to(DEV, DT)
    md, ns = pagedmla.get_mla_metadata(lens, 4, 1, num_sm_parts=2)
    with pytest.raises(ValueError, match="softmax_scale"):
        paged_decode_triton(q, cache, table, lens, 64, md, ns, scale, True)
    qo = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="softmax_scale"):
        tpaged.paged_varlen_attention(q[0], cache, table, lens, qo, 64, scale, True, 1)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEV)
    x = torch.randn(5, 2, 32, generator=g).to(DEV, DT)
    with pytest.raises(ValueError, match="softmax_scale"):
        tvarlen.varlen_attention(x, x, x, cu, cu, 5, 5, scale, True)
