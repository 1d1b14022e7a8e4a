"""This checkout's public calls against another checkout's, in one process, on the decode and prefill grids.

A refactor that should not change speed (or a kernel change that should) is judged by timing both versions
in the same process on the same inputs, alternating, so that clocks, the driver and the other tenants of the
machine affect both alike. The other checkout's ``pagedmla/`` is copied to a temporary folder as the package
``pagedmla_other`` (every ``pagedmla`` name in its source rewritten, its ``torch.library`` namespace
included), and both are imported side by side.

Cells: ``pagedmla.bench.decode.grid`` (decode, ``flash_mla_with_kvcache`` after ``get_mla_metadata``, eager, as
a user calls it) and ``pagedmla.bench.prefill``'s ragged (``flash_attn_varlen_func``, causal 192/128) and paged
(``flash_mla_varlen_with_kvcache``, causal 576/512) grids. Each version is timed ``--rounds`` times per cell,
alternating (``triton.testing.do_bench`` median, L2 flushed); the table gives each version's best median,
the ratio other / this (above 1: this checkout is faster) and the spread of each version's rounds (the
noise the ratio should be read against). ``same`` says whether both versions returned bit-identical outputs.

    git archive REV pagedmla | tar -x -C /tmp/rev     # the other checkout (a directory holding pagedmla/)
    python3 benchmarks/bench_ab.py --other /tmp/rev [--quick] [--rounds 2] [--only decode|ragged|paged] [--csv F]
"""

from __future__ import annotations

import argparse
import csv
import importlib
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import triton

import pagedmla
from pagedmla.bench import decode as bdecode
from pagedmla.bench import prefill as bprefill

OTHER = "pagedmla_other"


def import_other(checkout: Path, into: Path) -> ModuleType:
    """``checkout``/pagedmla imported as ``pagedmla_other`` (a rewritten copy under ``into``)."""
    src = checkout / "pagedmla"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--other: {checkout} holds no pagedmla/ package")
    dst = into / OTHER
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    word = re.compile(r"\bpagedmla\b")
    for path in dst.rglob("*.py"):
        path.write_text(word.sub(OTHER, path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module(OTHER)


def timed(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


Bind = Callable[[ModuleType], Callable[[], torch.Tensor]]
Cells = list[tuple[str, Callable[[], Bind]]]


def decode_cells(quick: bool) -> Cells:
    """(name, setup) per cell: setup() makes the inputs once and returns bind(lib), lib's timed call."""
    cells = []
    for cell in bdecode.grid(quick):
        def setup(cell=cell) -> Bind:
            inp = bdecode.Inputs(cell, seed=0, l2_bytes=0)  # one copy: do_bench flushes L2 between calls

            def bind(lib: ModuleType) -> Callable[[], torch.Tensor]:
                meta, splits = lib.get_mla_metadata(inp.seqlens, cell.q_len * cell.heads, 1)
                return lambda: lib.flash_mla_with_kvcache(inp.q[0], inp.cache[0], inp.table, inp.seqlens,
                                                          bdecode.DV, meta, splits, causal=True)[0]
            return bind
        cells.append((f"decode b{cell.b} q{cell.q_len} h{cell.heads} s{cell.mean}", setup))
    return cells


def ragged_cells(quick: bool) -> Cells:
    cells = []
    for b, seqlen, h in bprefill.RAGGED_GRID[:3] if quick else bprefill.RAGGED_GRID:
        def setup(b=b, seqlen=seqlen, h=h) -> Bind:
            t = b * seqlen
            q, k, v = bprefill.rnd(t, h, 192), bprefill.rnd(t, h, 192), bprefill.rnd(t, h, 128)
            cu = torch.arange(0, t + 1, seqlen, device="cuda", dtype=torch.int32)
            return lambda lib: lambda: lib.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, 192 ** -0.5, True)
        cells.append((f"ragged {b}x{seqlen} h{h}", setup))
    return cells


def paged_cells(quick: bool) -> Cells:
    cells = []
    for b, new, cached, h in bprefill.PAGED_GRID[:2] if quick else bprefill.PAGED_GRID:
        def setup(b=b, new=new, cached=cached, h=h) -> Bind:
            pages_per = triton.cdiv(new + cached, bprefill.PAGE)
            num_pages = b * pages_per + 1
            cache = bprefill.rnd(num_pages, bprefill.PAGE, 1, 576)
            table = (torch.randperm(num_pages - 1, device="cuda")[: b * pages_per] + 1).int().view(b, pages_per)
            lens = torch.full((b,), new + cached, device="cuda", dtype=torch.int32)
            qo = torch.arange(0, b * new + 1, new, device="cuda", dtype=torch.int32)
            q = bprefill.rnd(b * new, h, 576)
            return lambda lib: lambda: lib.flash_mla_varlen_with_kvcache(
                q, cache, table, lens, qo, 512, softmax_scale=192 ** -0.5, causal=True, max_q_len=new)[0]
        cells.append((f"paged {b}x{new} over {cached} h{h}", setup))
    return cells


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, required=True, help="a directory holding the other pagedmla/ package")
    ap.add_argument("--quick", action="store_true", help="a few cells of each grid")
    ap.add_argument("--rounds", type=int, default=2, help="timings of each version per cell, alternating")
    ap.add_argument("--only", choices=("decode", "ragged", "paged"), action="append", help="run only these grids")
    ap.add_argument("--csv", metavar="PATH", help="write every cell's figures to PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_ab.py times CUDA kernels: no CUDA device here")
    parts = {"decode": decode_cells, "ragged": ragged_cells, "paged": paged_cells}
    with tempfile.TemporaryDirectory() as tmp:
        other = import_other(args.other, Path(tmp))
        versions = {"this": pagedmla, "other": other}
        rows = []
        for part in args.only or list(parts):
            for name, setup in parts[part](args.quick):
                bind = setup()
                fns = {v: bind(lib) for v, lib in versions.items()}
                outs = {v: fn() for v, fn in fns.items()}
                same = torch.equal(outs["this"], outs["other"])
                del outs
                times: dict[str, list[float]] = {v: [] for v in versions}
                for _ in range(args.rounds):
                    for v, fn in fns.items():
                        times[v].append(timed(fn))
                best = {v: min(t) for v, t in times.items()}
                spread = {v: (max(t) - min(t)) / min(t) for v, t in times.items()}
                rows.append({"cell": name, "this_us": best["this"], "other_us": best["other"],
                             "ratio": best["other"] / best["this"], "spread_this": spread["this"],
                             "spread_other": spread["other"], "same": same})
                print(f"{name}: this {best['this']:.1f} us, other {best['other']:.1f} us", flush=True)
                del fns, bind
                torch.cuda.empty_cache()
    print("\n| cell | this µs | other µs | other / this | spread this / other | same |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['this_us']:.1f} | {r['other_us']:.1f} | {r['ratio']:.3f} | "
              f"{100 * r['spread_this']:.1f}% / {100 * r['spread_other']:.1f}% | {'yes' if r['same'] else 'NO'} |")
    ratios = [r["ratio"] for r in rows]
    if ratios:
        geo = float(torch.tensor(ratios).log().mean().exp())
        print(f"\ngeomean other / this {geo:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f} over {len(rows)} cells")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["cell"])
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
