"""pagedmla.bench.decode off the GPU: the alternating best-of-rounds timing and a smoke run of the CPU grid."""

from __future__ import annotations

import argparse
import csv

from pagedmla.bench import decode
from pagedmla.bench.options import decode_arguments


def test_best_of_rounds_alternates_and_keeps_each_best():
    calls: list[str] = []
    figures = {"pm": iter([5.0, 3.0, 4.0]), "fm": iter([2.0, 6.0, 1.0])}

    def timer(name):
        def time() -> float:
            calls.append(name)
            return next(figures[name])
        return time

    assert decode.best_of_rounds([timer("pm"), timer("fm")], 3) == [3.0, 1.0]
    assert calls == ["pm", "fm"] * 3
    assert decode.best_of_rounds([lambda: 7.0], 0) == [7.0]  # at least one pass


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
