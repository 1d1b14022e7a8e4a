"""Prefill benchmarks: ragged MHA (192/128), paged absorbed prefill, merge_state, with baselines in one run.

Ragged grid (the long-prompt cells plus the short-prompt batches): causal, q/k 192, v 128, bf16; pagedmla's public call
with its defaults, eager, as a user makes it (``triton``: checks, output allocation and the default kernel
choice, the Hopper kernel on sm_90) and the portable Triton kernel (``triton_portable``; several tile
variants with --variants) against torch SDPA and, with --flashinfer, FlashInfer fa3 ragged prefill
(``BatchPrefillWithRaggedKVCacheWrapper(..., backend="fa3")``).
SDPA gets the equal-length batch as [b, H, L, D] views of the same packed tensors (no copies), q/k 192 and
v 128 as they are; the backend torch picks is printed. Causal FLOPs = 2·b·H·L(L+1)/2·(192+128).
Skewed ragged batches (one long prompt among many short ones, as chunked-prefill batches are): the same
kernels and fa3 on packed sequences of unequal lengths; the reference is SDPA per sequence (not timed).
Paged absorbed prefill: requests of n new tokens over p cached ones (page size 64, permuted pages),
576/512, one KV head, against FlashInfer's ``BatchMLAPagedAttentionWrapper(backend="fa3")`` with
qo_indptr; ``triton`` (the public call with its defaults) and ``triton_portable`` as above.
FLOPs = 2·H·Σ_rows(visible keys)·(576+512).
merge_state: GB/s (bytes read + written) against a device-to-device copy measured in the same run.

Timing: ``triton.testing.do_bench`` median on random data (randn/10 clamped); with ``--rounds N`` each cell's
implementations are timed in turn N times and each keeps its best. Every input set is several times the 60 MB
L2. Usage: python benchmarks/bench_prefill.py [--flashinfer] [--variants] [--quick] [--rounds N] [--csv PATH],
or ``pagedmla bench prefill`` from an installed package (with a plot).
On CPU the grids are a few tiny float32 cells, the Triton kernels run under the interpreter, the paged
cells also time the torch reference provider, and a wall-clock median times every call: a smoke run of
the path, labelled as such.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import triton

from pagedmla.bench.common import (
    CPU_TIMER,
    CUDA_TIMER,
    bar_plot,
    best_of_rounds,
    check_plotting,
    wall_clock_us,
    write_csv,
)
from pagedmla.bench.options import prefill_arguments
from pagedmla.kernels.triton import merge as tmerge
from pagedmla.kernels.triton import paged_varlen as tpaged
from pagedmla.kernels.triton import varlen as tvarlen
from pagedmla.kernels.triton.common import PrefillConfig
from pagedmla.ops.attention import flash_attn_varlen_func, flash_mla_varlen_with_kvcache

# (prompts, length, heads); the short-prompt cells are the batches an engine's prefill steps send most often.
RAGGED_GRID = [(1, 8192, 128), (4, 4096, 128), (16, 1024, 128), (8, 4096, 16), (1, 32768, 16),
               (32, 2048, 128), (32, 2048, 16), (64, 512, 128), (64, 512, 16), (256, 128, 128), (256, 128, 16)]
RAGGED_VARIANTS = {
    "m128n64w8s3": PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "m128n64w8s4": PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=4),
    "m128n128w8s2": PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
}
# (long prompt, short prompts, their length, heads): causal, 192/128
SKEWED_GRID = [(4096, 63, 64, 128), (16384, 127, 128, 16)]
# (requests, new tokens, cached tokens, heads). The 128-head cells at 64 x 512 and 256 x 128 tokens hold 2^31 query
# elements, where FlashInfer 0.6.18's MLA output is wrong (NaN on these inputs, relative error 0.71 on another
# draw: benchmarks/NOTES.md, Prefill - paged); the same shapes at half the batch are where it is right.
PAGED_GRID = [(8, 1024, 4096, 128), (8, 1024, 4096, 16), (64, 512, 1024, 128), (32, 512, 1024, 128),
              (64, 512, 1024, 16), (256, 128, 1024, 128), (128, 128, 1024, 128), (256, 128, 1024, 16)]
# A baseline whose output is this far from the cell's reference (relative error: pagedmla's output in the paged
# cells, SDPA's in the ragged ones; bf16 rounding gives ~3e-3) computed something else: the summary shows its time
# but no ratio.
WRONG_OUTPUT = 0.05
PAGED_VARIANTS = {
    "m64n64w8s2": PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
    "m64n32w8s3": PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=3),
}
MERGE_GRID = [(8192, 128, 128), (8192, 16, 512)]  # (tokens, heads, head dim)
# The CPU run's tiny grids (the interpreter takes seconds per kernel call).
CPU_RAGGED_GRID = [(2, 64, 2)]
CPU_SKEWED_GRID = [(64, 3, 8, 2)]
CPU_PAGED_GRID = [(2, 16, 48, 2)]
CPU_MERGE_GRID = [(256, 4, 64)]
PAGE = 64

rows: list[dict] = []
# Timing passes per cell (``--rounds``), set by ``run``.
rounds = 1
# The run's device and data type: CUDA and bf16 as the script runs; ``run`` picks CPU / float32 without CUDA.
device = torch.device("cuda")
dtype = torch.bfloat16


def timed(fn) -> float:
    """Median milliseconds of fn() (CUDA events; on CPU a wall-clock median of one call after a warm-up)."""
    if device.type != "cuda":
        return wall_clock_us(fn, reps=1) / 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rnd(*shape) -> torch.Tensor:
    return (torch.randn(*shape, device=device) / 10).clamp_(-1, 1).to(dtype)


def dtype_name() -> str:
    return {torch.bfloat16: "bf16", torch.float32: "float32"}[dtype]


def default_variants() -> dict[str, PrefillConfig | None]:
    """pagedmla's default kernel choice and (on CUDA, where the default may be a Hopper kernel) the portable one."""
    if device.type != "cuda":
        return {"triton": None}
    return {"triton": None, "triton_portable": PrefillConfig(use_sm90=False)}


