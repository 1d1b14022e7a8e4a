"""DeepSeek-V2/V3 model configuration: read a Hugging Face ``config.json``, check it, derive MLAConfig.

Both spellings of the rope settings are accepted: the hub checkpoints' ``rope_scaling`` + top-level
``rope_theta``, and the ``rope_parameters`` dict that transformers >= 5 writes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedmla.config import MLAConfig

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_SCORING = ("softmax", "sigmoid")
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class RopeConfig:
    """Rotary settings of the ``qk_rope_head_dim`` part.

    ``style``: "interleave" (DeepSeek-V3 with ``rope_interleave``: pairs (x0, x1), (x2, x3) rotated, output
    laid out as [rotated evens | rotated odds]), "complex" (DeepSeek-V2: the same pairs, output kept
    interleaved) or "neox" (halves rotated, V3 with ``rope_interleave`` false).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    style: str = "interleave"

    @property
    def is_yarn(self) -> bool:
        return self.rope_type != "default"

    def as_hf_rope_scaling(self) -> dict[str, Any] | None:
        """The rope_scaling dict MLAConfig understands (None without YaRN)."""
        if not self.is_yarn:
            return None
        return {"type": "yarn", "factor": self.factor, "mscale": self.mscale or 0.0,
                "mscale_all_dim": self.mscale_all_dim or 0.0,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass
class DeepseekConfig:
    """Architecture of one DeepSeek-V2/V3 checkpoint (the fields of its ``config.json`` the model uses).

    ``n_routed_experts`` None (or 0) makes every layer dense; otherwise layer ``i`` is MoE when
    ``i >= first_k_dense_replace and i % moe_layer_freq == 0``.
    """

    model_type: str = "deepseek_v3"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: unsupported architecture {self.model_type!r}; "
                             f"pagedmla runs {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even for rotary embedding, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.is_moe_model:
            for name in ("moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group", "moe_layer_freq"):
                _positive(name, getattr(self, name))
            if self.scoring_func not in _SCORING:
                raise ValueError(f"scoring_func: expected one of {_SCORING}, got {self.scoring_func!r}")
            if self.topk_method not in _TOPK_METHODS:
                raise ValueError(f"topk_method: expected one of {_TOPK_METHODS}, got {self.topk_method!r}")
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_group: {self.n_routed_experts} experts do not split into {self.n_group} groups")
            if self.topk_group > self.n_group:
                raise ValueError(f"topk_group: {self.topk_group} exceeds n_group={self.n_group}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} exceeds "
                                 f"n_routed_experts={self.n_routed_experts}")
        if self.rope.style not in ("interleave", "complex", "neox"):
            raise ValueError(f"rope_interleave: unknown rotary style {self.rope.style!r}")

    @property
    def is_moe_model(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.is_moe_model and layer_id >= self.first_k_dense_replace
                and layer_id % self.moe_layer_freq == 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek and transformers)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.is_yarn and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def mla_config(self, **serving: Any) -> MLAConfig:
        """The backend's MLAConfig for this model; ``serving`` sets page_size, dtype, max_batch_size, ..."""
        serving.setdefault("max_context_len", self.max_position_embeddings)
        return MLAConfig(num_heads=self.num_attention_heads, kv_lora_rank=self.kv_lora_rank,
                         qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                         v_head_dim=self.v_head_dim, num_layers=self.num_hidden_layers,
                         rope_scaling=self.rope.as_hf_rope_scaling(), softmax_scale=self.softmax_scale, **serving)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DeepseekConfig:
        """Parse a ``config.json`` dict; ValueError naming the field for anything unsupported."""
        if not isinstance(raw, Mapping):
            raise TypeError(f"config: expected a mapping, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: unsupported architecture {model_type!r} "
                             f"(architectures={raw.get('architectures')}); pagedmla runs {SUPPORTED_MODEL_TYPES}")
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise ValueError(f"quantization_config: quantized checkpoints ({method}) are not supported; "
                             "use a bf16/fp16/fp32 checkpoint")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                   if raw.get(k) is None]
        if missing:
            raise ValueError(f"config: missing field(s) {missing}")
        is_v3 = model_type == "deepseek_v3"
        n_experts = raw.get("n_routed_experts")
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw.get("intermediate_size") or raw["hidden_size"] * 4),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            hidden_act=str(raw.get("hidden_act", "silu")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            n_routed_experts=None if not n_experts else int(n_experts),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 1),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            topk_method=str(raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")),
            scoring_func=str(raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if is_v3 else 1.0)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            rope=_parse_rope(raw, is_v3),
            eos_token_id=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> DeepseekConfig:
        """Read ``config.json`` (a file or the checkpoint directory holding it)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"path: no config.json at {path}")
        with open(path) as f:
            try:
                raw = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"path: {path} is not valid JSON ({exc})") from None
        return cls.from_dict(raw)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _parse_rope(raw: Mapping[str, Any], is_v3: bool) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (expected one of {_ROPE_TYPES})")
    max_pos = int(raw.get("max_position_embeddings", 4096))
    original = int(params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    # As in transformers: a YaRN config without a factor scales by the context-length ratio.
    factor = float(factor) if factor is not None else max_pos / original
    if is_v3:
        style = "interleave" if raw.get("rope_interleave", True) else "neox"
    else:
        style = "complex"
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type="default" if rope_type == "default" else "yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        style=style,
    )


# The built-in ``tiny`` model's config.json fields (see tiny_config).
TINY_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "q_lora_rank": 192,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 256,
                        "beta_fast": 32, "beta_slow": 1},
    "eos_token_id": None,
}


def tiny_config() -> DeepseekConfig:
    """The built-in ``tiny`` model: DeepSeek-V3 layout with the real MLA dims (512/64/128/128), 3 layers
    (one dense, two MoE with 8 routed experts in 4 groups and a shared expert), YaRN rope (x4 over 256
    positions: 1024 context), vocab 512."""
    return DeepseekConfig.from_dict(TINY_CONFIG)
