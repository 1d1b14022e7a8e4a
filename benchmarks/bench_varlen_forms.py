"""The Hopper ragged kernel's choices taken apart: both consumer forms and both tile numberings, forced.

``sm90/varlen.py`` picks its consumer form by ``max_seqlen_q`` (``CTA_SEQLEN``: one 8-warp partition or a
partition per warpgroup) and its tile numbering by how many padded tiles would be empty
(``varlen_sm90_plan``: padded or per-sequence). This script times every combination asked for on equal-length
and skewed causal 192/128 batches, each as a CUDA graph of one ``varlen_sm90`` call (no host time: the
launcher builds its descriptors per call), ``do_bench`` medians with L2 flushed, and checks that every
combination returned the same bits as the first. The measurements behind ``CTA_SEQLEN`` and the
per-sequence numbering's fields (benchmarks/NOTES.md, Prefill v14) came from scratch versions of it.

    python3 benchmarks/bench_varlen_forms.py [--cells 512x64x128,1x4096+63x64x128,...] [--csv out.csv]

A cell is ``BxLxH`` (B prompts of L tokens, H heads) or ``1xL+NxSxH`` (one prompt of L tokens and N of S).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from pagedmla.bench.common import write_csv
from pagedmla.kernels.triton.sm90 import varlen as sv

DEFAULT_CELLS = ("512x64x128,256x128x128,128x256x128,96x384x128,64x512x128,512x64x16,256x128x16,128x256x16,"
                 "1x4096x128,1x4096+63x64x128,1x16384x16,1x16384+127x128x16")
FORMS = {"cta": (-1, 2 ** 31), "wg": (0, -1)}  # CTA_SEQLEN ranges that force each form


def parse_cell(cell: str) -> tuple[list[int], int]:
    """(prompt lengths, heads) of a cell name; a ValueError naming ``--cells`` for anything else."""
    try:
        *shape, heads = cell.strip().split("x")
        if "+" in cell:  # 1xL+NxSxH
            long_part, short_part = "x".join(shape).split("+")
            one, long = map(int, long_part.split("x"))
            n, short = map(int, short_part.split("x"))
            lens = [long] + [short] * n if one == 1 else []
        else:
            b, n = map(int, shape)
            lens = [n] * b
        heads = int(heads)
    except ValueError:
        lens, heads = [], 0
    if not lens or min(lens) < 1 or heads < 1:
        raise ValueError(f"--cells: {cell!r} is not BxLxH or 1xL+NxSxH with positive sizes")
    return lens, heads


def plan_forcing(numbering: str):
    """``varlen_sm90_plan`` with the numbering fixed: ``padded`` or ``per_seq``."""
    def plan(max_seqlen_q: int, total_q: int, heads: int, batch: int) -> tuple[int, bool]:
        padded, per_sequence = sv.tile_counts(max_seqlen_q, total_q, heads, batch)
        return (padded, False) if numbering == "padded" else (per_sequence, True)
    return plan


def graph_us(fn) -> float:
    """do_bench median (µs) of a CUDA graph of one fn() call, captured after a warm-up on a side stream."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def time_cell(cell: str, lens: list[int], heads: int, forms: list[str], numberings: list[str]) -> dict:
    """One cell's row: each form x numbering's graph time and whether it returned the first one's bits."""
    t = sum(lens)
    q, k = ((torch.randn(2, t, heads, 192, device="cuda") / 10).clamp_(-1, 1)).bfloat16()
    v = ((torch.randn(t, heads, 128, device="cuda") / 10).clamp_(-1, 1)).bfloat16()
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    out = torch.empty(t, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(t, heads, device="cuda", dtype=torch.float32)
    row, first = {"cell": cell}, None
    saved = sv.CTA_SEQLEN, sv.varlen_sm90_plan
    try:
        for form in forms:
            for numbering in numberings:
                sv.CTA_SEQLEN, sv.varlen_sm90_plan = FORMS[form], plan_forcing(numbering)
                out.fill_(float("nan"))
                row[f"{form}_{numbering}_us"] = graph_us(
                    lambda: sv.varlen_sm90(q, k, v, cu, cu, max(lens), 192 ** -0.5, True, out, lse))
                if first is None:
                    first = out.clone(), lse.clone()
                row[f"{form}_{numbering}_same"] = torch.equal(out, first[0]) and torch.equal(lse, first[1])
    finally:
        sv.CTA_SEQLEN, sv.varlen_sm90_plan = saved
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="comma-separated BxLxH or 1xL+NxSxH cells")
    ap.add_argument("--forms", default="cta,wg", help="consumer forms to time: cta (one partition), wg")
    ap.add_argument("--numberings", default="padded,per_seq", help="tile numberings to time: padded, per_seq")
    ap.add_argument("--csv", metavar="PATH", help="write every cell's figures to PATH")
    args = ap.parse_args(argv)
    forms, numberings = args.forms.split(","), args.numberings.split(",")
    try:
        cells = [(cell.strip(), parse_cell(cell)) for cell in args.cells.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if not set(forms) <= set(FORMS) or not set(numberings) <= {"padded", "per_seq"}:
        ap.error(f"--forms takes {', '.join(FORMS)}, --numberings padded, per_seq; got {args.forms!r} / "
                 f"{args.numberings!r}")
    if not torch.cuda.is_available():
        sys.exit("bench_varlen_forms.py times the Hopper ragged kernel: no CUDA device here")
    qk = torch.empty(1, 1, 192, device="cuda", dtype=torch.bfloat16)
    if not sv.varlen_sm90_supported(qk, qk, qk[..., :128]):
        sys.exit("bench_varlen_forms.py times the Hopper ragged kernel: it needs an sm_90 GPU and Triton's Gluon")
    rows = []
    for cell, (lens, heads) in cells:
        row = time_cell(cell, lens, heads, forms, numberings)
        rows.append(row)
        times = "  ".join(f"{f}/{n} {row[f'{f}_{n}_us']:8.1f}" for f in forms for n in numberings)
        same = all(row[f"{f}_{n}_same"] for f in forms for n in numberings)
        print(f"{cell:<22} {times}  same bits: {same}", flush=True)
        torch.cuda.empty_cache()
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