def empty_cache() -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record(section: str, cell: str, impl: str, ms: float | None, value: float | None, unit: str, note: str = "",
           err: float | None = None):
    rows.append({"section": section, "cell": cell, "impl": impl, "ms": ms, "value": value, "unit": unit, "note": note,
                 "err": err})
    shown = "failed" if ms is None else f"{ms:8.3f} ms {value:7.1f} {unit}"
    print(f"  {impl:<22} {shown} {note}", flush=True)


class CellTimer:
    """One cell's implementations: each run and checked once when added, then all timed in turn ``rounds``
    times (``run``), each keeping its best (``common.best_of_rounds``): the GPU's clock falls under sustained
    load, and runs that timed each implementation once moved single cells by up to 19% between runs of the same
    tree (benchmarks/NOTES.md, Prefill - paged)."""

    def __init__(self, section: str, cell: str, flops: float):
        self.section, self.cell, self.flops = section, cell, flops
        self.entries: list[tuple[str, Callable[[], object], str, float | None]] = []

    def add(self, name: str, fn: Callable[[], object], check: Callable[[object], float] | None = None,
            note: str = "") -> None:
        """``fn`` as implementation ``name``; ``check(output)`` gives its relative error (shown, and in the
        row's ``err``). One that fails or does not compile (shared memory) is reported, not fatal."""
        try:
            out = fn()
            err = check(out) if check is not None else None
        except Exception as exc:
            record(self.section, self.cell, name, None, None, "TFLOP/s", f"{type(exc).__name__}: {str(exc)[:100]}")
            return
        self.entries.append((name, fn, note if err is None else f"rel_err={err:.1e}", err))

    def run(self) -> None:
        best = best_of_rounds([functools.partial(timed, fn) for _, fn, _, _ in self.entries], rounds)
        for (name, _, note, err), ms in zip(self.entries, best):
            record(self.section, self.cell, name, ms, self.flops / ms / 1e9, "TFLOP/s", note, err)


