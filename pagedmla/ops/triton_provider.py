"""The `triton` provider: pagedmla's Triton and Gluon kernels (``pagedmla/kernels/triton``) for each op.

Each kernel entry point already takes its op's calling convention, so the registration is all there is.
"""

from __future__ import annotations

from pagedmla.kernels.triton.decode import paged_decode_triton
from pagedmla.kernels.triton.merge import merge_state
from pagedmla.kernels.triton.paged_varlen import paged_varlen_attention
from pagedmla.kernels.triton.varlen import varlen_attention
from pagedmla.ops.providers import register_impl

register_impl("paged_decode", "triton", paged_decode_triton)
register_impl("paged_varlen", "triton", paged_varlen_attention)
register_impl("varlen", "triton", varlen_attention)
register_impl("merge", "triton", merge_state)
