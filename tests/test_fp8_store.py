"""The fused FP8 store (``kernels/triton/rows.store_fp8_rows``, what ``MLAKVCache.store`` runs on CUDA):
byte for byte ``kv_format.quantize_latent`` for both FP8 formats and every float input dtype, on rows that
reach the formats' edges (saturation, subnormals, all-zero tiles, amax / 448 exactly a power of two), bad
slots dropped and reported with nothing outside the buffers touched; under the interpreter on the CPU, on
the device on CUDA."""

from __future__ import annotations

import pytest
import torch
from bounds import checked_accesses, guarded, margins_intact
from oracle import gen

from pagedmla import errors
from pagedmla import kv_format as kf
from pagedmla.cache import MLAKVCache
from pagedmla.kernels.triton.rows import store_fp8_rows

FORMATS = ["fp8_e4m3", "fp8_ds_mla"]


def _edge_rows(n: int, seed: str, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """n rows of 576 values, random in magnitude per 128-column tile (1e-6 .. 1e3) with the edges mixed in:
    an all-zero tile, a tile whose amax / 448 is exactly a power of two, values far past 448 x k_scale and
    far below the subnormal step."""
    g = gen(seed)
    magnitude = torch.exp(torch.empty(n, 5).uniform_(-14, 7, generator=g))
    rows = torch.randn(n, 576, generator=g) * magnitude.repeat_interleave(torch.tensor([128, 128, 128, 128, 64]), dim=1)
    rows[0, :128] = 0.0
    rows[1, 128:256] = torch.linspace(-1, 1, 128) * 448 * 2.0 ** -3  # amax / 448 = 2^-3 exactly
    rows[2, 256:260] = torch.tensor([1e6, -1e6, 1e-12, -1e-12])
    # amax / 448 one ulp above 2^-10 (float32 rows only): its scale is 2^-9 (log2 would round it to -10).
    rows[3, 384:512] = torch.linspace(-1, 1, 128) * 448 * 2.0 ** -10
    rows[3, 511] = 448 * 2.0 ** -10 * (1 + 2.0 ** -23)
    return rows.to(dtype).to(device)


def _k_scale(rows: torch.Tensor) -> torch.Tensor:
    """Fitted to all but the outliers of row 2, so those saturate."""
    return kf.fit_k_scale(rows[3:].float())


def _check_store(fmt: str, dtype: torch.dtype, device: str) -> None:
    rows = _edge_rows(37, f"store {fmt} {dtype}", dtype, device)
    k_scale = _k_scale(rows) if fmt == "fp8_e4m3" else None
    width = kf.row_bytes(fmt)
    num_slots = 50
    buf = guarded(torch.randint(0, 256, (num_slots, width), dtype=torch.uint8, generator=gen("bytes")).to(device),
                  sentinel=91)
    slots = torch.randperm(num_slots, generator=gen("slots"))[:37].to(torch.int64)
    slots[[5, 11, 30]] = torch.tensor([-1, num_slots, 10 ** 9])
    slots = slots.to(device)
    want = buf.clone()
    ok = (slots >= 0) & (slots < num_slots)
    want[slots[ok]] = kf.quantize_latent(rows[ok], fmt, k_scale=k_scale).view(torch.uint8)
    errors.device_errors(device)
    with checked_accesses() as log:
        store_fp8_rows(buf, slots, rows, fmt, k_scale)
    assert not log.violations, log.violations
    assert margins_intact(buf)
    diff = (buf != want).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at (slot, byte) {diff[:4].tolist()}"
    assert errors.device_errors(device) == errors.CACHE_SLOT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_writes_quantize_latent_bytes(fmt, dtype, monkeypatch):
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "shapes")
    _check_store(fmt, dtype, "cpu")


def test_ds_scale_is_exact_just_above_a_power_of_two():
    """quantize_latent's scales are read off the bits: amax / 448 one ulp above 2^-10 gets 2^-9."""
    tile = torch.linspace(-1, 1, 128) * 448 * 2.0 ** -10
    tile[-1] = 448 * 2.0 ** -10 * (1 + 2.0 ** -23)
    assert kf.ds_scales(tile.repeat(4).unsqueeze(0)).tolist() == [[2.0 ** -9] * 4]


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_values_stay_nan_and_leave_their_tile_alone(fmt):
    """A NaN value is stored as NaN (never clamped to +-448) by the kernel and quantize_latent alike; the other
    values of its row (fp8_ds_mla: of its 128-column tile, whose scale ignores it) are stored as without it."""
    rows = _edge_rows(4, f"nan {fmt}", torch.float32)
    rows[0, 3] = float("nan")
    rows[1, 536] = float("nan")  # a rope column
    k = _k_scale(rows) if fmt == "fp8_e4m3" else None
    buf = torch.zeros(4, kf.row_bytes(fmt), dtype=torch.uint8)
    store_fp8_rows(buf, torch.arange(4), rows, fmt, k)
    want = kf.quantize_latent(rows, fmt, k_scale=k).view(torch.uint8)
    for data in (buf, want):
        back = kf.dequantize_latent(data.view(kf.FP8_DTYPE) if fmt == "fp8_e4m3" else data, fmt, k_scale=k)
        assert back[0, 3].isnan() and back[1, 536].isnan()
        assert torch.isfinite(back[0, :3]).all() and torch.isfinite(back[0, 4:]).all()
    # The NaNs' own codes may differ (torch's bfloat16 NaN is 0xFFFF on the CPU): every other byte is equal.
    same = buf == want
    same[0, 3] = True
    if fmt == "fp8_ds_mla":
        same[1, kf.DS_ROPE_OFFSET + 2 * 24: kf.DS_ROPE_OFFSET + 2 * 25] = True  # rope column 536 = rope 24
    else:
        same[1, 536] = True
    assert same.all(), same.logical_not().nonzero().tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_writes_quantize_latent_bytes_on_cuda(fmt, dtype):
    _check_store(fmt, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_store_on_cuda_matches_the_cpu_path(fmt):
    """MLAKVCache.store quantises in the fused kernel on CUDA and with torch ops on the CPU: same bytes."""
    rows = _edge_rows(64, f"cache {fmt}", torch.bfloat16)
    slots = torch.randperm(4 * 32, generator=gen("cache slots"))[:64].to(torch.int64)
    caches = {}
    for device in ("cpu", "cuda"):
        cache = MLAKVCache(2, 4, 32, 576, dtype=fmt, device=device)
        cache.buffers[1].view(torch.uint8).fill_(77)  # the slots not stored to must stay as they were
        if fmt == "fp8_e4m3":
            cache.k_scale(1).fill_(0.37)
        cache.store(1, slots.to(device), rows.to(device))
        caches[device] = cache.buffers[1].view(torch.uint8).cpu()
    assert torch.equal(caches["cpu"], caches["cuda"])
