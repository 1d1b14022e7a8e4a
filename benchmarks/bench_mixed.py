"""MIXED steps through ``MLABackend``: the decodes split off to the decode kernel, or one varlen launch for all.

A MIXED step (an engine's chunked prefill sharing a step with the running decodes) has extends first and
decodes (one token each) after them. With ``MLAConfig.mixed_decode_kernel="decode"`` the backend runs the
decodes through the split-KV decode kernel, whose schedule spreads each long context over several SMs, and
the extends through the varlen kernel; with ``"varlen"`` one varlen launch runs every request, each decode as
one tile that streams its whole context on one SM; ``"auto"`` (the default) picks by the backend's rule
(``pagedmla.backend.decode_tail``, and ``dequant_split`` over an FP8 cache on sm_90): the ``auto`` column is
what an "auto" backend plans for the cell on this device. Each cell is one layer's absorbed attention of such a step
(``backend.forward``, the step planned once and not timed, as an engine plans a step for all its layers),
eager, ``do_bench`` median with L2 flushed, both settings in one process on the same cache and queries,
alternating ``--rounds`` times (each setting's best kept). ``cos`` compares the two outputs (they compute
the same attention in another summation order: ~1e-6 and below); a cell whose outputs differ by more, or whose
plan under a setting did not split off (or keep) its decodes, prints ``BAD`` and makes the exit status 1.

Cells ``GRID``: heads, extends (requests x new tokens over cached tokens), decodes (requests x context), bf16
(``--kv-format`` adds an FP8 cache's rows). On a machine without CUDA the same runs as a smoke test on tiny
cells (float16, Triton interpreter, wall clock).

    python3 benchmarks/bench_mixed.py [--rounds 2] [--kv-format fp8_e4m3] [--csv mixed.csv]
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NamedTuple

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend
from pagedmla.bench import decode as bdecode
from pagedmla.bench.common import wall_clock_us, write_csv
from pagedmla.cache import MLAKVCache
from pagedmla.config import MLAConfig

D, DV, PAGE = bdecode.D, bdecode.DV, bdecode.PAGE
COS_LIMIT = 1e-5


class Cell(NamedTuple):
    heads: int
    extends: int
    new: int
    cached: int
    decodes: int
    context: int

    def __str__(self) -> str:
        return (f"h{self.heads} {self.extends}x{self.new} over {self.cached} + {self.decodes} decodes x "
                f"{self.context}")


GRID = [Cell(16, 1, 512, 0, 32, 4096), Cell(16, 1, 512, 0, 8, 16384), Cell(16, 2, 256, 2048, 64, 2048),
        Cell(16, 1, 2048, 0, 128, 1024), Cell(128, 1, 512, 0, 32, 4096), Cell(128, 1, 256, 0, 8, 16384),
        Cell(128, 4, 128, 1024, 64, 1024), Cell(16, 1, 1024, 0, 16, 512), Cell(128, 1, 1024, 0, 16, 512)]
CPU_GRID = [Cell(2, 1, 5, 3, 3, 40)]


def cuda() -> bool:
    return torch.cuda.is_available()


def run_cell(cell: Cell, fmt: str, rounds: int) -> dict:
    """Both settings' µs per layer on one MIXED step of ``cell`` over a ``fmt`` cache, and their cos diff."""
    device = torch.device("cuda" if cuda() else "cpu")
    dtype = torch.bfloat16 if cuda() else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    lens = [cell.cached + cell.new] * cell.extends + [cell.context] * cell.decodes
    new = [cell.new] * cell.extends + [1] * cell.decodes
    b = len(lens)
    width = -(-max(lens) // PAGE)
    cache = MLAKVCache(1, b * width + 1, PAGE, D, dtype=dtype if fmt == "bf16" else fmt, device=device)
    table = (torch.randperm(b * width, device=device, generator=g) + 1).int().view(b, width)
    slots = (table.long()[:, :, None] * PAGE + torch.arange(PAGE, device=device)).view(b, -1)
    for i, n in enumerate(lens):  # every request's rows, the step's new ones included (stored by the engine)
        cache.store(0, slots[i, :n], (torch.randn(n, D, device=device, generator=g) / 10).to(dtype))
    seq = torch.tensor(lens, device=device, dtype=torch.int32)
    batch = ForwardBatch(ForwardMode.MIXED, torch.arange(b, device=device), seq, table, seq_lens_cpu=lens,
                         extend_seq_lens_cpu=new[:cell.extends],
                         extend_prefix_lens_cpu=[cell.cached] * cell.extends, num_extends=cell.extends)
    q = (torch.randn(sum(new), cell.heads, D, device=device, generator=g) / 10).to(dtype)
    steps, outs, planned = {}, {}, {}
    for split in (True, False, "auto"):
        kernel = "auto" if split == "auto" else "decode" if split else "varlen"
        cfg = MLAConfig(num_heads=cell.heads, page_size=PAGE, dtype=dtype, num_layers=1, max_batch_size=b,
                        kv_cache_dtype=None if fmt == "bf16" else fmt, max_context_len=width * PAGE,
                        mixed_decode_kernel=kernel)
        backend = MLABackend(cfg, device=device, provider="triton")
        backend.init_forward_metadata(batch)
        planned[split] = backend.metadata.split_decodes
        if split == "auto":
            break

        def step(backend=backend):
            return backend.forward(q, None, None, 0, None, cache, save_kv_cache=False)

        outs[split] = step().float()
        steps[split] = step
    best = {True: math.inf, False: math.inf}
    for _ in range(rounds):
        for split in (True, False):
            us = bdecode.bench(steps[split]) if cuda() else wall_clock_us(steps[split], reps=1)
            best[split] = min(best[split], us)
    diff = bdecode.cos_diff(outs[True], outs[False])
    # Each setting must have planned what it names (else both rows would time one path).
    as_named = (planned[True], planned[False]) == (cell.decodes, 0)
    return {"cell": f"{fmt} {cell}", "split_us": best[True], "one_launch_us": best[False],
            "auto": "decode" if planned["auto"] else "varlen",
            "one_launch_over_split": best[False] / best[True], "cos": diff,
            "ok": as_named and math.isfinite(diff) and diff < COS_LIMIT}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="timings of each setting per cell, alternating")
    ap.add_argument("--kv-format", choices=("fp8_e4m3", "fp8_ds_mla"), action="append", default=[],
                    help="also run the cells on a cache of this FP8 format (repeatable)")
    ap.add_argument("--csv", help="write the table as CSV here")
    args = ap.parse_args(argv)
    grid = GRID if cuda() else CPU_GRID
    rows = []
    for fmt in ("bf16", *args.kv_format):
        for cell in grid:
            row = run_cell(cell, fmt, max(1, args.rounds))
            rows.append(row)
            print(f"{row['cell']}: split {row['split_us']:.1f} us, one launch {row['one_launch_us']:.1f} us",
                  flush=True)
    print(f"\nMIXED step, one layer, eager µs ({'do_bench, L2 flushed' if cuda() else 'CPU smoke run, wall clock'})")
    print("| cell | decodes split | one launch | one launch / split | auto | cos |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['split_us']:.1f} | {r['one_launch_us']:.1f} | {r['one_launch_over_split']:.3f} "
              f"| {r['auto']} | {r['cos']:.1e}{'' if r['ok'] else ' BAD'} |")
    if args.csv:
        write_csv(args.csv, rows)
    bad = [r["cell"] for r in rows if not r["ok"]]
    if bad:
        print(f"BAD: the two settings' outputs differ, or a setting did not plan its kernels, in {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
