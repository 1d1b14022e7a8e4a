"""The Hopper ragged kernel's choices taken apart: consumer forms, tile numberings and tile orders, forced.

``sm90/varlen.py`` picks its consumer form by ``max_seqlen_q`` (``CTA_SEQLEN``: one 8-warp partition or a
partition per warpgroup), its tile numbering by how many padded tiles would be empty (``varlen_sm90_plan``:
padded or per-sequence) and, for the padded numbering, the order its tiles are claimed in by the bytes of K/V
the last window of heads may hold (``TAIL_WINDOW_BYTES``). This script times every combination asked for on
equal-length and skewed causal 192/128 batches, each as a CUDA graph of one ``varlen_sm90`` call (no host
time: the launcher builds its descriptors per call), ``do_bench`` medians with L2 flushed, and checks that
every combination returned the same bits as the first. The measurements behind ``CTA_SEQLEN``, the
per-sequence numbering's fields (benchmarks/NOTES.md, Prefill v14) and the windows (Prefill v15) came from
it or from scratch versions of it.

    python3 benchmarks/bench_varlen_forms.py [--cells 512x64x128,1x4096+63x64x128,...] [--forms cta,wg,auto]
        [--numberings padded,per_seq,auto] [--tail-windows 0,32] [--rounds 2] [--csv out.csv]

``auto`` is the shipped choice; ``--tail-windows`` takes MiB (0: one (sequence, head) pair at a time to the end, the
order before the window); each variant's time is the best of ``--rounds`` rounds over all variants.

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
FORMS = {"cta": (-1, 2 ** 31), "wg": (0, -1), "auto": sv.CTA_SEQLEN}  # CTA_SEQLEN ranges that force each form


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
    """``varlen_sm90_plan`` with the numbering fixed: ``padded`` or ``per_seq`` (``auto``: the shipped plan)."""
    if numbering == "auto":
        return sv.varlen_sm90_plan

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


def variant_key(form: str, numbering: str, window: int | None) -> str:
    """A variant's column prefix: ``form_numbering`` and, when windows are compared, ``_w<MiB>``."""
    return f"{form}_{numbering}" + ("" if window is None else f"_w{window}")


def time_cell(cell: str, lens: list[int], heads: int, forms: list[str], numberings: list[str],
              windows: list[int | None], rounds: int) -> dict:
    """One cell's row: each variant's best graph time over ``rounds`` and whether it returned the first
    variant's bits."""
    t = sum(lens)
    q, k = ((torch.randn(2, t, heads, 192, device="cuda") / 10).clamp_(-1, 1)).bfloat16()
    v = ((torch.randn(t, heads, 128, device="cuda") / 10).clamp_(-1, 1)).bfloat16()
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    out = torch.empty(t, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(t, heads, device="cuda", dtype=torch.float32)
    row, first = {"cell": cell}, None
    saved = sv.CTA_SEQLEN, sv.varlen_sm90_plan, sv.TAIL_WINDOW_BYTES
    try:
        for _ in range(rounds):
            for form in forms:
                for numbering in numberings:
                    for window in windows:
                        key = variant_key(form, numbering, window)
                        sv.CTA_SEQLEN, sv.varlen_sm90_plan = FORMS[form], plan_forcing(numbering)
                        sv.TAIL_WINDOW_BYTES = saved[2] if window is None else window << 20
                        out.fill_(float("nan"))
                        us = graph_us(lambda: sv.varlen_sm90(q, k, v, cu, cu, max(lens), 192 ** -0.5, True, out, lse))
                        row[f"{key}_us"] = min(us, row.get(f"{key}_us", us))
                        if first is None:
                            first = out.clone(), lse.clone()
                        same = torch.equal(out, first[0]) and torch.equal(lse, first[1])
                        row[f"{key}_same"] = same and row.get(f"{key}_same", True)
    finally:
        sv.CTA_SEQLEN, sv.varlen_sm90_plan, sv.TAIL_WINDOW_BYTES = saved
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="comma-separated BxLxH or 1xL+NxSxH cells")
    ap.add_argument("--forms", default="cta,wg", help="consumer forms to time: cta (one partition), wg, auto")
    ap.add_argument("--numberings", default="padded,per_seq",
                    help="tile numberings to time: padded, per_seq, auto")
    ap.add_argument("--tail-windows", metavar="MIB,...",
                    help="padded tile orders to time: TAIL_WINDOW_BYTES in MiB (default: the shipped one only)")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, keep the best")
    ap.add_argument("--csv", metavar="PATH", help="write every cell's figures to PATH")
    args = ap.parse_args(argv)
    forms, numberings = args.forms.split(","), args.numberings.split(",")
    try:
        cells = [(cell.strip(), parse_cell(cell)) for cell in args.cells.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if not set(forms) <= set(FORMS) or not set(numberings) <= {"padded", "per_seq", "auto"}:
        ap.error(f"--forms takes {', '.join(FORMS)}, --numberings padded, per_seq, auto; got {args.forms!r} / "
                 f"{args.numberings!r}")
    try:
        windows = [None] if args.tail_windows is None else [int(w) for w in args.tail_windows.split(",")]
    except ValueError:
        windows = [-1]
    if any(w is not None and w < 0 for w in windows) or args.rounds < 1:
        ap.error(f"--tail-windows takes MiB counts >= 0 and --rounds a count >= 1; got {args.tail_windows!r} / "
                 f"{args.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_varlen_forms.py times the Hopper ragged kernel: no CUDA device here")
    qk = torch.empty(1, 1, 192, device="cuda", dtype=torch.bfloat16)
    if not sv.varlen_sm90_supported(qk, qk, qk[..., :128]):
        sys.exit("bench_varlen_forms.py times the Hopper ragged kernel: it needs an sm_90 GPU and Triton's Gluon")
    rows = []
    for cell, (lens, heads) in cells:
        row = time_cell(cell, lens, heads, forms, numberings, windows, args.rounds)
        rows.append(row)
        keys = [variant_key(f, n, w) for f in forms for n in numberings for w in windows]
        times = "  ".join(f"{key} {row[f'{key}_us']:8.1f}" for key in keys)
        same = all(row[f"{key}_same"] for key in keys)
        print(f"{cell:<22} {times}  same bits: {same}", flush=True)
        torch.cuda.empty_cache()
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
