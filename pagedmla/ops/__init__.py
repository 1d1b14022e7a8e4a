"""pagedmla's functional API: FlashMLA / FlashAttention compatible calls, and their torch.library custom ops."""

from pagedmla.ops import library  # noqa: F401  (registers the pagedmla:: custom ops that tracing routes to)
from pagedmla.ops.attention import (
    flash_attn_varlen_func,
    flash_mla_varlen_with_kvcache,
    flash_mla_with_kvcache,
    merge_state,
)
from pagedmla.ops.providers import available_providers, register_impl
from pagedmla.ops.schedule import get_mla_metadata

__all__ = [
    "available_providers",
    "flash_attn_varlen_func",
    "flash_mla_varlen_with_kvcache",
    "flash_mla_with_kvcache",
    "get_mla_metadata",
    "merge_state",
    "register_impl",
]
