"""GPU kernels behind the `triton` provider (one kernel family per module under kernels/triton)."""
