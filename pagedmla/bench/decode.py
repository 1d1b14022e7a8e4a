"""Paged MLA decode on the GPU: pagedmla's Triton kernels beside FlashMLA and FlashInfer, same inputs, one run.

The decode grid (batch 128 x q_len {1, 2} x heads {16, 32, 64, 128} x mean seq {1024, 4096, 8192}) plus
batch 1 and 8 at 128 heads / 4096, batch 32 at 16 heads / 32768 and batch 64 x q_len 4 x 16 heads / 4096.
Inputs: varlen lengths from N(mean, mean/2) clamped to >= q_len, randomly permuted block tables, page 64,
bf16, causal, random data (randn/10, clamped). Formulas (FlashMLA's):
FLOPs = 2 q_len sum(seq) H (576 + 512); bytes = 2 (sum(seq) 576 + b q_len H (576 + 512)).
On CPU (``pagedmla bench decode``) the grid is a few tiny float32 cells, the Triton kernels run under the
interpreter beside the torch reference provider, and a wall-clock median times them: a smoke run of the
path, labelled as such. The torch provider joins any run as a baseline with ``--torch``.
Times: ``triton.testing.do_bench`` median of the whole call (main + combine kernels and launches);
each library's schedule is computed once per cell and reused, as an engine does across layers. Inputs
smaller than a few L2s are rotated among copies so that repeated calls do not run from L2. Batches of
at most 8 (every cell with ``--graphs``) are also timed as CUDA-graph replays, which leave out the host's
launch cost (pagedmla's Python wrapper costs more host time than FlashMLA's C++ one). ``--rounds N`` times
pagedmla and FlashMLA (eager and graphs) in turn N times per cell and keeps each one's best: the GPU's clocks
fall under sustained load, which would otherwise favour whichever library runs first. Each cell checks
pagedmla's output against FlashMLA's (cos diff column) and FlashInfer's.

    python3 benchmarks/bench_decode.py [--quick] [--flashinfer] [--alt] [--graphs] [--rounds N] [--torch]
                                       [--csv out.csv] [--plot out.png]
    python3 benchmarks/bench_decode.py --sweep [SPECS]  # time kernel configs on representative cells
    pagedmla bench decode [--quick]                     # the same from an installed package, with a plot
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import math
import sys
from collections.abc import Callable

import torch
import triton

from pagedmla.bench.common import CPU_TIMER, CUDA_TIMER, bar_plot, best_of_rounds, check_plotting, wall_clock_us
from pagedmla.bench.options import decode_arguments
from pagedmla.kernels.triton.decode import DecodeConfig, default_config, paged_decode_triton, select_config
from pagedmla.kernels.triton.sm90.mla import sm90_supported
from pagedmla.ops.attention import flash_mla_with_kvcache
from pagedmla.ops.schedule import get_mla_metadata
from pagedmla.split_plan import tile_plan

D, DV, PAGE = 576, 512, 64
HEADER = ["b", "q_len", "heads", "mean_seq", "config", "pagedmla_us", "TFLOPs", "GBps", "flashmla_us",
          "flashmla_TFLOPs", "ratio_flashmla", "flashinfer_us", "ratio_flashinfer", "cos_diff_vs_flashmla",
          "cuda_graph_note", "alt_config", "alt_us", "alt_ratio_flashmla", "graph_us", "flashmla_graph_us",
          "ratio_flashmla_graph"]
# Columns of the torch reference baseline (CPU runs, or --torch), after the others.
TORCH_HEADER = ["torch_us", "ratio_torch", "cos_diff_vs_torch"]
# (column, title) of the summary table, in order.
SUMMARY = [("b", "b"), ("q_len", "q_len"), ("heads", "heads"), ("mean_seq", "mean seq"), ("config", "config"),
           ("pagedmla_us", "pagedmla µs"), ("TFLOPs", "TFLOP/s"), ("GBps", "GB/s"), ("flashmla_us", "FlashMLA µs"),
           ("ratio_flashmla", "FlashMLA/pagedmla"), ("flashinfer_us", "FlashInfer µs"),
           ("ratio_flashinfer", "FlashInfer/pagedmla"), ("cos_diff_vs_flashmla", "cos diff"),
           ("alt_config", "other plan"), ("alt_us", "its µs"), ("alt_ratio_flashmla", "FlashMLA/it"),
           ("graph_us", "graph µs"), ("flashmla_graph_us", "FlashMLA graph µs"),
           ("ratio_flashmla_graph", "FlashMLA/pagedmla (graphs)")]
TORCH_SUMMARY = [("torch_us", "torch µs"), ("ratio_torch", "torch/pagedmla"),
                 ("cos_diff_vs_torch", "cos diff vs torch")]
# The cell groups the summary gives a geometric mean and a minimum for: the whole grid (what issue 24's
# acceptance reads), the batch-128 cells, the memory-bound cells and the compute-bound ones (issue 25).
RATIO_GROUPS: tuple[tuple[str, Callable[[dict], bool]], ...] = (
    ("all cells", lambda r: True),
    ("batch-128 cells", lambda r: r["b"] == 128),
    ("memory-bound cells (heads x q_len <= 32)", lambda r: r["q_len"] * r["heads"] <= 32),
    ("compute-bound batch-128 cells (heads x q_len >= 128)",
     lambda r: r["b"] == 128 and r["q_len"] * r["heads"] >= 128),
)


@dataclasses.dataclass(frozen=True)
class Cell:
    b: int
    q_len: int
    heads: int
    mean: int


def grid(quick: bool, device: torch.device | None = None) -> list[Cell]:
    """The cells of one run; on a CPU device a few tiny ones (the interpreter takes ~1 s per call)."""
    if device is not None and device.type != "cuda":
        cells = [Cell(2, 1, 16, 128), Cell(2, 2, 16, 64)]
        return cells if quick else cells + [Cell(4, 1, 16, 512), Cell(1, 1, 64, 256)]
    if quick:
        return [Cell(128, 1, 16, 4096), Cell(128, 1, 64, 4096), Cell(128, 1, 128, 4096), Cell(128, 2, 128, 4096),
                Cell(1, 1, 128, 4096), Cell(64, 4, 16, 4096)]
    cells = [Cell(128, q, h, s) for q in (1, 2) for h in (16, 32, 64, 128) for s in (1024, 4096, 8192)]
    return cells + [Cell(1, 1, 128, 4096), Cell(8, 1, 128, 4096), Cell(32, 1, 16, 32768), Cell(64, 4, 16, 4096)]


class Inputs:
    """One cell's inputs: ``copies`` rotated (q, cache) pairs sharing lengths and block table, in ``dtype``
    on ``device``."""

    def __init__(self, cell: Cell, seed: int, l2_bytes: int, device: torch.device | str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        lens = torch.normal(float(cell.mean), cell.mean / 2, (cell.b,), generator=g).clamp(min=cell.q_len)
        self.lens_host = lens.int().tolist()
        self.seqlens = torch.tensor(self.lens_host, dtype=torch.int32, device=device)
        pages = [math.ceil(n / PAGE) for n in self.lens_host]
        total = sum(pages)
        self.num_pages = total + 1
        self.table = torch.zeros(cell.b, max(pages), dtype=torch.int32)
        perm = (torch.randperm(total, generator=g) + 1).int()
        at = 0
        for i, n in enumerate(pages):
            self.table[i, :n] = perm[at:at + n]
            at += n
        self.table = self.table.to(device)
        self.cell = cell
        self.flops = 2 * cell.q_len * sum(self.lens_host) * cell.heads * (D + DV)
        self.bytes = 2 * (sum(self.lens_host) * D + cell.b * cell.q_len * cell.heads * (D + DV))
        copies = max(1, min(16, math.ceil(4 * l2_bytes / self.bytes)))
        self.q = [(torch.randn(cell.b, cell.q_len, cell.heads, D, device=device) / 10).clamp(-1, 1).to(dtype)
                  for _ in range(copies)]
        self.cache = [(torch.randn(self.num_pages, PAGE, 1, D, device=device) / 10).clamp(-1, 1).to(dtype)
                      for _ in range(copies)]
        self._i = 0

    def next(self) -> int:
        self._i = (self._i + 1) % len(self.q)
        return self._i


def bench(fn: Callable[[], object]) -> float:
    """Median µs of fn (do_bench: CUDA events, L2 flushed between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


GRAPH_CALLS = 16


def graph_timer(call: Callable[[int], object], copies: int) -> Callable[[], float]:
    """A timer of a CUDA graph that makes ``GRAPH_CALLS`` calls over the rotated input copies (captured
    once): each use returns the median µs per call, what an engine that replays graphs pays, without the
    host's launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            call(i % copies)
    return lambda: bench(graph.replay) / GRAPH_CALLS


QUEUED_CALLS = 32


def queued_timer(call: Callable[[int], object], copies: int) -> Callable[[], float]:
    """A timer of ``QUEUED_CALLS`` eager calls over the rotated input copies queued back to back, each after a
    one-block kernel (the model's previous kernel), with no event between them: µs per call of the device's
    time, its gaps between kernels included, as an engine's eager step queues attention. The queue is filled
    behind a GPU sleep first, so the host's launch cost is not in it (do_bench's L2 flush and per-call events
    serialise every call; benchmarks/NOTES.md, decode v29). Best of five."""
    tick = torch.zeros(1, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timer() -> float:
        best = float("inf")
        for _ in range(5):
            torch.cuda._sleep(5_000_000)  # ~3 ms at the H200's clock: longer than queuing the calls
            start.record()
            for i in range(QUEUED_CALLS):
                tick.add_(1)
                call(i % copies)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / QUEUED_CALLS)
        return best

    return timer


def bench_graph(call: Callable[[int], object], copies: int) -> float:
    """``graph_timer``'s figure, once."""
    return graph_timer(call, copies)()


COS_CHUNK = 1 << 24  # elements per float64 slice: 2^31-element outputs would need 16 GiB per copy at once


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2<x, y> / (|x|^2 + |y|^2), summed in float64 over slices so the temporaries stay small."""
    x, y = x.reshape(-1), y.reshape(-1)
    dot = norms = 0.0
    for i in range(0, x.numel(), COS_CHUNK):
        a, b = x[i:i + COS_CHUNK].double(), y[i:i + COS_CHUNK].double()
        dot += float((a * b).sum())
        norms += float((a * a + b * b).sum())
    return 1 - 2 * dot / norms


def pagedmla_fn(inp: Inputs, config: DecodeConfig | None = None, parts: int | None = None):
    """(rotating timed call, call on copy 0, call on copy i); ``parts`` overrides the schedule's part count.
    With the defaults the public call runs as a user makes it (its checks, the default provider); a config
    sweep calls the Triton entry point with that config."""
    c = inp.cell
    meta, splits = get_mla_metadata(inp.seqlens, c.q_len * c.heads, 1, num_sm_parts=parts)

    def call(i: int):
        if config is None:
            return flash_mla_with_kvcache(inp.q[i], inp.cache[i], inp.table, inp.seqlens, DV, meta, splits,
                                          causal=True)
        return paged_decode_triton(inp.q[i], inp.cache[i], inp.table, inp.seqlens, DV, meta, splits, D ** -0.5,
                                   True, config)

    return (lambda: call(inp.next())), (lambda: call(0)), call


def torch_fn(inp: Inputs) -> tuple[Callable, Callable, Callable]:
    """The torch reference provider through the public call, with pagedmla's own schedule."""
    c = inp.cell
    meta, splits = get_mla_metadata(inp.seqlens, c.q_len * c.heads, 1)

    def call(i: int):
        return flash_mla_with_kvcache(inp.q[i], inp.cache[i], inp.table, inp.seqlens, DV, meta, splits,
                                      softmax_scale=D ** -0.5, causal=True, provider="torch")

    return (lambda: call(inp.next())), (lambda: call(0)), call


def flashmla_fn(inp: Inputs) -> tuple[Callable, Callable] | None:
    try:
        import flash_mla
    except ImportError:
        return None
    sched, _ = flash_mla.get_mla_metadata()

    def call(i: int):
        return flash_mla.flash_mla_with_kvcache(inp.q[i], inp.cache[i], inp.table, inp.seqlens, DV, sched, None,
                                                softmax_scale=D ** -0.5, causal=True, use_legacy=True)

    call(0)  # fills the schedule, reused from here on
    return (lambda: call(inp.next())), (lambda: call(0)), call


_FI_WORKSPACE: list[torch.Tensor] = []


def flashinfer_fn(inp: Inputs) -> tuple[Callable, Callable] | None:
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except ImportError:
        return None
    c = inp.cell
    if not _FI_WORKSPACE:
        _FI_WORKSPACE.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    wrapper = BatchMLAPagedAttentionWrapper(_FI_WORKSPACE[0], backend="fa3")
    pages = (inp.seqlens + PAGE - 1) // PAGE
    kv_indptr = torch.zeros(c.b + 1, dtype=torch.int32, device="cuda")
    kv_indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(inp.table.shape[1], device="cuda").unsqueeze(0) < pages.unsqueeze(1)
    kv_indices = inp.table[used].contiguous()
    qo_indptr = torch.arange(0, (c.b + 1) * c.q_len, c.q_len, dtype=torch.int32, device="cuda")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, inp.seqlens, c.heads, DV, D - DV, PAGE, True, D ** -0.5,
                 torch.bfloat16, torch.bfloat16)
    qs = [(q.reshape(-1, c.heads, D)[..., :DV], q.reshape(-1, c.heads, D)[..., DV:]) for q in inp.q]
    caches = [(k.view(-1, PAGE, D)[..., :DV], k.view(-1, PAGE, D)[..., DV:]) for k in inp.cache]

    def call(i: int):
        out, lse = wrapper.run(qs[i][0], qs[i][1], caches[i][0], caches[i][1], return_lse=True,
                               return_lse_base_on_e=True)
        return out.view(c.b, c.q_len, c.heads, DV), lse

    return (lambda: call(inp.next())), (lambda: call(0)), call