def sdpa_backend_name(q, k, v) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    usable = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q[:, :, :128], k[:, :, :128], v[:, :, :128],
                                                                 is_causal=True)
            usable.append(backend.name)
        except RuntimeError:
            pass
    return "/".join(usable)


def bench_ragged(args, fi_workspace):
    print(f"\n== ragged prefill, causal, q/k 192, v 128, {dtype_name()} ==", flush=True)
    grid = CPU_RAGGED_GRID if device.type != "cuda" else RAGGED_GRID[:2] + RAGGED_GRID[3:4] if args.quick \
        else RAGGED_GRID
    variants = default_variants()
    if args.variants:
        variants.update(RAGGED_VARIANTS)
    for b, seqlen, h in grid:
        ragged_cell(b, seqlen, h, variants, fi_workspace)
        empty_cache()


def ragged_cell(b, seqlen, h, variants, fi_workspace):
    cell = f"{b}x{seqlen} H{h}"
    print(cell, flush=True)
    t = b * seqlen
    q, k, v = rnd(t, h, 192), rnd(t, h, 192), rnd(t, h, 128)
    cu = torch.arange(0, t + 1, seqlen, device=device, dtype=torch.int32)
    scale = 192 ** -0.5
    flops = 2 * b * h * seqlen * (seqlen + 1) / 2 * (192 + 128)
    qs, ks, vs = (x.view(b, seqlen, h, x.shape[-1]).transpose(1, 2) for x in (q, k, v))

    def sdpa(vs):
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    usable = sdpa_backend_name(qs, ks, vs) if device.type == "cuda" else "math (CPU)"
    note = f"v 128 as is; usable={usable}"
    try:
        ref = sdpa(vs)
    except RuntimeError:  # no backend takes v narrower than q/k: pad v to 192 and drop the extra columns
        vs = torch.nn.functional.pad(vs, (0, 64))
        ref = sdpa(vs)[..., :128]
        note = "v padded to 192"
    ref = ref.transpose(1, 2).reshape(t, h, 128)
    timer = CellTimer("ragged", cell, flops)
    timer.add("torch_sdpa", lambda: sdpa(vs), note=note)
    add_ragged(timer, q, k, v, cu, seqlen, ref, variants, fi_workspace)
    timer.run()


def add_ragged(timer, q, k, v, cu, max_len, ref, variants, fi_workspace):
    """pagedmla's variants and (with a workspace) FlashInfer fa3 on one causal 192/128 ragged batch."""
    t, h = q.shape[:2]
    scale = 192 ** -0.5
    out = torch.empty(t, h, 128, device=device, dtype=dtype)
    for name, cfg in variants.items():
        if cfg is None:  # the default choice: the public call as a user makes it (its checks, its allocation)
            fn = functools.partial(flash_attn_varlen_func, q, k, v, cu, cu, max_len, max_len, scale, True)
        else:
            fn = functools.partial(tvarlen.varlen_attention, q, k, v, cu, cu, max_len, max_len, scale, True, out,
                                   config=cfg)
        timer.add(name, fn, lambda o, public=cfg is None: rel(o if public else o[0], ref))
    if fi_workspace is not None:
        import flashinfer

        wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(fi_workspace, "NHD", backend="fa3")
        wrapper.plan(cu, cu, h, h, 192, head_dim_vo=128, causal=True, sm_scale=scale, q_data_type=torch.bfloat16)
        timer.add("flashinfer_fa3", lambda: wrapper.run(q, k, v), lambda o: rel(o, ref))


def bench_skewed(fi_workspace):
    print(f"\n== skewed ragged batches, causal, q/k 192, v 128, {dtype_name()} ==", flush=True)
    for long, n, short, h in CPU_SKEWED_GRID if device.type != "cuda" else SKEWED_GRID:
        skewed_cell(long, n, short, h, fi_workspace)
        empty_cache()


