"""The two Hopper decode main kernels beside FlashMLA, same process, same inputs, eager and as CUDA graphs.

``sm90/decode.py``'s kernel (one warpgroup computes every S and softmax) and ``sm90/seesaw.py``'s (each
warpgroup the S and softmax of every other tile) are chosen by the decode plan at
``seesaw.SEESAW_MIN_ROWS`` query rows per request; this script times the public call with the threshold
set so that every Hopper cell runs one kernel, then the other, and FlashMLA (``sgl-flash-mla``, legacy
sm90) on the same inputs (``pagedmla.bench.decode``'s inputs, ``do_bench`` medians with L2 flushed; graphs
of 16 calls over rotated input copies). Columns: µs per call, the seesaw / one-softmax speedup as graphs,
the seesaw kernel's TFLOP/s as graphs, FlashMLA / seesaw ratios (above 1: pagedmla faster) and the cosine
difference between the two kernels' outputs.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_seesaw.py [--cells 128x1x128x4096,...] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch

from pagedmla.bench.decode import Cell, Inputs, bench, bench_graph, cos_diff, flashmla_fn, pagedmla_fn
from pagedmla.kernels.triton import decode
from pagedmla.kernels.triton.sm90 import seesaw

DEFAULT_CELLS = ("128x1x128x1024,128x1x128x4096,128x1x128x8192,128x2x128x1024,128x2x128x4096,128x2x64x1024,"
                 "128x2x64x4096,128x1x64x4096,128x1x32x4096,128x1x32x1024,1x1x128x4096,8x1x128x4096,"
                 "64x4x16x4096,128x2x16x4096")
HEADER = ["cell", "flashmla_us", "one_softmax_us", "seesaw_us", "flashmla_graph_us", "one_softmax_graph_us",
          "seesaw_graph_us", "speedup_graph", "seesaw_graph_TFLOPs", "ratio_flashmla_eager",
          "ratio_flashmla_graph", "cos_diff"]


def parse_cells(spec: str) -> list[Cell]:
    """``b x q_len x heads x mean_seq`` cells, comma separated."""
    cells = []
    for item in spec.split(","):
        parts = item.strip().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--cells: {item!r} is not b x q_len x heads x mean_seq (positive integers)")
        cells.append(Cell(*map(int, parts)))
    return cells


def kernel_times(inp: Inputs, min_rows: int) -> tuple[float, float, torch.Tensor]:
    """(eager µs, graph µs, output on copy 0) of the public call with the seesaw threshold at ``min_rows``."""
    seesaw.SEESAW_MIN_ROWS = min_rows
    decode._PLANS.clear()  # the plans keep the kernel they bound
    timed, first, call = pagedmla_fn(inp)
    out = first()[0].float()
    return bench(timed), bench_graph(call, len(inp.q)), out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="b x q_len x heads x mean_seq, comma separated")
    ap.add_argument("--csv", metavar="PATH", help="write the rows to PATH")
    args = ap.parse_args(argv)
    try:
        cells = parse_cells(args.cells)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        sys.exit("bench_seesaw: needs a CUDA GPU (the Hopper kernels run on sm_90)")
    shipped = seesaw.SEESAW_MIN_ROWS
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(" | ".join(HEADER))
    try:
        for c in cells:
            inp = Inputs(c, 0, l2)
            fm = flashmla_fn(inp)
            old, old_g, old_out = kernel_times(inp, 1 << 30)
            new, new_g, new_out = kernel_times(inp, 0)
            fm_t, fm_g = (bench(fm[0]), bench_graph(fm[2], len(inp.q))) if fm else (float("nan"), float("nan"))
            row = [f"{c.b}x{c.q_len}x{c.heads}x{c.mean}", fm_t, old, new, fm_g, old_g, new_g, old_g / new_g,
                   inp.flops / new_g / 1e6, fm_t / new, fm_g / new_g, cos_diff(new_out, old_out)]
            rows.append(row)
            print(" | ".join(x if isinstance(x, str) else f"{x:.4g}" for x in row), flush=True)
    finally:
        seesaw.SEESAW_MIN_ROWS = shipped
        decode._PLANS.clear()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.writer(f).writerows([HEADER, *rows])


if __name__ == "__main__":
    main()
