"""Latent KV cache formats: what one cache row holds, its bytes, and the quantise / dequantise pair.

A leaf module (torch only): the cache, the reference, the kernels and the public ops read the constants and
the row layouts from here, so each is written once.

Formats (``FORMATS``; one per cache, every layer alike):
  ``bf16`` / ``fp16``  a row is ``kv_dim`` values of that dtype (576 for DeepSeek: 512 latent, then 64 rope).
  ``fp8_e4m3``         a row is ``kv_dim`` ``float8_e4m3fn`` values and the cache has one float32 scale per
                       layer, ``k_scale`` (a 1-element tensor): value = fp8 x k_scale, for every column, rope
                       included (the flat format engines call ``--kv-cache-dtype fp8``).
  ``fp8_ds_mla``       DeepSeek's / FlashMLA's 656-byte row (``DS_ROW_BYTES``), byte-compatible with FlashMLA's
                       FP8 KV format: bytes 0..511 are the 512 latent values as ``float8_e4m3fn``; bytes
                       512..527 four little-endian float32 scales, scale i for latent columns 128 i .. 128 i +
                       127 (value = fp8 x scale); bytes 528..655 the 64 rope values as bfloat16, unquantised.
                       Rows hold their own scales: no ``k_scale``. Stored as ``uint8`` (``float8_e4m3fn`` views
                       of the same bytes, as FlashMLA's own quantiser returns, read the same).

Scales. ``fp8_ds_mla`` writes FlashMLA's scales: per 128-column tile, the power of two at or above
``max(amax / 448, DS_MIN_SCALE_INV)``, so no value saturates and fp8 x scale is exact in float32 (any float32
scale reads correctly). ``fp8_e4m3`` takes the layer's ``k_scale`` from the caller (``fit_k_scale`` gives
amax / 448 over all columns of some rows); values beyond +-448 x k_scale saturate to +-448 x k_scale rather
than becoming NaN. One scale for latent and rope columns alike (docs/api.md, "FP8 caches", has the
measurement): fitted to the latent columns alone, a scale saturated 21-93% of rope values that were 4-64x larger
than the latent; fitted over the whole row it saturated none and left the latent's round-trip error unchanged
(2.6% relative rms error either way: e4m3 is floating point), so the format keeps the one scale engines exchange.

Round-trip error (``quantize_latent`` then ``dequantize_latent``, per value x; e4m3 has 3 mantissa bits, its
smallest normal is 2^-6 and its subnormal step 2^-9): |x' - x| <= |x| / 16 + s / 1024, with s the value's scale
(the tile's for ``fp8_ds_mla``, k_scale for ``fp8_e4m3`` while |x| <= 448 k_scale); the ``fp8_ds_mla`` rope
columns are rounded to bfloat16 (|x' - x| <= |x| / 256; exact for bfloat16 input).
"""

from __future__ import annotations

import torch

FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_ds_mla")
FP8_FORMATS = ("fp8_e4m3", "fp8_ds_mla")
# DeepSeek's latent row: kv_lora_rank latent columns (the value), then the rope key columns.
LATENT_DIM = 512
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
# fp8_ds_mla: the row's byte fields.
DS_TILE = 128  # latent columns per scale
DS_TILES = LATENT_DIM // DS_TILE
DS_SCALES_OFFSET = LATENT_DIM  # bytes: after the 512 fp8 latent values
DS_ROPE_OFFSET = DS_SCALES_OFFSET + 4 * DS_TILES  # 528: after the float32 scales
DS_ROW_BYTES = DS_ROPE_OFFSET + 2 * ROPE_DIM  # 656
DS_ROPE_DTYPE = torch.bfloat16
# FlashMLA's floor on amax / 448 before rounding a scale up to a power of two (an all-zero tile gets 2^-13).
DS_MIN_SCALE_INV = 1e-4