def skewed_cell(long, n, short, h, fi_workspace):
    cell = f"1x{long}+{n}x{short} H{h}"
    print(cell, flush=True)
    lens = [long] + [short] * n
    t = sum(lens)
    q, k, v = rnd(t, h, 192), rnd(t, h, 192), rnd(t, h, 128)
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    scale = 192 ** -0.5
    flops = sum(2 * h * n * (n + 1) / 2 * (192 + 128) for n in lens)
    ref = torch.empty(t, h, 128, device=device, dtype=dtype)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[lo:hi].transpose(0, 1).float() for x in (q, k, v))
        ref[lo:hi] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1).to(dtype)
    timer = CellTimer("skewed", cell, flops)
    add_ragged(timer, q, k, v, cu, long, ref, default_variants(), fi_workspace)
    timer.run()


def bench_paged(args, fi_workspace):
    print(f"\n== paged absorbed prefill, causal, 576/512, page 64, {dtype_name()} ==", flush=True)
    variants = default_variants()
    if args.variants:
        variants.update(PAGED_VARIANTS)
    for b, new, cached, h in CPU_PAGED_GRID if device.type != "cuda" else PAGED_GRID:
        paged_cell(b, new, cached, h, variants, fi_workspace)
        empty_cache()


def paged_cell(b, new, cached, h, variants, fi_workspace):
    cell = f"{b}x{new} over {cached} H{h}"
    print(cell, flush=True)
    kv_len = new + cached
    pages_per = triton.cdiv(kv_len, PAGE)
    num_pages = b * pages_per + 1
    cache = rnd(num_pages, PAGE, 1, 576)
    block_table = (torch.randperm(num_pages - 1, device=device)[: b * pages_per] + 1).int().view(b, pages_per)
    lens = torch.full((b,), kv_len, device=device, dtype=torch.int32)
    qo = torch.arange(0, b * new + 1, new, device=device, dtype=torch.int32)
    q = rnd(b * new, h, 576)
    scale = 192 ** -0.5
    visible = b * sum(cached + i + 1 for i in range(new))
    flops = 2 * h * visible * (576 + 512)
    base = tpaged.paged_varlen_attention(q, cache, block_table, lens, qo, 512, scale, True, new)[0]
    timer = CellTimer("paged", cell, flops)
    if fi_workspace is not None:
        import flashinfer

        ckv = cache[:, :, 0, :512].contiguous()
        kpe = cache[:, :, 0, 512:].contiguous()
        q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
        kv_indptr = torch.arange(0, b * pages_per + 1, pages_per, device=device, dtype=torch.int32)
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(fi_workspace, backend="fa3")
        wrapper.plan(qo, kv_indptr, block_table.flatten(), lens, h, 512, 64, PAGE, True, scale,
                     torch.bfloat16, torch.bfloat16)
        timer.add("flashinfer_mla_fa3", lambda: wrapper.run(q_nope, q_pe, ckv, kpe), lambda o: rel(o, base))
    if device.type != "cuda":
        timer.add("torch_reference", functools.partial(
            flash_mla_varlen_with_kvcache, q, cache, block_table, lens, qo, 512, softmax_scale=scale,
            causal=True, provider="torch"), lambda o: rel(o[0], base))
    for name, cfg in variants.items():
        if cfg is None:  # the default choice: the public call as a user makes it
            fn = functools.partial(flash_mla_varlen_with_kvcache, q, cache, block_table, lens, qo, 512,
                                   softmax_scale=scale, causal=True, max_q_len=new)
        else:
            fn = functools.partial(tpaged.paged_varlen_attention, q, cache, block_table, lens, qo, 512, scale,
                                   True, new, config=cfg)
        timer.add(name, fn, lambda o: rel(o[0], base))
    timer.run()


def bench_merge():
    print(f"\n== merge_state, {dtype_name()} ==", flush=True)
    copy_gbs = copy_ceiling()
    for t, h, d in CPU_MERGE_GRID if device.type != "cuda" else MERGE_GRID:
        merge_cell(t, h, d, copy_gbs)
        empty_cache()


def copy_ceiling() -> float:
    """Device-to-device copy of 1 GiB (CPU: 16 MiB): GB/s counting bytes read plus written."""
    x = torch.empty(1 << 29 if device.type == "cuda" else 1 << 23, device=device, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x))
    gbs = 2 * x.numel() * 2 / ms / 1e6
    record("merge", "copy 1 GiB", "torch_copy", ms, gbs, "GB/s", "ceiling")
    return gbs