def _configs(block_m: int, specs: list[str]) -> list[tuple[DecodeConfig, int]]:
    """(config, parts per SM) from specs 'n<block_n>w<warps>s<stages>c<chunks>[t][p][x<k>]' (``DecodeConfig.spec``
    without the row count; x<k>: schedule k parts per SM, for configs small enough that k CTAs share an SM)."""
    out = []
    for spec in specs:
        spec, _, per_sm = spec.partition("x")
        out.append((DecodeConfig.from_spec(f"m{block_m}{spec}"), int(per_sm or 1)))
    return out

SWEEP_16 = _configs(16, ["n64w8s2c1", "n64w8s2c2", "n64w8s2c4", "n32w8s3c4", "n32w8s4c2", "n64w4s2c4",
                         "n64w8s2c4t", "n32w8s4c4t", "n32w4s2c4x2", "n32w4s2c1x2", "n32w4s2c4tx2",
                         "n32w4s3c4x2", "n32w4s2c4x3", "n32w4s2c2x2", "n16w4s4c4x2", "n16w4s3c4x3", "n16w4s2c4x4",
                         "n32w4s3c4px2", "n32w4s4c4px2", "n16w4s4c4px2"])
SWEEP_32 = _configs(32, ["n64w8s2c1", "n64w8s2c4", "n32w8s3c4", "n64w8s2c4t", "n64w8s2c2t", "n32w4s2c4x2",
                         "n32w4s2c4tx2", "n32w4s2c2x2", "n32w8s2c4x2", "n16w4s3c4x2", "n16w4s4c4x2", "n16w4s2c4x3",
                         "n32w4s3c4px2", "n16w4s3c4px2"])
