"""pagedmla: paged latent KV cache, kernels and attention backend for Multi-head Latent Attention."""

from pagedmla.backend import (
    ForwardBatch,
    ForwardMode,
    MLABackend,
    available_backends,
    create_backend,
    register_backend,
)
from pagedmla.cache import MLAKVCache, OutOfPagesError, PageAllocator, RequestTable
from pagedmla.config import MLAConfig
from pagedmla.draft_backend import MLADraftBackend
from pagedmla.kv_format import dequantize_latent, quantize_latent
from pagedmla.ops import (
    available_providers,
    flash_attn_varlen_func,
    flash_mla_varlen_with_kvcache,
    flash_mla_with_kvcache,
    get_mla_metadata,
    merge_state,
)

__version__ = "0.1.0"

__all__ = [
    "ForwardBatch",
    "ForwardMode",
    "MLABackend",
    "MLAConfig",
    "MLADraftBackend",
    "MLAKVCache",
    "OutOfPagesError",
    "PageAllocator",
    "RequestTable",
    "available_backends",
    "available_providers",
    "create_backend",
    "dequantize_latent",
    "flash_attn_varlen_func",
    "flash_mla_varlen_with_kvcache",
    "flash_mla_with_kvcache",
    "get_mla_metadata",
    "merge_state",
    "quantize_latent",
    "register_backend",
]
