"""benchmarks/bench_varlen_forms.py off the GPU: its cell syntax, its errors, the numbering it forces."""

from __future__ import annotations

import pytest
import torch
from benchmark_script import load

from pagedmla.kernels.triton.sm90 import varlen as sv


def test_cells_parse_and_bad_ones_name_the_option():
    bench = load("bench_varlen_forms")
    assert bench.parse_cell("4x512x16") == ([512] * 4, 16)
    assert bench.parse_cell("1x4096+63x64x128") == ([4096] + [64] * 63, 128)
    for cell in bench.DEFAULT_CELLS.split(","):
        bench.parse_cell(cell)
    for bad in ("4x512", "2x4096+3x64x16", "0x512x16", "axbxc", "1x4096+63x0x16"):
        with pytest.raises(ValueError, match="--cells"):
            bench.parse_cell(bad)
    for argv in (["--cells", "4x512"], ["--forms", "cta,tiles"], ["--numberings", "exact"], ["--tail-windows", "32,x"],
                 ["--tail-windows", "-1"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2


def test_forced_numberings_count_the_kernels_tiles():
    """The forced plans give the launcher's two tile counts (``varlen_sm90_plan``'s formulas), whichever
    it would have picked."""
    bench = load("bench_varlen_forms")
    skewed = (4096, 4096 + 63 * 64, 128, 64)
    assert bench.plan_forcing("padded")(*skewed) == (32 * 128 * 64, False)
    assert bench.plan_forcing("per_seq")(*skewed) == sv.varlen_sm90_plan(*skewed)
    equal = (1024, 16 * 1024, 128, 16)
    assert bench.plan_forcing("padded")(*equal) == sv.varlen_sm90_plan(*equal)
    assert bench.plan_forcing("per_seq")(*equal) == ((16 * 1024 // 128 + 16) * 128, True)
    assert bench.plan_forcing("auto") is sv.varlen_sm90_plan
    assert bench.variant_key("auto", "padded", None) == "auto_padded"
    assert bench.variant_key("cta", "auto", 0) == "cta_auto_w0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="no CUDA device"):
        load("bench_varlen_forms").main([])
    assert sv.CTA_SEQLEN == (128, 1536)