_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8_ds_mla": "fp8_ds_mla",
}
_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_format(value, name: str = "kv_format") -> str:
    """The format ``value`` names: one of ``FORMATS`` or an alias (``bfloat16``, ``float16``, ``fp8``,
    ``float8_e4m3fn``, the dtypes torch.bfloat16 / float16 / float8_e4m3fn). ValueError naming ``name`` else."""
    if isinstance(value, torch.dtype):
        value = str(value).replace("torch.", "")
    key = value.lower() if isinstance(value, str) else None
    if key not in _ALIASES:
        raise ValueError(f"{name}: unknown KV cache format {value!r}; expected one of {', '.join(FORMATS)}")
    return _ALIASES[key]


def fp8_storage(value) -> tuple[torch.dtype, str] | None:
    """(storage dtype, format) when ``value`` names an FP8 cache format (a name or alias of ``resolve_format``,
    torch.float8_e4m3fn for fp8_e4m3, torch.uint8 for fp8_ds_mla's bytes); None for anything else (plain
    dtypes, unknown names: the caller's own checks name those)."""
    if value is torch.uint8:
        return torch.uint8, "fp8_ds_mla"
    if not isinstance(value, (str, torch.dtype)):
        return None
    try:
        fmt = resolve_format(value)
    except ValueError:
        return None
    return (storage(fmt)[0], fmt) if fmt in FP8_FORMATS else None


def format_of(storage_dtype: torch.dtype) -> str | None:
    """The FP8 format a cache of ``storage_dtype`` holds (float8_e4m3fn: fp8_e4m3, uint8: fp8_ds_mla); None
    for the float dtypes (values as stored)."""
    return {FP8_DTYPE: "fp8_e4m3", torch.uint8: "fp8_ds_mla"}.get(storage_dtype)


def is_fp8(fmt: str) -> bool:
    """Whether ``fmt`` (a name from ``FORMATS``) is one of the FP8 formats."""
    return fmt in FP8_FORMATS


def storage(fmt: str, kv_dim: int = ROW_DIM) -> tuple[torch.dtype, int]:
    """(element dtype, elements per row) of a cache of format ``fmt`` (from ``FORMATS``) for ``kv_dim`` columns:
    (bfloat16 | float16 | float8_e4m3fn, kv_dim), or (uint8, 656) for ``fp8_ds_mla`` (kv_dim must be 576)."""
    if fmt == "fp8_ds_mla":
        if kv_dim != ROW_DIM:
            raise ValueError(f"kv_dim: the fp8_ds_mla format holds {LATENT_DIM} latent + {ROPE_DIM} rope columns "
                             f"({ROW_DIM}), got {kv_dim}")
        return torch.uint8, DS_ROW_BYTES
    if fmt == "fp8_e4m3":
        return FP8_DTYPE, kv_dim
    if fmt in _PLAIN_DTYPES:
        return _PLAIN_DTYPES[fmt], kv_dim
    raise ValueError(f"kv_format: unknown KV cache format {fmt!r}; expected one of {', '.join(FORMATS)}")


def row_bytes(fmt: str, kv_dim: int = ROW_DIM) -> int:
    """Bytes of one cache row (one token of one layer): 1152 for bf16/fp16, 576 fp8_e4m3, 656 fp8_ds_mla."""
    dtype, width = storage(fmt, kv_dim)
    return width * dtype.itemsize


def fit_k_scale(rows: torch.Tensor) -> torch.Tensor:
    """The ``fp8_e4m3`` scale that maps the largest |value| of ``rows`` (float, any shape) to 448 over every
    column (latent and rope alike): float32 [1] on rows' device (1.0 for all-zero rows)."""
    _float_rows(rows, "rows")
    amax = rows.detach().abs().amax().to(torch.float32) if rows.numel() else torch.zeros((), device=rows.device)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).reshape(1)


