"""Triton launchers take strided index tensors (views) and read the values the checks saw."""

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