def merge_cell(t, h, d, copy_gbs):
    cell = f"T{t} H{h} D{d}"
    v_a, v_b = rnd(t, h, d), rnd(t, h, d)
    s_a, s_b = torch.randn(t, h, device=device) * 3, torch.randn(t, h, device=device) * 3
    nbytes = 3 * v_a.numel() * v_a.element_size() + 3 * t * h * 4
    out, out_lse = torch.empty_like(v_a), torch.empty_like(s_a)
    for name, fn in (
        ("triton", lambda: tmerge.merge_state(v_a, s_a, v_b, s_b, out, out_lse)),
        ("triton_in_place", lambda: tmerge.merge_state(v_a, s_a, v_b, s_b, v_a, s_a)),
    ):
        ms = timed(fn)
        gbs = nbytes / ms / 1e6
        record("merge", cell, name, ms, gbs, "GB/s", f"{gbs / copy_gbs:.0%} of copy")


def summary() -> dict[str, dict[str, float]]:
    """Prints each cell's pagedmla value and its ratio to every baseline; returns the ratios
    ({baseline: {"section cell": ratio}}, > 1: pagedmla is faster) for the plot."""
    print("\n== summary (ratio = pagedmla's default kernel choice, 'triton', / baseline, same run) ==")
    ratios: dict[str, dict[str, float]] = defaultdict(dict)
    cells = dict.fromkeys((r["section"], r["cell"]) for r in rows)
    for section, cell in cells:
        sel = [r for r in rows if (r["section"], r["cell"]) == (section, cell) and r["value"] is not None]
        mine = [r for r in sel if r["impl"].startswith("triton") or r["impl"].startswith("m")]
        if not mine:
            continue
        best = next((r for r in mine if r["impl"] == "triton"), mine[0])
        parts = [f"{section:<6} {cell:<22} {best['impl']} {best['value']:7.1f} {best['unit']}"]
        for r in sel:
            if r in mine or r["impl"] == "torch_copy":
                continue
            if r["err"] is not None and not r["err"] <= WRONG_OUTPUT:  # NaN included
                parts.append(f"{r['impl']} {r['value']:.1f} (output wrong, rel err {r['err']:.2g}: no ratio)")
                continue
            parts.append(f"{r['impl']} {r['value']:.1f} -> x{best['value'] / r['value']:.2f}")
            ratios[r["impl"]][f"{section} {cell}"] = best["value"] / r["value"]
        print(" | ".join(parts))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prefill_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA GPU")
    run(args)


def run(args: argparse.Namespace) -> list[dict]:
    """Every part asked for on the CUDA device, or (no CUDA) the tiny CPU grids; prints each measurement
    and the summary, writes ``args.csv`` and ``args.plot`` (a PNG of the ratios). Returns the rows."""
    global device, dtype, rounds
    check_plotting(args.plot)
    rounds = args.rounds
    rows.clear()
    if torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
              f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    else:
        device, dtype = torch.device("cpu"), torch.float32
        print(f"CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}, triton {triton.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M')}; tiny cells, times: {CPU_TIMER}", flush=True)
    flashinfer = args.flashinfer and device.type == "cuda"
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device) if flashinfer else None
    parts = args.only or ["ragged", "skewed", "paged", "merge"]
    if "merge" in parts:
        bench_merge()
    if "paged" in parts:
        bench_paged(args, workspace)
    if "ragged" in parts:
        bench_ragged(args, workspace)
    if "skewed" in parts:
        bench_skewed(workspace)
    if args.csv:
        write_csv(args.csv, rows)
    ratios = summary()
    if args.plot:
        labels = list(dict.fromkeys(c for per in ratios.values() for c in per))
        bar_plot(args.plot, labels, {impl: [per.get(c) for c in labels] for impl, per in ratios.items()},
                 "baseline time / pagedmla time (>1 = faster)",
                 f"prefill and merge; {CUDA_TIMER if device.type == 'cuda' else CPU_TIMER}", reference=1.0)
    return list(rows)


if __name__ == "__main__":
    main()
