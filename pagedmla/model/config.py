"""DeepSeek-V2/V3 model configuration: read a Hugging Face ``config.json``, check it, derive MLAConfig.

Both spellings of the rope settings are accepted: the hub checkpoints' ``rope_scaling`` + top-level
``rope_theta``, and the ``rope_parameters`` dict that transformers >= 5 writes. Every field is checked
for its JSON type and range before anything is built from it (a string, list or bool where a number
belongs names the field); ``weight_bytes`` sizes the model in closed form so that the loader can refuse
one too large for the device before building it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedmla.config import MLAConfig, resolve_dtype, yarn_mscale

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_SCORING = ("softmax", "sigmoid")
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


class CheckpointError(ValueError):
    """A checkpoint directory or its config.json that cannot be loaded: one line naming the config field
    or the file (never a command-line flag, though a field may share a flag's name, as ``dtype`` does)."""


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
    ``i >= first_k_dense_replace and i % moe_layer_freq == 0``. ``num_nextn_predict_layers``: the
    multi-token-prediction (MTP) layers the checkpoint holds after its last decoder layer (indices
    ``num_hidden_layers ..``), the draft model of ``pagedmla.model.mtp``.
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
    num_nextn_predict_layers: int = 0

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
        n = self.num_nextn_predict_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_nextn_predict_layers: expected an int >= 0, got {n!r}")
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
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def mla_config(self, **serving: Any) -> MLAConfig:
        """The backend's MLAConfig for this model; ``serving`` sets page_size, dtype, max_batch_size, ..."""
        serving.setdefault("max_context_len", self.max_position_embeddings)
        return MLAConfig(num_heads=self.num_attention_heads, kv_lora_rank=self.kv_lora_rank,
                         qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                         v_head_dim=self.v_head_dim, num_layers=self.num_hidden_layers,
                         rope_scaling=self.rope.as_hf_rope_scaling(), softmax_scale=self.softmax_scale, **serving)

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError naming the field (and tensor_parallel_size) that ``size`` ranks cannot split evenly:
        the attention heads, the dense layers' and the experts' intermediate features, the vocabulary.
        (Every rank holds every routed expert, with its slice of their features, so ``n_routed_experts``
        need not divide.)"""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size: expected a positive int, got {size!r}")
        splits = [("num_attention_heads", "attention heads"), ("vocab_size", "the vocabulary")]
        if self.num_moe_layers < self.num_hidden_layers:
            splits.append(("intermediate_size", "the dense MLP's features"))
        if self.is_moe_model:
            splits.append(("moe_intermediate_size", "each expert's features"))
        for name, what in splits:
            if getattr(self, name) % size:
                raise ValueError(f"tensor_parallel_size: {name}={getattr(self, name)} ({what}) does not split "
                                 f"evenly over tensor_parallel_size={size} ranks")

    def weight_bytes(self, itemsize: int, tensor_parallel_size: int = 1) -> int:
        """Bytes of the model's tensors with ``itemsize``-byte weights (routers are float32; the absorbed
        attention copies included), on one rank of ``tensor_parallel_size`` (its slices of the heads, the
        intermediate features and the vocabulary): a closed form, so that absurd sizes are counted without
        building anything."""
        sizes = {f: getattr(self, f) for f in _SIZE_FIELDS}
        for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size", "vocab_size"):
            if sizes[name]:
                sizes[name] //= tensor_parallel_size
        return _weight_bytes(sizes, self, itemsize)

    def largest_size_field(self, itemsize: int) -> str:
        """The size field to blame when ``weight_bytes`` is too large: among the fields above DeepSeek-V3's
        own sizes, the one whose return to that size would shrink the weights most; ``num_hidden_layers``
        when none is (a real model too large for the device)."""
        sizes = {f: getattr(self, f) for f in _SIZE_FIELDS if getattr(self, f)}
        over = [f for f, v in sizes.items() if v > _V3_SIZES[f]]
        total = _weight_bytes(sizes, self, itemsize)
        return max(over, key=lambda f: total - _weight_bytes({**sizes, f: _V3_SIZES[f]}, self, itemsize),
                   default="num_hidden_layers")

    @property
    def num_moe_layers(self) -> int:
        """Layers i < num_hidden_layers with i >= first_k_dense_replace and i % moe_layer_freq == 0."""
        return _num_moe_layers(self.num_hidden_layers, self) if self.is_moe_model else 0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DeepseekConfig:
        """Parse a ``config.json`` dict; ValueError naming the field for anything unsupported, of the wrong
        type or out of range (every field is checked before anything is built from it)."""
        if not isinstance(raw, Mapping):
            raise TypeError(f"config: expected a mapping, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: unsupported architecture {model_type!r} "
                             f"(architectures={raw.get('architectures')}); pagedmla runs {SUPPORTED_MODEL_TYPES}")
        quant = raw.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
            raise ValueError(f"quantization_config: quantized checkpoints ({method}) are not supported; "
                             "use a bf16/fp16/fp32 checkpoint")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                   if raw.get(k) is None]
        if missing:
            raise ValueError(f"config: missing field(s) {missing}")
        is_v3 = model_type == "deepseek_v3"
        hidden = _int(raw, "hidden_size")
        dtype_key = "dtype" if raw.get("dtype") is not None else "torch_dtype"
        dtype = _str(raw, dtype_key, None)
        if dtype is not None:
            resolve_dtype(dtype, dtype_key)
        return cls(
            model_type=model_type,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size", hidden * 4),
            num_hidden_layers=_int(raw, "num_hidden_layers"),
            num_attention_heads=_int(raw, "num_attention_heads"),
            q_lora_rank=_int(raw, "q_lora_rank", None),
            kv_lora_rank=_int(raw, "kv_lora_rank"),
            qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
            v_head_dim=_int(raw, "v_head_dim"),
            hidden_act=_str(raw, "hidden_act", "silu"),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=_int(raw, "max_position_embeddings", 4096),
            attention_bias=_bool(raw, "attention_bias", False),
            mlp_bias=_bool(raw, "mlp_bias", False),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
            # As in the hub configs, 0 (like null) means the default for these.
            n_routed_experts=_int(raw, "n_routed_experts", None, minimum=0) or None,
            n_shared_experts=_int(raw, "n_shared_experts", 0, minimum=0),
            moe_intermediate_size=_int(raw, "moe_intermediate_size", 0, minimum=0),
            num_experts_per_tok=_int(raw, "num_experts_per_tok", 1, minimum=0) or 1,
            n_group=_int(raw, "n_group", 1, minimum=0) or 1,
            topk_group=_int(raw, "topk_group", 1, minimum=0) or 1,
            topk_method=_str(raw, "topk_method", "noaux_tc" if is_v3 else "greedy"),
            scoring_func=_str(raw, "scoring_func", "sigmoid" if is_v3 else "softmax"),
            norm_topk_prob=_bool(raw, "norm_topk_prob", is_v3),
            routed_scaling_factor=_float(raw, "routed_scaling_factor", 2.5 if is_v3 else 1.0),
            first_k_dense_replace=_int(raw, "first_k_dense_replace", 0, minimum=0),
            moe_layer_freq=_int(raw, "moe_layer_freq", 1, minimum=0) or 1,
            rope=_parse_rope(raw, is_v3),
            eos_token_id=_token_ids(raw, "eos_token_id"),
            bos_token_id=_int(raw, "bos_token_id", None, minimum=0),
            dtype=dtype,
            num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0, minimum=0),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> DeepseekConfig:
        """Read ``config.json`` (a file or the checkpoint directory holding it). Every error is one line
        naming the field (or ``config``) and the file (CheckpointError)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"path: no config.json at {path}")
        try:
            with open(path, "rb") as f:
                raw = json.load(f)
        except OSError as exc:
            raise CheckpointError(f"config: cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"config: {path} is not valid JSON: {one_line(exc)}") from None
        try:
            return cls.from_dict(raw)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{one_line(exc)} (in {path})") from None


# The fields weight_bytes multiplies (each >= 1 when set; q_lora_rank and the expert counts may be unset).
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_routed_experts", "n_shared_experts", "moe_intermediate_size")
# Those sizes in DeepSeek-V3 (671B parameters), the largest checkpoint of the family.
_V3_SIZES = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
             "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
             "moe_intermediate_size": 2048}


