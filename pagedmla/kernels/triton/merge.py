"""Triton kernels: merge (being written)."""
