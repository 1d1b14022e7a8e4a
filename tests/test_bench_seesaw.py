"""benchmarks/bench_seesaw.py off the GPU: its cell syntax, its errors, and that it restores the threshold."""

from __future__ import annotations

import pytest
import torch
from benchmark_script import load

from pagedmla.bench.decode import Cell
from pagedmla.kernels.triton.sm90 import seesaw


def test_cells_parse_and_bad_ones_name_the_option():
    bench = load("bench_seesaw")
    assert bench.parse_cells("128x1x128x4096, 8x2x16x1024") == [Cell(128, 1, 128, 4096), Cell(8, 2, 16, 1024)]
    assert len(bench.parse_cells(bench.DEFAULT_CELLS)) == 14
    for bad in ("128x1x128", "128x0x16x1024", "axbxcxd"):
        with pytest.raises(ValueError, match="--cells"):
            bench.parse_cells(bad)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--cells", "1x2"])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        load("bench_seesaw").main([])
    assert seesaw.SEESAW_MIN_ROWS == 128