def _num_moe_layers(layers: int, cfg: DeepseekConfig) -> int:
    first, freq = cfg.first_k_dense_replace, cfg.moe_layer_freq
    if layers <= first:
        return 0
    return (layers - 1) // freq - (first - 1) // freq if first else (layers - 1) // freq + 1


def _weight_bytes(s: Mapping[str, int | None], cfg: DeepseekConfig, itemsize: int) -> int:
    """``DeepseekConfig.weight_bytes`` for the sizes ``s`` (the _SIZE_FIELDS) and ``cfg``'s layout."""
    h, heads, q_lora = s["hidden_size"], s["num_attention_heads"], s.get("q_lora_rank")
    qk, kv_lora = s["qk_nope_head_dim"] + s["qk_rope_head_dim"], s["kv_lora_rank"]
    q = h * heads * qk if q_lora is None else q_lora * (h + 1 + heads * qk)
    kv_b = kv_lora * heads * (s["qk_nope_head_dim"] + s["v_head_dim"])
    # q, kv_a (+ its norm), kv_b and its absorbed copies w_uk / w_uv, o, two norms.
    attention = q + h * (kv_lora + s["qk_rope_head_dim"]) + kv_lora + 2 * kv_b + heads * s["v_head_dim"] * h + 2 * h
    layers = s["num_hidden_layers"]
    experts = s.get("n_routed_experts") or 0
    moe = _num_moe_layers(layers, cfg) if experts else 0
    expert_mlp = 3 * h * s.get("moe_intermediate_size", 0)
    weights = s["vocab_size"] * h * (1 if cfg.tie_word_embeddings else 2) + layers * attention + h \
        + (layers - moe) * 3 * h * s["intermediate_size"] + moe * (experts + s.get("n_shared_experts", 0)) * expert_mlp
    return weights * itemsize + moe * experts * 4 * (h + 1)  # float32 router weights and bias


