"""Optional adapters agree with the reference on the GPU (runs where the library is installed)."""

import pytest
import torch

import pagedmla

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads,q_len,causal", [(16, 1, False), (128, 1, True), (64, 2, True)])
def test_flashmla_provider_matches_reference(heads, q_len, causal):
    pytest.importorskip("flash_mla")
    gen = torch.Generator(device="cuda").manual_seed(heads + q_len)
    b, ps = 8, 64
    lens = torch.randint(1, 3000, (b,), generator=gen, device="cuda", dtype=torch.int32)
    pages_per = 48
    num_pages = b * pages_per + 1
    cache = torch.randn(num_pages, ps, 1, 576, generator=gen, device="cuda").to(torch.bfloat16)
    block_table = (torch.randperm(num_pages - 1, generator=gen, device="cuda")[: b * pages_per] + 1)
    block_table = block_table.view(b, pages_per).to(torch.int32)
    q = torch.randn(b, q_len, heads, 576, generator=gen, device="cuda").to(torch.bfloat16)
    md, ns = pagedmla.get_mla_metadata(lens, q_len * heads, 1)
    out, lse = pagedmla.flash_mla_with_kvcache(q, cache, block_table, lens, 512, md, ns, causal=causal,
                                               provider="flashmla")
    ref, ref_lse = pagedmla.flash_mla_with_kvcache(q.float(), cache.float(), block_table, lens, 512, md, ns,
                                                   causal=causal, provider="torch")
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