SWEEP_32 += SWEEP_16[:1] + SWEEP_16[2:3]
SWEEP_64 = _configs(64, ["n64w8s2c1", "n64w8s2c2", "n64w8s2c4", "n64w8s2c2t", "n64w8s2c4t", "n32w8s3c4",
                         "n64w16s2c1", "n64w8s2c2tp"])
SWEEP_CELLS = [Cell(128, 1, 16, 1024), Cell(128, 1, 16, 4096), Cell(32, 1, 16, 32768), Cell(128, 1, 32, 4096),
               Cell(128, 2, 16, 8192), Cell(128, 1, 64, 4096), Cell(128, 1, 128, 4096), Cell(64, 4, 16, 4096),
               Cell(1, 1, 128, 4096)]


def sweep(l2: int, only: list[str] | None = None) -> None:
    """Time each candidate config on representative cells (checked against FlashMLA or the default).

    ``only``: full specs with the part suffix (``m16n32w4s3c4px2``) replacing the built-in lists; each cell
    runs those whose row tile matches its ``tile_plan``, and the Hopper kernel's (``h``) everywhere."""
    chosen = [(DecodeConfig.from_spec(s.partition("x")[0]), int(s.partition("x")[2] or 1)) for s in only or []]
    print("cell,config,us,TFLOPs,GBps,flashmla_us,ratio,cos_diff")
    for n, cell in enumerate(SWEEP_CELLS):
        inp = Inputs(cell, 1000 + n, l2)
        base = _guarded("FlashMLA", flashmla_fn, inp)
        ref_out = base[1]()[0] if base else None
        t_base = bench(base[0]) if base else float("nan")
        rows = cell.q_len * cell.heads
        sms = torch.cuda.get_device_properties(inp.seqlens.device).multi_processor_count
        configs = SWEEP_16 if rows <= 16 else SWEEP_32 if rows <= 32 else SWEEP_64
        if only:
            configs = [(cfg, k) for cfg, k in chosen if cfg.block_m == tile_plan(rows)[0] or cfg.use_sm90]
            if not configs:
                continue
        for cfg, per_sm in configs:
            try:
                parts = max(1, per_sm * sms // triton.cdiv(rows, cfg.block_m))
                timed, once, _ = pagedmla_fn(inp, cfg, parts)
                out = once()[0]
                diff = cos_diff(out, ref_out) if ref_out is not None else float("nan")
                t = bench(timed)
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"{cell},{cfg.spec},FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            print(f"{cell.b}x{cell.q_len}x{cell.heads}x{cell.mean},{cfg.spec}x{per_sm},{t:.1f},"
                  f"{inp.flops / t / 1e6:.0f},{inp.bytes / t / 1e3:.0f},{t_base:.1f},{t_base / t:.3f},{diff:.2e}",
                  flush=True)
        del inp
        torch.cuda.empty_cache()
    _resource_report()


