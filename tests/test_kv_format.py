"""The cache formats (``pagedmla.kv_format``): quantise / dequantise round trips within their documented bounds,
the ``fp8_ds_mla`` row checked byte field by byte field against FlashMLA's FP8 KV layout (decoded by hand in
``tests/oracle.py``), and the errors for bad widths, dtypes and scales."""

from __future__ import annotations

import pytest
import torch
from oracle import decode_e4m3, decode_fp8_rows, gen

import pagedmla
from pagedmla import kv_format as kf

F64 = torch.float64


def _rows(n: int, *key, rope_scale: float = 1.0) -> torch.Tensor:
    """n latent rows [n, 576] float32 whose 128-column tiles span magnitudes 2^-12 .. 2^8, one tile all zero."""
    g = gen("kv-format", n, *key)
    x = torch.randn(n, kf.ROW_DIM, generator=g, dtype=F64)
    mag = 2.0 ** torch.randint(-12, 9, (n, kf.DS_TILES), generator=g).to(F64)
    x[:, : kf.LATENT_DIM] *= mag.repeat_interleave(kf.DS_TILE, dim=1)
    x[:, kf.LATENT_DIM:] *= rope_scale
    x[0, : kf.DS_TILE] = 0.0
    return x.to(torch.float32)


def test_constants_describe_flashmla_row():
    assert (kf.LATENT_DIM, kf.ROPE_DIM, kf.ROW_DIM) == (512, 64, 576)
    assert (kf.DS_SCALES_OFFSET, kf.DS_ROPE_OFFSET, kf.DS_ROW_BYTES) == (512, 528, 656)
    assert kf.row_bytes("bf16") == 1152 and kf.row_bytes("fp8_e4m3") == 576 and kf.row_bytes("fp8_ds_mla") == 656


def test_oracle_e4m3_decoder_matches_torch():
    """The hand decoder the attention tests judge by agrees with torch's float8_e4m3fn on all 256 codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).to(F64)
    got = decode_e4m3(codes)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))


def test_ds_row_fields_byte_by_byte():
    rows = _rows(64, "fields")
    data = pagedmla.quantize_latent(rows, "fp8_ds_mla")
    assert data.dtype == torch.uint8 and tuple(data.shape) == (64, 656)
    x = rows.to(F64)
    # Bytes 512..527: four little-endian float32 scales, FlashMLA's: 2^ceil(log2(max(amax / 448, 1e-4))).
    decoded = decode_fp8_rows(data, "fp8_ds_mla")  # by hand; each field on its own below
    amax = x[:, :512].abs().unflatten(-1, (4, 128)).amax(-1)
    want = 2.0 ** torch.ceil(torch.log2(torch.clamp(amax / 448, min=1e-4)))
    raw = data.to(torch.int64)
    got_scales = torch.stack([sum(raw[:, 512 + 4 * t + i] << (8 * i) for i in range(4)) for t in range(4)], 1)
    want_bits = want.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got_scales, want_bits)
    assert want[0, 0] == 2.0 ** -13  # the all-zero tile
    # Bytes 0..511: fp8 codes of x / scale (round to nearest even, no saturation: |x| / scale <= 448).
    codes = (x[:, :512].unflatten(-1, (4, 128)) / want.unsqueeze(-1)).flatten(-2).to(torch.float32)
    assert torch.equal(data[:, :512], codes.to(torch.float8_e4m3fn).view(torch.uint8))
    assert (decode_e4m3(data[:, :512]).abs() <= 448).all()
    # Bytes 528..655: the 64 rope values as little-endian bfloat16.
    rope_bits = x[:, 512:].to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    got_rope = raw[:, 528::2] | (raw[:, 529::2] << 8)
    assert torch.equal(got_rope, rope_bits)
    assert torch.equal(decoded[:, 512:], x[:, 512:].to(torch.bfloat16).to(F64))


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_e4m3"])
def test_round_trip_within_documented_bound(fmt):
    """|x' - x| <= |x| / 16 + s / 1024 (s: the value's scale); fp8_ds_mla's rope is bfloat16-rounded."""
    rows = _rows(256, "bound", fmt)
    k_scale = kf.fit_k_scale(rows) if fmt == "fp8_e4m3" else None
    data = pagedmla.quantize_latent(rows, fmt, k_scale=k_scale)
    back = pagedmla.dequantize_latent(data, fmt, k_scale=k_scale, dtype=F64)
    x = rows.to(F64)
    assert torch.equal(back, decode_fp8_rows(data, fmt, None if k_scale is None else k_scale.item()))
    if fmt == "fp8_ds_mla":
        s = kf.ds_scales(rows[:, :512]).to(F64).repeat_interleave(128, dim=1)
        assert ((back[:, :512] - x[:, :512]).abs() <= x[:, :512].abs() / 16 + s / 1024).all()
        assert ((back[:, 512:] - x[:, 512:]).abs() <= x[:, 512:].abs() / 256).all()
    else:
        s = k_scale.to(F64)
        assert ((back - x).abs() <= x.abs() / 16 + s / 1024).all()
        assert (back.abs() <= 448 * s).all()
    # float32 dequantisation is the same numbers (exact for power-of-two scales, one rounding otherwise).
    f32 = pagedmla.dequantize_latent(data, fmt, k_scale=k_scale)
    assert f32.dtype == torch.float32 and torch.allclose(f32.to(F64), back, rtol=2 ** -23, atol=0)


