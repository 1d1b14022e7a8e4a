"""MLAConfig: everything the backend needs to know about one model's attention, checked once."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pagedmla import kv_format

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
_FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn", "fp8_e5m2", "float8_e5m2")
# float32 caches exist for the reference path and CPU tests; kernels take bf16/fp16.
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EXTEND_PREFIX_MODES = ("auto", "absorbed", "chunked")
MIXED_DECODE_KERNELS = ("auto", "decode", "varlen")


def resolve_dtype(value: Any, name: str) -> torch.dtype:
    """Map a dtype or its usual spelling to a torch dtype; ValueError naming `name` otherwise."""
    if isinstance(value, torch.dtype):
        if value in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
            raise ValueError(f"{name}: {value} is not supported (FP8 KV caches are kv_cache_dtype fp8_e4m3 or "
                             "fp8_ds_mla); use bfloat16 or float16")
        if not value.is_floating_point:
            raise ValueError(f"{name}: expected a floating-point dtype, got {value}")
        return value
    if isinstance(value, str):
        key = value.lower().replace("torch.", "")
        if key in _FP8_NAMES:
            raise ValueError(f"{name}: {value!r} is not supported (FP8 KV caches are kv_cache_dtype fp8_e4m3 or "
                             "fp8_ds_mla); use bfloat16 or float16")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"{name}: unknown dtype {value!r}; expected one of bfloat16, float16, float32")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1): with DeepSeek's
    ``mscale_all_dim`` it gives the attention scale's factor (squared), with ``mscale`` the rope's."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class MLAConfig:
    """Attention geometry and serving limits of one MLA model on one tensor-parallel rank.

    ``num_heads`` is the global query-head count; ``num_local_heads`` (derived) is what one rank of
    ``attn_tp_size`` holds and what every tensor the backend sees uses.

    Decode context parallelism (``dcp_size`` > 1, this rank ``dcp_rank``): ``dcp_size`` consecutive ranks of
    the tensor-parallel group (so ``dcp_size`` divides ``attn_tp_size``) share the latent cache by token
    interleave: token t of a request lives on DCP rank ``t % dcp_size``, as that rank's local token
    ``t // dcp_size``. A block-table page then holds ``tokens_per_page = page_size * dcp_size`` tokens of a
    request: ``page_size`` local rows on each DCP rank, at the same page id. ``softmax_scale`` defaults to
    ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * mscale**2``, where ``mscale`` comes from the
    DeepSeek YaRN rope scaling when ``rope_scaling`` asks for it.

    KV cache: ``kv_cache_dtype`` (default ``dtype``) is bfloat16, float16, float32 or an FP8 format
    (``pagedmla.kv_format``): "fp8_e4m3" (or "fp8", torch.float8_e4m3fn) stores float8_e4m3fn rows with one
    scale per layer, ``kv_cache_scale`` (1.0 unless given); "fp8_ds_mla" (or torch.uint8) FlashMLA's 656-byte
    rows with their own scales (kv_lora_rank 512, rope 64 only). After checking, ``kv_cache_dtype`` is the
    storage dtype (float8_e4m3fn, uint8 for fp8_ds_mla) and ``kv_format`` names the FP8 format (None otherwise).

    Speculative decoding: a target backend's ``num_draft_tokens`` is the tokens per request of a
    TARGET_VERIFY step (the last token and its drafts); a draft backend's (``is_draft``) the most tokens
    per request of a DRAFT_EXTEND step (the accepted drafts and the target's token), which its CUDA
    graphs pad every request to.
    """

    num_heads: int = 16
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_layers: int = 1
    attn_tp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0
    rope_scaling: Mapping[str, Any] | None = None
    softmax_scale: float | None = None
    dtype: Any = torch.bfloat16
    kv_cache_dtype: Any = None
    page_size: int = 64
    max_context_len: int = 4096
    max_batch_size: int = 256
    num_draft_tokens: int = 0
    is_draft: bool = False
    chunked_prefix_capacity: int = 32768
    extend_prefix_mode: str = "auto"
    # Average new tokens per extending request at which the chunked MHA prefix path beats the
    # absorbed one: absorbed costs 1088 MACs per (query, key, head), MHA 320 plus a one-off 512x256
    # decompression per (key, head), so they cross near 131072 / 768 = 170 queries per request.
    chunked_prefix_min_extend: int = 170
    # Prefill without a cached prefix in the absorbed form over the paged cache instead of ragged MHA over the
    # new tokens (SGLang's ``mla_disable_ragged``): one attention form for every step, at the absorbed form's
    # cost per query (1088 MACs per key and head against 320 + the decompression).
    disable_ragged: bool = False
    # The kernel of a MIXED step's decodes (one token each): "varlen" with the extends, one launch, where each
    # request's rows stream its whole context on one SM, so a long decode beside a short chunk is the step's
    # tail; "decode" the split-KV decode kernel, whose schedule spreads each context over several SMs, and the
    # extends apart (a second launch, and the decodes' memory-bound tiles no longer overlap the extends'
    # compute-bound ones); "auto" "decode" where the longest decode would be the tail (the backend's rule).
    mixed_decode_kernel: str = "auto"
    # fp8_e4m3 caches: every layer's k_scale (value = fp8 x scale); None takes 1.0, the engines' default for a
    # checkpoint without calibrated scales.
    kv_cache_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "num_layers", "attn_tp_size", "dcp_size", "page_size", "max_context_len", "max_batch_size",
                     "chunked_prefix_capacity", "chunked_prefix_min_extend"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.attn_tp_size:
            raise ValueError(f"num_heads: {self.num_heads} heads are not divisible by attn_tp_size={self.attn_tp_size}")
        if self.attn_tp_size % self.dcp_size:
            raise ValueError(f"dcp_size: {self.dcp_size} does not divide attn_tp_size={self.attn_tp_size} (decode "
                             "context parallelism splits the cache over ranks of one tensor-parallel group)")
        if isinstance(self.dcp_rank, bool) or not isinstance(self.dcp_rank, int) \
                or not 0 <= self.dcp_rank < self.dcp_size:
            raise ValueError(f"dcp_rank: expected an int in 0..{self.dcp_size - 1}, got {self.dcp_rank!r}")
        if self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: expected a power of two between 1 and 256, got {self.page_size}")
        draft = self.num_draft_tokens
        if isinstance(draft, bool) or not isinstance(draft, int) or draft < 0:
            raise ValueError(f"num_draft_tokens: expected an int >= 0, got {self.num_draft_tokens!r}")
        if self.is_draft and self.num_draft_tokens < 1:
            raise ValueError("is_draft: a draft backend needs num_draft_tokens >= 1")
        if not isinstance(self.disable_ragged, bool):
            raise ValueError(f"disable_ragged: expected a bool, got {self.disable_ragged!r}")
        if self.mixed_decode_kernel not in MIXED_DECODE_KERNELS:
            raise ValueError(f"mixed_decode_kernel: expected one of {MIXED_DECODE_KERNELS}, "
                             f"got {self.mixed_decode_kernel!r}")
        if self.extend_prefix_mode not in EXTEND_PREFIX_MODES:
            raise ValueError(f"extend_prefix_mode: expected one of {EXTEND_PREFIX_MODES}, "
                             f"got {self.extend_prefix_mode!r}")
        self.dtype = resolve_dtype(self.dtype, "dtype")
        fp8 = kv_format.fp8_storage(self.kv_cache_dtype)
        if fp8 is not None:
            self.kv_cache_dtype = fp8[0]
        else:
            self.kv_cache_dtype = resolve_dtype(self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype,
                                                "kv_cache_dtype")
            if self.kv_cache_dtype not in _CACHE_DTYPES:
                raise ValueError(f"kv_cache_dtype: expected bfloat16, float16, float32, fp8_e4m3 or fp8_ds_mla, "
                                 f"got {self.kv_cache_dtype}")
        if self.kv_format == "fp8_ds_mla" and (self.kv_lora_rank, self.qk_rope_head_dim) != (
                kv_format.LATENT_DIM, kv_format.ROPE_DIM):
            raise ValueError(f"kv_cache_dtype: fp8_ds_mla rows hold {kv_format.LATENT_DIM} latent + "
                             f"{kv_format.ROPE_DIM} rope columns, this model has {self.kv_lora_rank} + "
                             f"{self.qk_rope_head_dim}")
        if self.kv_cache_scale is not None:
            if self.kv_format != "fp8_e4m3":
                raise ValueError(f"kv_cache_scale: only an fp8_e4m3 cache has a scale (kv_cache_dtype is "
                                 f"{self.kv_format or self.kv_cache_dtype})")
            if isinstance(self.kv_cache_scale, bool) or not isinstance(self.kv_cache_scale, (int, float)) \
                    or not 0 < self.kv_cache_scale < math.inf:
                raise ValueError(f"kv_cache_scale: expected a finite positive float, got {self.kv_cache_scale!r}")
        if self.softmax_scale is None:
            self.softmax_scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * self.mscale ** 2
        elif isinstance(self.softmax_scale, bool) or not (isinstance(self.softmax_scale, (int, float))
                                                          and self.softmax_scale > 0):
            raise ValueError(f"softmax_scale: expected a positive float, got {self.softmax_scale!r}")

    @property
    def mscale(self) -> float:
        rs = self.rope_scaling or {}
        kind = rs.get("type", rs.get("rope_type"))
        if kind not in ("yarn", "deepseek_yarn"):
            return 1.0
        factor = rs.get("factor")
        if factor is None and rs.get("original_max_position_embeddings"):
            factor = self.max_context_len / float(rs["original_max_position_embeddings"])
        return yarn_mscale(float(factor or 1.0), float(rs.get("mscale_all_dim") or 0.0))

    @property
    def kv_format(self) -> str | None:
        """The cache's FP8 format (``pagedmla.kv_format``: "fp8_e4m3", "fp8_ds_mla"), or None for a cache of
        ``kv_cache_dtype`` values."""
        return kv_format.format_of(self.kv_cache_dtype)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.attn_tp_size

    @property
    def num_dcp_heads(self) -> int:
        """Heads one DCP rank attends with: the local heads of every rank of its DCP group."""
        return self.num_local_heads * self.dcp_size

    @property
    def tokens_per_page(self) -> int:
        """Tokens of a request one block-table page holds: ``page_size`` rows on each DCP rank."""
        return self.page_size * self.dcp_size

    @property
    def kv_dim(self) -> int:
        """Width of one latent cache row: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_context_len // self.tokens_per_page)

    @property
    def decode_q_len(self) -> int:
        """Query tokens per request in a decode-like step: 1, or the draft tokens when verifying."""
        return self.num_draft_tokens if self.num_draft_tokens > 1 and not self.is_draft else 1

    @classmethod
    def from_hf_config(cls, cfg: Any, **overrides: Any) -> MLAConfig:
        """Build from a Hugging Face DeepSeek-V2/V3 config (a dict or a transformers config object).

        ``overrides`` set the serving fields (page_size, attn_tp_size, dtype, max_batch_size, ...).
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        missing = [k for k in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                               "v_head_dim") if get(k) is None]
        if missing:
            raise ValueError(f"from_hf_config: config lacks MLA field(s) {missing}; is this a DeepSeek-V2/V3 config?")
        kwargs = dict(
            num_heads=int(get("num_attention_heads")),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            num_layers=int(get("num_hidden_layers", 1)),
            # transformers >= 5 writes rope_parameters; hub checkpoints carry rope_scaling.
            rope_scaling=dict(get("rope_scaling") or get("rope_parameters") or {}) or None,
            max_context_len=int(get("max_position_embeddings", 4096)),
        )
        torch_dtype = get("torch_dtype", None) or get("dtype", None)
        if torch_dtype is not None and "dtype" not in overrides:
            kwargs["dtype"] = torch_dtype if isinstance(torch_dtype, torch.dtype) else str(torch_dtype)
        kwargs.update(overrides)
        return cls(**kwargs)