_REQUIRED = object()
# Sizes beyond int64 cannot index a tensor; the memory estimate refuses far smaller ones.
_MAX_INT = (1 << 63) - 1


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a CLI error is one line)."""
    return " ".join(str(exc).split())


def _field(raw: Mapping[str, Any], name: str, default: Any) -> Any:
    value = raw.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config: missing field {name!r}")
        return default
    return value


def _int(raw: Mapping[str, Any], name: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
    """Field ``name``: a JSON integer >= ``minimum`` (null or absent: ``default``)."""
    value = _field(raw, name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], name: str, default: Any = _REQUIRED, *, positive: bool = True) -> Any:
    """Field ``name``: a finite JSON number (> 0 when ``positive``; null or absent: ``default``)."""
    value = _field(raw, name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ValueError(f"{name}: expected a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def _bool(raw: Mapping[str, Any], name: str, default: bool) -> bool:
    value = _field(raw, name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return value


def _str(raw: Mapping[str, Any], name: str, default: Any) -> Any:
    """Field ``name``: a string (null, absent or empty: ``default``)."""
    value = _field(raw, name, default)
    if value is default:
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {value!r}")
    return value or default


def _token_ids(raw: Mapping[str, Any], name: str) -> list[int]:
    """Field ``name``: null, a token id, or a list of them."""
    value = _field(raw, name, None)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_INT for t in ids):
        raise ValueError(f"{name}: expected a token id (an integer >= 0) or a list of them, got {value!r}")
    return list(ids)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _parse_rope(raw: Mapping[str, Any], is_v3: bool) -> RopeConfig:
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{key}: expected an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (expected one of {_ROPE_TYPES})")
    max_pos = _int(raw, "max_position_embeddings", 4096)
    original = _int(params, "original_max_position_embeddings", max_pos, minimum=0) or max_pos
    # As in transformers: a YaRN config without a factor scales by the context-length ratio.
    factor = _float(params, "factor", max_pos / original)
    if is_v3:
        style = "interleave" if _bool(raw, "rope_interleave", True) else "neox"
    else:
        style = "complex"
    theta = _float(params, "rope_theta", None)
    return RopeConfig(
        theta=theta if theta is not None else _float(raw, "rope_theta", 10000.0),
        rope_type="default" if rope_type == "default" else "yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=_float(params, "beta_fast", 0.0, positive=False) or 32.0,
        beta_slow=_float(params, "beta_slow", 0.0, positive=False) or 1.0,
        mscale=_float(params, "mscale", None, positive=False),
        mscale_all_dim=_float(params, "mscale_all_dim", None, positive=False),
        attention_factor=_float(params, "attention_factor", None, positive=False),
        truncate=_bool(params, "truncate", True),
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
    "num_nextn_predict_layers": 1,
}


def tiny_config() -> DeepseekConfig:
    """The built-in ``tiny`` model: DeepSeek-V3 layout with the real MLA dims (512/64/128/128), 3 layers
    (one dense, two MoE with 8 routed experts in 4 groups and a shared expert), YaRN rope (x4 over 256
    positions: 1024 context), vocab 512, and one MTP layer (MoE, as DeepSeek-V3's)."""
    return DeepseekConfig.from_dict(TINY_CONFIG)
