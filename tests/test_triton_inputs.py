"""The Triton kernel entry points check what the public ops check for them (the backend calls them directly).

Strided index tensors (views) are test_conformance.py's ``strided`` cases, for every provider."""

import pytest
import torch
from oracle import gen

import pagedmla

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.float16


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