def check_k_scale(k_scale, device: torch.device | None = None, name: str = "k_scale") -> torch.Tensor:
    """``k_scale`` as the kernels read it: a float32 tensor of one element (on ``device`` when given)."""
    if not isinstance(k_scale, torch.Tensor):
        raise TypeError(f"{name}: expected a float32 tensor of one element, got {type(k_scale).__name__}")
    if k_scale.dtype != torch.float32 or k_scale.numel() != 1:
        raise ValueError(f"{name}: expected a float32 tensor of one element, got {k_scale.dtype} of shape "
                         f"{tuple(k_scale.shape)}")
    if device is not None and k_scale.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {k_scale.device}")
    return k_scale


def _float_rows(rows, name: str) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(rows).__name__}")
    if not rows.is_floating_point() or rows.dtype in (FP8_DTYPE, torch.float8_e5m2):
        raise ValueError(f"{name}: expected float32/float64/bfloat16/float16 values, got {rows.dtype}")


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale to float8_e4m3fn, saturating at +-448 (NaN stays NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def ds_scales(latent: torch.Tensor) -> torch.Tensor:
    """FlashMLA's per-tile scales of latent rows [..., 512] (float): float32 [..., 4], powers of two.

    Exact: the power of two at or above max(amax / 448, 1e-4) is read off the float32 bits (exp2(ceil(log2 v))
    rounds log2 to an integer for v a few ulps above a power of two, and gives half the scale). NaN values
    do not count towards their tile's amax (they are stored as NaN; the rest of the tile as without them), as
    the fused CUDA store does."""
    mags = latent.abs().unflatten(-1, (DS_TILES, DS_TILE))
    amax = torch.where(mags.isnan(), 0.0, mags).amax(dim=-1).to(torch.float32)
    bits = (amax / FP8_MAX).clamp(min=DS_MIN_SCALE_INV).view(torch.int32)
    up = torch.where((bits & 0x007FFFFF) != 0, 0x00800000, 0).to(torch.int32)
    # amax = inf: bits 0x7F800000 with no mantissa, so the scale is inf and the tile's values NaN or 0.
    return ((bits & 0x7F800000) + up).view(torch.float32)


def quantize_latent(rows: torch.Tensor, format: str, *, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Latent cache rows in cache format ``format`` (``FORMATS``), as they are stored.

    rows: float (bf16/fp16/fp32/fp64) [..., D]. Returns, with the leading dims kept:
      bf16 / fp16: [..., D] of that dtype (a cast);
      fp8_e4m3: float8_e4m3fn [..., D] = rows / k_scale, saturating at +-448; k_scale (float32 [1]) required;
      fp8_ds_mla: uint8 [..., 656] (the module docstring's layout); D must be 576, no k_scale.
    Round-trip error bounds: the module docstring. ValueError / TypeError naming the argument for a bad
    format, width, dtype or a missing / superfluous scale.
    """
    fmt = resolve_format(format, "format")
    _float_rows(rows, "rows")
    if fmt == "fp8_e4m3":
        if k_scale is None:
            raise ValueError("k_scale: the fp8_e4m3 format needs the layer's scale (float32 [1]); "
                             "fit_k_scale(rows) gives one")
        scale = check_k_scale(k_scale, rows.device)
        return _to_fp8(rows.to(torch.float32) / scale)
    if k_scale is not None:
        raise ValueError(f"k_scale: only the fp8_e4m3 format takes a per-layer scale, not {fmt}")
    if fmt in _PLAIN_DTYPES:
        return rows.to(_PLAIN_DTYPES[fmt])
    if rows.shape[-1] != ROW_DIM:
        raise ValueError(f"rows: the fp8_ds_mla format stores {ROW_DIM} columns ({LATENT_DIM} latent + {ROPE_DIM} "
                         f"rope), got {rows.shape[-1]}")
    lead = rows.shape[:-1]
    latent = rows[..., :LATENT_DIM].to(torch.float32)
    scales = ds_scales(latent)
    fp8 = _to_fp8((latent.unflatten(-1, (DS_TILES, DS_TILE)) / scales.unsqueeze(-1)).flatten(-2))
    out = torch.empty(*lead, DS_ROW_BYTES, dtype=torch.uint8, device=rows.device)
    out[..., :DS_SCALES_OFFSET] = fp8.view(torch.uint8)
    out[..., DS_SCALES_OFFSET:DS_ROPE_OFFSET] = scales.contiguous().view(torch.uint8)
    out[..., DS_ROPE_OFFSET:] = rows[..., LATENT_DIM:].to(DS_ROPE_DTYPE).contiguous().view(torch.uint8)
    return out


def ds_bytes(data: torch.Tensor, name: str = "data") -> torch.Tensor:
    """``fp8_ds_mla`` rows [..., 656] of uint8 or float8_e4m3fn as uint8 (a view), checked."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(data).__name__}")
    if data.dtype not in (torch.uint8, FP8_DTYPE):
        raise ValueError(f"{name}: fp8_ds_mla rows are uint8 or float8_e4m3fn bytes, got {data.dtype}")
    if data.dim() < 1 or data.shape[-1] != DS_ROW_BYTES:
        raise ValueError(f"{name}: fp8_ds_mla rows are {DS_ROW_BYTES} bytes wide, got shape {tuple(data.shape)}")
    return data.view(torch.uint8)


def dequantize_latent(data: torch.Tensor, format: str, *, k_scale: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored cache rows back to values: ``dtype`` [..., D] (float32 by default; float64 is exact).

    data: as ``quantize_latent`` returns for ``format``: bf16 / fp16 [..., D]; fp8_e4m3 float8_e4m3fn [..., D]
    with its k_scale (float32 [1]); fp8_ds_mla uint8 or float8_e4m3fn [..., 656] (D = 576), no k_scale.
    The product fp8 x scale is formed in ``dtype`` (float32 or float64: exact for fp8_ds_mla's power-of-two
    scales). ValueError / TypeError naming the argument for a bad format, width, dtype or scale.
    """
    fmt = resolve_format(format, "format")
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data: expected a torch.Tensor, got {type(data).__name__}")
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected a float dtype, got {dtype}")
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    if fmt == "fp8_e4m3":
        if data.dtype != FP8_DTYPE:
            raise ValueError(f"data: fp8_e4m3 rows are float8_e4m3fn, got {data.dtype}")
        if k_scale is None:
            raise ValueError("k_scale: fp8_e4m3 rows need the layer's scale (float32 [1]) to be read")
        scale = check_k_scale(k_scale, data.device)
        return (data.to(cdt) * scale.to(cdt)).to(dtype)
    if k_scale is not None:
        raise ValueError(f"k_scale: only the fp8_e4m3 format takes a per-layer scale, not {fmt}")
    if fmt in _PLAIN_DTYPES:
        if data.dtype != _PLAIN_DTYPES[fmt]:
            raise ValueError(f"data: {fmt} rows are {_PLAIN_DTYPES[fmt]}, got {data.dtype}")
        return data.to(dtype)
    raw = ds_bytes(data)
    lead = raw.shape[:-1]
    # Byte fields reinterpreted: slices of a row are contiguous only per row, so copy them out first.
    fp8 = raw[..., :DS_SCALES_OFFSET].contiguous().view(FP8_DTYPE).to(cdt)
    scales = raw[..., DS_SCALES_OFFSET:DS_ROPE_OFFSET].contiguous().view(torch.float32).to(cdt)
    rope = raw[..., DS_ROPE_OFFSET:].contiguous().view(DS_ROPE_DTYPE).to(cdt)
    latent = (fp8.unflatten(-1, (DS_TILES, DS_TILE)) * scales.unsqueeze(-1)).reshape(*lead, LATENT_DIM)
    return torch.cat([latent, rope], dim=-1).to(dtype)