def test_e4m3_saturates_instead_of_nan():
    """A value beyond 448 x k_scale reads back as +-448 x k_scale (torch's own cast would give NaN)."""
    rows = torch.tensor([[1000.0, -1000.0, 448.0, 1.0, float("nan")]])
    k = torch.ones(1)
    back = pagedmla.dequantize_latent(pagedmla.quantize_latent(rows, "fp8_e4m3", k_scale=k), "fp8_e4m3", k_scale=k)
    assert back[0, :4].tolist() == [448.0, -448.0, 448.0, 1.0] and back[0, 4].isnan()


def test_shared_scale_fitted_over_whole_row_keeps_rope():
    """The documented choice: k_scale fitted over all 576 columns saturates no rope value 64x the latent."""
    rows = _rows(128, "rope", rope_scale=64.0)
    rows[:, :512] = torch.randn(128, 512, generator=gen("rope-latent"))
    k = kf.fit_k_scale(rows)
    back = pagedmla.dequantize_latent(pagedmla.quantize_latent(rows, "fp8_e4m3", k_scale=k), "fp8_e4m3", k_scale=k)
    assert ((back - rows).abs() <= rows.abs() / 16 + k / 1024).all()


def test_ds_reads_float8_view_like_uint8():
    """FlashMLA's quantiser returns the 656 bytes typed float8_e4m3fn: the same rows."""
    data = pagedmla.quantize_latent(_rows(8, "view"), "fp8_ds_mla")
    assert torch.equal(pagedmla.dequantize_latent(data.view(torch.float8_e4m3fn), "fp8_ds_mla"),
                       pagedmla.dequantize_latent(data, "fp8_ds_mla"))


def test_plain_formats_cast():
    rows = _rows(4, "plain")
    for fmt, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        data = pagedmla.quantize_latent(rows, fmt)
        assert data.dtype == dt and torch.equal(pagedmla.dequantize_latent(data, fmt), data.float())


def test_resolve_format_aliases():
    assert kf.resolve_format("fp8") == "fp8_e4m3" and kf.resolve_format(torch.float8_e4m3fn) == "fp8_e4m3"
    assert kf.resolve_format(torch.bfloat16) == "bf16" and kf.resolve_format("FP8_DS_MLA") == "fp8_ds_mla"


BAD_QUANTIZE = [
    (dict(rows=torch.zeros(2, 575), format="fp8_ds_mla"), ValueError, "rows: .*576"),
    (dict(rows=torch.zeros(2, 576, dtype=torch.int32), format="fp8_ds_mla"), ValueError, "rows: .*float"),
    (dict(rows=torch.zeros(2, 576).to(torch.float8_e4m3fn), format="fp8_ds_mla"), ValueError, "rows"),
    (dict(rows=[1.0], format="bf16"), TypeError, "rows"),
    (dict(rows=torch.zeros(2, 576), format="fp8_e4m3"), ValueError, "k_scale: .*needs"),
    (dict(rows=torch.zeros(2, 576), format="fp8_e4m3", k_scale=1.0), TypeError, "k_scale"),
    (dict(rows=torch.zeros(2, 576), format="fp8_e4m3", k_scale=torch.ones(2)), ValueError, "k_scale: .*one element"),
    (dict(rows=torch.zeros(2, 576), format="fp8_e4m3", k_scale=torch.ones(1, dtype=torch.float64)), ValueError,
     "k_scale"),
    (dict(rows=torch.zeros(2, 576), format="fp8_ds_mla", k_scale=torch.ones(1)), ValueError, "k_scale: only"),
    (dict(rows=torch.zeros(2, 576), format="int8"), ValueError, "format: unknown"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_QUANTIZE)
def test_quantize_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pagedmla.quantize_latent(**kwargs)


BAD_DEQUANTIZE = [
    (dict(data=torch.zeros(2, 655, dtype=torch.uint8), format="fp8_ds_mla"), ValueError, "data: .*656"),
    (dict(data=torch.zeros(2, 656, dtype=torch.float16), format="fp8_ds_mla"), ValueError, "data: .*uint8"),
    (dict(data=torch.zeros(2, 576, dtype=torch.uint8), format="fp8_e4m3", k_scale=torch.ones(1)), ValueError,
     "data: .*float8"),
    (dict(data=torch.zeros(2, 576).to(torch.float8_e4m3fn), format="fp8_e4m3"), ValueError, "k_scale"),
    (dict(data=torch.zeros(2, 576, dtype=torch.uint8), format="bf16"), ValueError, "data"),
    (dict(data=torch.zeros(2, 656, dtype=torch.uint8), format="fp8_ds_mla", dtype=torch.int32), ValueError, "dtype"),
    (dict(data=None, format="fp8_ds_mla"), TypeError, "data"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_DEQUANTIZE)
def test_dequantize_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pagedmla.dequantize_latent(**kwargs)
