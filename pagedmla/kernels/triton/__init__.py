"""pagedmla's Triton kernels; importing this package registers them as the `triton` provider."""

from pagedmla.kernels.triton import decode, merge, paged_prefill, varlen  # noqa: F401
