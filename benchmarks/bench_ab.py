"""This checkout's public calls against other checkouts', in one process, on the decode and prefill grids.

A refactor that should not change speed (or a kernel change that should) is judged by timing both versions
in the same process on the same inputs, alternating, so that clocks, the driver and the other tenants of the
machine affect all alike. Each other checkout's ``pagedmla/`` is copied to a temporary folder as the package
``pagedmla_other``, ``pagedmla_other1``, ... (every ``pagedmla`` name in its source rewritten, its
``torch.library`` namespace included), and all are imported side by side: several ``--other`` checkouts
bisect a change of speed in one run (benchmarks/NOTES.md, decode v19).

Cells: ``pagedmla.bench.decode.grid`` (decode, ``flash_mla_with_kvcache`` after ``get_mla_metadata``, eager, as
a user calls it) and ``pagedmla.bench.prefill``'s ragged (``flash_attn_varlen_func``, causal 192/128, its
skewed batches included) and paged (``flash_mla_varlen_with_kvcache``, causal 576/512) grids. Each version
is timed ``--rounds`` times per cell, alternating (``triton.testing.do_bench`` median, L2 flushed); the table
gives each version's best median, the ratio other / this (above 1: this checkout is faster) and the spread
of each version's rounds (the noise the ratio should be read against). ``same`` says whether the versions
returned this checkout's output bit for bit, and names those that did not with the cosine difference of their
output from this checkout's (``pagedmla.bench.decode.cos_diff``; another summation order gives ~1e-9-1e-6, a
wrong result 1e-3 and up), so that an A/B run also checks a changed kernel's outputs on the GPU.
``--match`` keeps the cells whose name holds one of its strings (e.g. ``h16 s4096``). ``--graphs`` also times
each decode cell as CUDA graphs of ``GRAPH_CALLS`` calls over rotated input copies (``bench_decode --graphs``'s
timer, what an engine replaying graphs pays), alternating with the eager timings; ``--queued`` as
``QUEUED_CALLS`` eager calls queued back to back after a one-block kernel each (``bench.decode.queued_timer``:
what an engine's eager step pays on the device, the gaps between kernels included, which do_bench's per-call
events and L2 flush hide).

    git archive REV pagedmla | tar -x -C /tmp/rev     # the other checkout (a directory holding pagedmla/)
    python3 benchmarks/bench_ab.py --other /tmp/rev [--other /tmp/rev2 ...] [--quick] [--rounds 2]
        [--only decode|ragged|paged] [--kv-format fp8_e4m3|fp8_ds_mla] [--match SUBSTRING] [--graphs] [--queued]
        [--csv F]
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from inspect import signature
from pathlib import Path
from types import ModuleType

import torch
import triton

import pagedmla
from pagedmla.bench import decode as bdecode
from pagedmla.bench import prefill as bprefill
from pagedmla.bench.common import fp8_caches

OTHER = "pagedmla_other"


def import_other(checkout: Path, into: Path, name: str = OTHER) -> ModuleType:
    """``checkout``/pagedmla imported as the package ``name`` (a rewritten copy under ``into``)."""
    src = checkout / "pagedmla"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--other: {checkout} holds no pagedmla/ package")
    dst = into / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    word = re.compile(r"\bpagedmla\b")
    for path in dst.rglob("*.py"):
        path.write_text(word.sub(name, path.read_text()))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


def labels(checkouts: list[Path]) -> list[str]:
    """Column names of the other checkouts: ``other`` for one; for several their folder names, numbered where
    two coincide or one is called ``this``."""
    if len(checkouts) == 1:
        return ["other"]
    names = [c.resolve().name for c in checkouts]
    return [n if names.count(n) == 1 and n != "this" else f"{n}#{i}" for i, n in enumerate(names)]


def timed(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


# bind(lib): lib's call on input copy i (eager timings use copy 0).
Bind = Callable[[ModuleType], Callable[[int], torch.Tensor]]
# setup(rotated): makes a cell's inputs once, rotated copies with ``rotated``; (bind, the copies for the CUDA-graph
# and queued timers, or None: eager only).
Setup = Callable[[bool], tuple[Bind, int | None]]
Cells = list[tuple[str, Setup]]


def decode_cells(quick: bool, fmt: str | None = None) -> Cells:
    """(name, setup) per cell. ``fmt``: the cache quantised to that FP8 format (``pagedmla.kv_format``, this
    checkout's quantiser: the bytes are the format's, the same for every version). With ``rotated`` the cell makes
    ``bench_decode``'s rotated copies (enough to leave L2 cold within a graph), else one (do_bench flushes L2
    between eager calls)."""
    cells = []
    for cell in bdecode.grid(quick):
        def setup(rotated: bool, cell=cell) -> tuple[Bind, int | None]:
            l2 = torch.cuda.get_device_properties(0).L2_cache_size if rotated else 0
            inp = bdecode.Inputs(cell, seed=0, l2_bytes=l2)
            caches = [(c, {}) if fmt is None else fp8_caches(c)[fmt] for c in inp.cache]

            def bind(lib: ModuleType) -> Callable[[int], torch.Tensor]:
                # Planned for the cache's format where the version's get_mla_metadata takes one.
                plan = {"kv_format": fmt} if fmt and "kv_format" in signature(lib.get_mla_metadata).parameters else {}
                meta, splits = lib.get_mla_metadata(inp.seqlens, cell.q_len * cell.heads, 1, **plan)
                return lambda i: lib.flash_mla_with_kvcache(inp.q[i], caches[i][0], inp.table, inp.seqlens,
                                                            bdecode.DV, meta, splits, causal=True, **caches[i][1])[0]
            return bind, len(inp.q) if rotated else None
        cells.append((f"decode{'' if fmt is None else ' ' + fmt} b{cell.b} q{cell.q_len} h{cell.heads} "
                      f"s{cell.mean}", setup))
    return cells


def ragged_cells(quick: bool) -> Cells:
    cells = []
    for b, seqlen, h in bprefill.RAGGED_GRID[:3] if quick else bprefill.RAGGED_GRID:
        def setup(rotated: bool, b=b, seqlen=seqlen, h=h) -> tuple[Bind, None]:
            t = b * seqlen
            q, k, v = bprefill.rnd(t, h, 192), bprefill.rnd(t, h, 192), bprefill.rnd(t, h, 128)
            cu = torch.arange(0, t + 1, seqlen, device="cuda", dtype=torch.int32)
            return (lambda lib: lambda i: lib.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, 192 ** -0.5,
                                                                     True)), None
        cells.append((f"ragged {b}x{seqlen} h{h}", setup))
    # One long prompt among many short ones (the per-sequence tile numbering's case).
    for long, n, short, h in bprefill.SKEWED_GRID[:1] if quick else bprefill.SKEWED_GRID:
        def setup(rotated: bool, long=long, n=n, short=short, h=h) -> tuple[Bind, None]:
            lens = torch.tensor([0, long] + [short] * n, device="cuda")
            cu = lens.cumsum(0).to(torch.int32)
            t = long + n * short
            q, k, v = bprefill.rnd(t, h, 192), bprefill.rnd(t, h, 192), bprefill.rnd(t, h, 128)
            return (lambda lib: lambda i: lib.flash_attn_varlen_func(q, k, v, cu, cu, long, long, 192 ** -0.5,
                                                                     True)), None
        cells.append((f"ragged 1x{long}+{n}x{short} h{h}", setup))
    return cells


def paged_cells(quick: bool) -> Cells:
    cells = []
    for b, new, cached, h in bprefill.PAGED_GRID[:2] if quick else bprefill.PAGED_GRID:
        def setup(rotated: bool, b=b, new=new, cached=cached, h=h) -> tuple[Bind, None]:
            pages_per = triton.cdiv(new + cached, bprefill.PAGE)
            num_pages = b * pages_per + 1
            cache = bprefill.rnd(num_pages, bprefill.PAGE, 1, 576)
            table = (torch.randperm(num_pages - 1, device="cuda")[: b * pages_per] + 1).int().view(b, pages_per)
            lens = torch.full((b,), new + cached, device="cuda", dtype=torch.int32)
            qo = torch.arange(0, b * new + 1, new, device="cuda", dtype=torch.int32)
            q = bprefill.rnd(b * new, h, 576)
            return (lambda lib: lambda i: lib.flash_mla_varlen_with_kvcache(
                q, cache, table, lens, qo, 512, softmax_scale=192 ** -0.5, causal=True, max_q_len=new)[0]), None
        cells.append((f"paged {b}x{new} over {cached} h{h}", setup))
    return cells


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, action="append", required=True,
                    help="a directory holding another pagedmla/ package (repeatable)")
    ap.add_argument("--quick", action="store_true", help="a few cells of each grid")
    ap.add_argument("--rounds", type=int, default=2, help="timings of each version per cell, alternating")
    ap.add_argument("--only", choices=("decode", "ragged", "paged"), action="append", help="run only these grids")
    ap.add_argument("--match", action="append", metavar="SUBSTRING",
                    help="only the cells whose name holds one of these (repeatable)")
    ap.add_argument("--kv-format", choices=("fp8_e4m3", "fp8_ds_mla"), action="append", default=[],
                    help="time the decode grid on a cache of this FP8 format (repeatable; without --only, only these)")
    ap.add_argument("--graphs", action="store_true", help="also time the decode cells as CUDA graphs")
    ap.add_argument("--queued", action="store_true",
                    help="also time the decode cells as eager calls queued back to back (no per-call event)")
    ap.add_argument("--csv", metavar="PATH", help="write every cell's figures to PATH")
    args = ap.parse_args(argv)
    args.kv_format = list(dict.fromkeys(args.kv_format))  # a format named twice runs once
    if not torch.cuda.is_available():
        raise SystemExit("bench_ab.py times CUDA kernels: no CUDA device here")
    parts = {"decode": decode_cells, "ragged": ragged_cells, "paged": paged_cells}
    parts |= {fmt: lambda quick, fmt=fmt: decode_cells(quick, fmt) for fmt in args.kv_format}
    names = labels(args.other)
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"this": pagedmla}
        for i, (label, checkout) in enumerate(zip(names, args.other)):
            versions[label] = import_other(checkout, Path(tmp), OTHER if i == 0 else f"{OTHER}{i}")
        rows = []
        default = [] if args.kv_format else ["decode", "ragged", "paged"]
        for part in (args.only or default) + args.kv_format:
            for name, setup in parts[part](args.quick):
                if args.match and not any(m in name for m in args.match):
                    continue
                rows.append(time_cell(name, setup, versions, args.rounds, args.graphs, args.queued))
                torch.cuda.empty_cache()
    print_table(rows, names)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            # Every row's keys (prefill rows have no graph figures), in first-seen order.
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)) or ["cell"])
            w.writeheader()
            w.writerows(rows)


def time_cell(name: str, setup: Setup, versions: dict[str, ModuleType], rounds: int, graphs: bool = False,
              queued: bool = False) -> dict:
    """One cell's row: each version's best median over ``rounds`` alternating timings, its spread, the ratio
    other / this per other version, and whether every version's output equals this checkout's bit for bit
    (``differ``: the versions whose output does not; ``cos_<version>``: each other version's cosine difference
    from this checkout's output).
    With ``graphs`` a decode cell also gets each version's CUDA-graph figures (µs per call, ``graph_`` keys),
    timed in the same rounds; with ``queued`` the queued eager figures (``queued_`` keys) too."""
    bind, copies = setup(graphs or queued)
    fns = {v: bind(lib) for v, lib in versions.items()}
    outs = {v: fn(0) for v, fn in fns.items()}
    differ = [v for v, o in outs.items() if not torch.equal(outs["this"], o)]
    cos = {v: bdecode.cos_diff(outs["this"], o) for v, o in outs.items() if v != "this"}
    del outs
    # (kind, version): kind "" for eager calls, "graph_" for CUDA-graph replays (the row keys' prefix).
    timers = {("", v): functools.partial(timed, functools.partial(fn, 0)) for v, fn in fns.items()}
    if graphs and copies is not None:
        try:
            timers |= {("graph_", v): bdecode.graph_timer(fn, copies) for v, fn in fns.items()}
        except RuntimeError as e:  # a version that cannot be captured: this cell keeps eager figures only
            print(f"{name}: no CUDA-graph figures ({str(e).splitlines()[0]})", flush=True)
    if queued and copies is not None:
        timers |= {("queued_", v): bdecode.queued_timer(fn, copies) for v, fn in fns.items()}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in timers}
    for _ in range(rounds):
        for key, timer in timers.items():
            times[key].append(timer())
    row: dict = {"cell": name}
    for (kind, v), t in times.items():
        row[f"{kind}{v}_us"] = min(t)
        row[f"spread_{kind}{v}"] = (max(t) - min(t)) / min(t)
        if v != "this":
            row[f"ratio_{kind}{v}"] = min(t) / min(times[kind, "this"])
    row["same"] = not differ
    row["differ"] = " ".join(differ)
    row |= {f"cos_{v}": c for v, c in cos.items()}
    print(f"{name}: " + ", ".join(f"{kind}{v} {min(t):.1f} us" for (kind, v), t in times.items()), flush=True)
    return row


# Timer kinds beside the eager one: row-key prefix -> (column label, summary label).
KINDS = {"graph_": ("graph ", "graphs"), "queued_": ("queued ", "queued")}


def print_table(rows: list[dict], others: list[str]) -> None:
    """The markdown table (µs, ratios other / this, spreads; the graph figures where a row has them) and each
    other version's geometric mean."""
    kinds = [""] + [k for k in KINDS if any(f"{k}this_us" in r for r in rows)]
    versions = ["this", *others]
    head = ["cell"]
    for kind in kinds:
        label = KINDS[kind][0] if kind else ""
        head += [f"{label}{v} µs" for v in versions] + [f"{label}{o} / this" for o in others]
        head.append(f"{label}spread " + " / ".join(versions))
    print("\n| " + " | ".join(head + ["same"]) + " |")
    print("|" + "---|" * (len(head) + 1))
    for r in rows:
        cells = [r["cell"]]
        for kind in kinds:
            if f"{kind}this_us" not in r:
                cells += ["—"] * (2 * len(versions))
                continue
            cells += [f"{r[f'{kind}{v}_us']:.1f}" for v in versions]
            cells += [f"{r[f'ratio_{kind}{o}']:.3f}" for o in others]
            cells.append(" / ".join(f"{100 * r[f'spread_{kind}{v}']:.1f}%" for v in versions))
        same = "yes" if r["same"] else "NO: " + " ".join(f"{v} (cos {r[f'cos_{v}']:.1e})" for v in r["differ"].split())
        print("| " + " | ".join(cells + [same]) + " |")
    for kind in kinds:
        for o in others:
            ratios = [r[f"ratio_{kind}{o}"] for r in rows if f"ratio_{kind}{o}" in r]
            if ratios:
                geo = float(torch.tensor(ratios).log().mean().exp())
                what = f" ({KINDS[kind][1]})" if kind else ""
                print(f"\n{o} / this{what}: geomean {geo:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f} over "
                      f"{len(ratios)} cells")


if __name__ == "__main__":
    main()