def _resource_report() -> None:
    """Registers, spills and shared memory of every compiled main-kernel variant (Triton's own report)."""
    from pagedmla.kernels.triton.decode import _decode_split_kernel

    try:
        caches = _decode_split_kernel.device_caches
        for dev_cache in caches.values():
            for key, k in dev_cache[0].items():
                print(f"# kernel regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared} key={str(key)[-160:]}")
    except Exception as e:  # the cache layout is Triton-internal: report, never fail the run
        print(f"# resource report unavailable: {type(e).__name__}: {e}")


def alternative(inp: Inputs, sms: int) -> tuple[DecodeConfig, int] | None:
    """The other main kernel for this cell, with its part count, so that one run measures both on every cell:
    where the Hopper kernel runs, the portable kernel's default tile; elsewhere the Hopper kernel (one
    64-row program per SM) when the GPU supports it."""
    rows = inp.cell.q_len * inp.cell.heads
    if select_config(inp.q[0], inp.cache[0], DV).use_sm90:
        tile_m, per_sm = tile_plan(rows)
        return default_config(rows), max(1, per_sm * sms // triton.cdiv(rows, tile_m))
    if sm90_supported(inp.q[0], inp.cache[0], DV):
        return DecodeConfig(block_m=64, use_sm90=True), max(1, sms // triton.cdiv(rows, 64))
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decode_arguments(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode: needs a CUDA GPU")
    run(args)


def run(args: argparse.Namespace, compact: bool = False) -> list[dict]:
    """Time the grid on the CUDA device, or (no CUDA) the tiny CPU grid; prints the CSV rows as they come
    and the summary table, writes ``args.csv`` / ``args.plot``. ``compact``: the summary leaves out columns
    that no cell filled. Returns the rows (column name -> value, "" where not measured). Long: the
    benchmark's whole procedure (grid loop, baselines, rows, summary) reads in one place."""
    check_plotting(args.plot)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        l2, sms = getattr(props, "L2_cache_size", 50 << 20), props.multi_processor_count
        print(f"# {props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    else:
        l2, sms = 0, 1
        print(f"# CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}, triton "
              f"{triton.__version__}; float32, tiny cells; times: {CPU_TIMER}")
    if args.sweep is not None:
        sweep(l2, [s for s in args.sweep.split(",") if s])
        return []
    # On CPU every timed call has been made once already (its output is checked); the interpreter's ~1 s
    # per call makes the quick grid time one call.
    timer = bench if cuda else functools.partial(wall_clock_us, reps=1 if args.quick else 3, warmup=False)
    with_torch = args.torch or not cuda
    header = HEADER + (TORCH_HEADER if with_torch else [])
    rows = []
    print(",".join(header), flush=True)
    for n, cell in enumerate(grid(args.quick, device)):
        inp = Inputs(cell, n, l2, device, torch.bfloat16 if cuda else torch.float32)
        timed, once, indexed = pagedmla_fn(inp)
        out = once()[0]
        graph_note = ""
        graph_cols = ["", "", ""]
        fm = None if args.no_flashmla or not cuda else _guarded("FlashMLA", flashmla_fn, inp)
        diff = cos_diff(out, fm[1]()[0]) if fm else float("nan")
        timers = [functools.partial(timer, timed)] + ([functools.partial(timer, fm[0])] if fm else [])
        graphs = cuda and (cell.b <= 8 or args.graphs)  # small batches are launch bound: time graphs too
        if graphs:
            try:
                timers += [graph_timer(indexed, len(inp.q))] + ([graph_timer(fm[2], len(inp.q))] if fm else [])
            except Exception as e:
                graphs = False
                graph_note = f"graph timing failed: {type(e).__name__}"
        times = best_of_rounds(timers, args.rounds)
        t, t_fm = times[0], times[1] if fm else float("nan")
        if graphs:
            tg, tg_fm = times[2 if fm else 1], times[3] if fm else float("nan")
            graph_note = f"graph: pagedmla {tg:.1f} us; FlashMLA {tg_fm:.1f} us; ratio {tg_fm / tg:.3f}"
            graph_cols = [round(tg, 1), round(tg_fm, 1) if fm else "", round(tg_fm / tg, 3) if fm else ""]
        if graph_note:
            print(f"# b={cell.b} h={cell.heads} {graph_note}", flush=True)
        fi = _guarded("FlashInfer", flashinfer_fn, inp) if args.flashinfer and cuda else None
        t_fi = timer(fi[0]) if fi else float("nan")
        if fi:
            fi_diff = cos_diff(out, fi[1]()[0])
            if fi_diff > 1e-5:
                print(f"# FlashInfer output differs: cos diff {fi_diff:.2e}", flush=True)
        cfg = select_config(inp.q[0], inp.cache[0], DV)
        row = [cell.b, cell.q_len, cell.heads, cell.mean, cfg.spec, round(t, 1),
               round(inp.flops / t / 1e6), round(inp.bytes / t / 1e3), round(t_fm, 1),
               round(inp.flops / t_fm / 1e6) if fm else "", round(t_fm / t, 3) if fm else "",
               round(t_fi, 1) if fi else "", round(t_fi / t, 3) if fi else "", f"{diff:.2e}", graph_note]
        alt = alternative(inp, sms) if args.alt and cuda else None
        if alt:
            a_timed, a_once, _ = pagedmla_fn(inp, alt[0], alt[1])
            a_diff = cos_diff(a_once()[0], out)
            t_alt = timer(a_timed)
            row += [f"{alt[0].spec} {alt[1]} parts", round(t_alt, 1), round(t_fm / t_alt, 3) if fm else ""]
            if a_diff > 1e-5:
                print(f"# alternative plan output differs: cos diff {a_diff:.2e}", flush=True)
        else:
            row += ["", "", ""]
        row += graph_cols
        if with_torch:
            ref_timed, ref_once, _ = torch_fn(inp)
            ref_diff = cos_diff(out, ref_once()[0])
            t_ref = timer(ref_timed)
            row += [round(t_ref, 1), round(t_ref / t, 3), f"{ref_diff:.2e}"]
        rows.append(dict(zip(header, row)))
        print(",".join(str(x) for x in row), flush=True)
        del inp
        if cuda:
            torch.cuda.empty_cache()
    _summary(rows, header, compact)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows([r[h] for h in header] for r in rows)
    if args.plot:
        _plot(rows, args.plot, CUDA_TIMER if cuda else CPU_TIMER)
    return rows


def _guarded(name: str, make: Callable, inp: Inputs):
    """A baseline that fails on this cell is reported and left out, not fatal."""
    try:
        fns = make(inp)
        if fns:
            fns[1]()
        return fns
    except Exception as e:
        print(f"# {name} failed on {inp.cell}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def _summary(rows: list[dict], header: list[str], compact: bool = False) -> None:
    """The markdown table of the run and the geometric means of ``RATIO_GROUPS``; ``compact`` drops empty
    columns."""
    columns = SUMMARY + (TORCH_SUMMARY if "torch_us" in header else [])
    if compact:
        columns = [(k, t) for k, t in columns if any(str(r[k]) not in ("", "nan") for r in rows)]
    print("\n| " + " | ".join(t for _, t in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k, _ in columns) + " |")
    for label, col in (("eager calls", "ratio_flashmla"), ("CUDA graphs", "ratio_flashmla_graph")):
        lines = ratio_lines(rows, col, label)
        if lines:
            print("\n" + "\n".join(lines))


def ratio_lines(rows: list[dict], col: str, label: str) -> list[str]:
    """One line per ``RATIO_GROUPS`` group that has figures in column ``col`` (ratios, "" where not measured):
    its geometric mean, minimum (with the cell) and cell count, ``label`` naming the timing."""
    lines = []
    for group, keep in RATIO_GROUPS:
        cells = [r for r in rows if keep(r) and r[col] != ""]
        if not cells:
            continue
        ratios = [float(r[col]) for r in cells]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        low = min(cells, key=lambda r: float(r[col]))
        lines.append(f"{group}, {label}: geometric mean FlashMLA/pagedmla {geo:.3f}, min {float(low[col]):.3f} "
                     f"({low['b']}x{low['q_len']}x{low['heads']}x{low['mean_seq']}) over {len(cells)} cells")
    return lines


def _plot(rows: list[dict], path: str, timer: str) -> None:
    """Bars of each baseline's time over pagedmla's, per cell (>1: pagedmla is faster)."""
    names = {"ratio_flashmla": "FlashMLA time / pagedmla time", "ratio_flashinfer": "FlashInfer time / pagedmla time",
             "ratio_flashmla_graph": "FlashMLA / pagedmla, CUDA graphs", "ratio_torch": "torch time / pagedmla time"}
    series = {label: [r[k] if r[k] != "" else None for r in rows]
              for k, label in names.items() if any(r.get(k, "") != "" for r in rows)}
    bar_plot(path, [f"b{r['b']} q{r['q_len']} h{r['heads']} s{r['mean_seq']}" for r in rows], series,
             "speed-up of pagedmla (>1 = faster)", f"paged MLA decode; {timer}", reference=1.0)


if __name__ == "__main__":
    main()
