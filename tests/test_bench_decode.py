"""pagedmla.bench.decode off the GPU: the alternating best-of-rounds timing and a smoke run of the CPU grid."""

from __future__ import annotations

import argparse
import csv

from pagedmla.bench import decode
from pagedmla.bench.common import best_of_rounds
from pagedmla.bench.options import decode_arguments


def test_best_of_rounds_alternates_and_keeps_each_best():
    calls: list[str] = []
    figures = {"pm": iter([5.0, 3.0, 4.0]), "fm": iter([2.0, 6.0, 1.0])}

    def timer(name):
        def time() -> float:
            calls.append(name)
            return next(figures[name])
        return time

    assert best_of_rounds([timer("pm"), timer("fm")], 3) == [3.0, 1.0]
    assert calls == ["pm", "fm"] * 3
    assert best_of_rounds([lambda: 7.0], 0) == [7.0]  # at least one pass


def test_quick_cpu_grid_with_rounds(tmp_path):
    ap = argparse.ArgumentParser()
    decode_arguments(ap)
    out = tmp_path / "decode.csv"
    rows = decode.run(ap.parse_args(["--quick", "--rounds", "2", "--csv", str(out)]))
    assert len(rows) == 2
    for row in rows:
        assert float(row["pagedmla_us"]) > 0
        assert float(row["cos_diff_vs_torch"]) < 1e-5  # the torch reference provider joins every CPU run
    with out.open() as f:
        assert len(list(csv.DictReader(f))) == 2


def test_ratio_lines_give_each_groups_geometric_mean_and_lowest_cell():
    def row(b, q_len, heads, mean, ratio):
        return {"b": b, "q_len": q_len, "heads": heads, "mean_seq": mean, "ratio_flashmla": ratio}

    rows = [row(128, 1, 16, 1024, 0.8), row(128, 1, 128, 4096, 1.25), row(128, 2, 64, 1024, 1.0),
            row(1, 1, 128, 4096, 2.0), row(64, 4, 16, 4096, "")]  # the last cell not measured
    lines = decode.ratio_lines(rows, "ratio_flashmla", "eager calls")
    assert lines == [
        # (0.8 * 1.25 * 1.0 * 2.0) ** (1 / 4) = 2 ** 0.25
        "all cells, eager calls: geometric mean FlashMLA/pagedmla 1.189, min 0.800 (128x1x16x1024) over 4 cells",
        "batch-128 cells, eager calls: geometric mean FlashMLA/pagedmla 1.000, min 0.800 (128x1x16x1024) over 3 cells",
        "memory-bound cells (heads x q_len <= 32), eager calls: geometric mean FlashMLA/pagedmla 0.800, min 0.800 "
        "(128x1x16x1024) over 1 cells",
        "compute-bound batch-128 cells (heads x q_len >= 128), eager calls: geometric mean FlashMLA/pagedmla 1.118, "
        "min 1.000 (128x2x64x1024) over 2 cells",
    ]
    unmeasured = [dict(r, ratio_flashmla="") for r in rows]  # a CPU run: no FlashMLA, no line
    assert decode.ratio_lines(unmeasured, "ratio_flashmla", "eager calls") == []
