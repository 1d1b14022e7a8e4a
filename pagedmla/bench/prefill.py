"""Prefill benchmarks: ragged MHA (192/128), paged absorbed prefill, merge_state, with baselines in one run.

Ragged grid (ANCHORS): causal, q/k 192, v 128, bf16; pagedmla's default kernel choice (``triton``: the
Hopper kernel on sm_90) and the portable Triton kernel (``triton_portable``; several tile variants with
--variants) against torch SDPA and, with --flashinfer, FlashInfer fa3 ragged prefill
(``BatchPrefillWithRaggedKVCacheWrapper(..., backend="fa3")``).
SDPA gets the equal-length batch as [b, H, L, D] views of the same packed tensors (no copies), q/k 192 and
v 128 as they are; the backend torch picks is printed. Causal FLOPs = 2·b·H·L(L+1)/2·(192+128).
Skewed ragged batches (one long prompt among many short ones, as chunked-prefill batches are): the same
kernels and fa3 on packed sequences of unequal lengths; the reference is SDPA per sequence (not timed).
Paged absorbed prefill: requests of n new tokens over p cached ones (page size 64, permuted pages),
576/512, one KV head, against FlashInfer's ``BatchMLAPagedAttentionWrapper(backend="fa3")`` with
qo_indptr; ``triton`` (default choice) and ``triton_portable`` as above.
FLOPs = 2·H·Σ_rows(visible keys)·(576+512).
merge_state: GB/s (bytes read + written) against a device-to-device copy measured in the same run.

Timing: ``triton.testing.do_bench`` median on random data (randn/10 clamped). Every input set is several
times the 60 MB L2. Usage: python benchmarks/bench_prefill.py [--flashinfer] [--variants] [--quick]
[--csv PATH].
"""

from __future__ import annotations

import argparse
import csv
import functools
import sys
import time

import torch
import triton

from pagedmla.kernels.triton import merge as tmerge
from pagedmla.kernels.triton import paged_prefill as tpaged
from pagedmla.kernels.triton import varlen as tvarlen

RAGGED_GRID = [(1, 8192, 128), (4, 4096, 128), (16, 1024, 128), (8, 4096, 16), (1, 32768, 16)]
RAGGED_VARIANTS = {
    "m128n64w8s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "m128n64w8s4": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
    "m128n128w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
}
# (long prompt, short prompts, their length, heads): causal, 192/128
SKEWED_GRID = [(4096, 63, 64, 128), (16384, 127, 128, 16)]
PAGED_GRID = [(8, 1024, 4096, 128), (8, 1024, 4096, 16)]  # (requests, new tokens, cached tokens, heads)
PAGED_VARIANTS = {
    "m64n64w8s2": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    "m64n32w8s3": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
}
MERGE_GRID = [(8192, 128, 128), (8192, 16, 512)]  # (tokens, heads, head dim)
PAGE = 64

rows: list[dict] = []


def timed(fn) -> float:
    """Median milliseconds of fn() (CUDA events)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rnd(*shape) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") / 10).clamp_(-1, 1).bfloat16()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record(section: str, cell: str, impl: str, ms: float | None, value: float | None, unit: str, note: str = ""):
    rows.append({"section": section, "cell": cell, "impl": impl, "ms": ms, "value": value, "unit": unit, "note": note})
    shown = "failed" if ms is None else f"{ms:8.3f} ms {value:7.1f} {unit}"
    print(f"  {impl:<22} {shown} {note}", flush=True)


def try_variant(section, cell, name, fn, flops, check):
    try:
        out = fn()
        torch.cuda.synchronize()
        err = check(out)
        ms = timed(fn)
        record(section, cell, name, ms, flops / ms / 1e9, "TFLOP/s", f"rel_err={err:.1e}")
        return ms
    except Exception as exc:  # a variant that does not compile (shared memory) or fails is reported, not fatal
        record(section, cell, name, None, None, "TFLOP/s", f"{type(exc).__name__}: {str(exc)[:100]}")
        return None


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
    print("\n== ragged prefill, causal, q/k 192, v 128, bf16 ==", flush=True)
    grid = RAGGED_GRID[:2] + RAGGED_GRID[3:4] if args.quick else RAGGED_GRID
    variants = {"triton": None, "triton_portable": {"HOPPER": False}}
    if args.variants:
        variants.update({name: {**cfg, "HOPPER": False} for name, cfg in RAGGED_VARIANTS.items()})
    for b, seqlen, h in grid:
        ragged_cell(b, seqlen, h, variants, fi_workspace)
        torch.cuda.empty_cache()


def ragged_cell(b, seqlen, h, variants, fi_workspace):
    cell = f"{b}x{seqlen} H{h}"
    print(cell, flush=True)
    t = b * seqlen
    q, k, v = rnd(t, h, 192), rnd(t, h, 192), rnd(t, h, 128)
    cu = torch.arange(0, t + 1, seqlen, device="cuda", dtype=torch.int32)
    scale = 192 ** -0.5
    flops = 2 * b * h * seqlen * (seqlen + 1) / 2 * (192 + 128)
    qs, ks, vs = (x.view(b, seqlen, h, x.shape[-1]).transpose(1, 2) for x in (q, k, v))

    def sdpa(vs):
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    note = f"v 128 as is; usable={sdpa_backend_name(qs, ks, vs)}"
    try:
        ref = sdpa(vs)
    except RuntimeError:  # no backend takes v narrower than q/k: pad v to 192 and drop the extra columns
        vs = torch.nn.functional.pad(vs, (0, 64))
        ref = sdpa(vs)[..., :128]
        note = "v padded to 192"
    ref = ref.transpose(1, 2).reshape(t, h, 128)
    ms = timed(lambda: sdpa(vs))
    record("ragged", cell, "torch_sdpa", ms, flops / ms / 1e9, "TFLOP/s", note)
    time_ragged("ragged", cell, q, k, v, cu, seqlen, flops, ref, variants, fi_workspace)


def time_ragged(section, cell, q, k, v, cu, max_len, flops, ref, variants, fi_workspace):
    """pagedmla's variants and (with a workspace) FlashInfer fa3 on one causal 192/128 ragged batch."""
    t, h = q.shape[:2]
    scale = 192 ** -0.5
    out = torch.empty(t, h, 128, device="cuda", dtype=torch.bfloat16)
    for name, cfg in variants.items():
        try_variant(section, cell, name, functools.partial(
            tvarlen.varlen_attention, q, k, v, cu, cu, max_len, max_len, scale, True, out, config=cfg),
            flops, lambda o: rel(o[0], ref))
    if fi_workspace is not None:
        import flashinfer

        wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(fi_workspace, "NHD", backend="fa3")
        wrapper.plan(cu, cu, h, h, 192, head_dim_vo=128, causal=True, sm_scale=scale, q_data_type=torch.bfloat16)
        try_variant(section, cell, "flashinfer_fa3", lambda: wrapper.run(q, k, v), flops, lambda o: rel(o, ref))


def bench_skewed(fi_workspace):
    print("\n== skewed ragged batches, causal, q/k 192, v 128, bf16 ==", flush=True)
    for long, n, short, h in SKEWED_GRID:
        skewed_cell(long, n, short, h, fi_workspace)
        torch.cuda.empty_cache()


def skewed_cell(long, n, short, h, fi_workspace):
    cell = f"1x{long}+{n}x{short} H{h}"
    print(cell, flush=True)
    lens = [long] + [short] * n
    t = sum(lens)
    q, k, v = rnd(t, h, 192), rnd(t, h, 192), rnd(t, h, 128)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    scale = 192 ** -0.5
    flops = sum(2 * h * n * (n + 1) / 2 * (192 + 128) for n in lens)
    ref = torch.empty(t, h, 128, device="cuda", dtype=torch.bfloat16)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[lo:hi].transpose(0, 1).float() for x in (q, k, v))
        ref[lo:hi] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1).bfloat16()
    time_ragged("skewed", cell, q, k, v, cu, long, flops, ref, {"triton": None, "triton_portable": {"HOPPER": False}},
                fi_workspace)


def bench_paged(args, fi_workspace):
    print("\n== paged absorbed prefill, causal, 576/512, page 64, bf16 ==", flush=True)
    variants = {"triton": None, "triton_portable": {"HOPPER": False}}
    if args.variants:
        variants.update({name: {**cfg, "HOPPER": False} for name, cfg in PAGED_VARIANTS.items()})
    for b, new, cached, h in PAGED_GRID:
        paged_cell(b, new, cached, h, variants, fi_workspace)
        torch.cuda.empty_cache()


def paged_cell(b, new, cached, h, variants, fi_workspace):
    cell = f"{b}x{new} over {cached} H{h}"
    print(cell, flush=True)
    kv_len = new + cached
    pages_per = triton.cdiv(kv_len, PAGE)
    num_pages = b * pages_per + 1
    cache = rnd(num_pages, PAGE, 1, 576)
    block_table = (torch.randperm(num_pages - 1, device="cuda")[: b * pages_per] + 1).int().view(b, pages_per)
    lens = torch.full((b,), kv_len, device="cuda", dtype=torch.int32)
    qo = torch.arange(0, b * new + 1, new, device="cuda", dtype=torch.int32)
    q = rnd(b * new, h, 576)
    scale = 192 ** -0.5
    visible = b * sum(cached + i + 1 for i in range(new))
    flops = 2 * h * visible * (576 + 512)
    base = tpaged.paged_varlen_attention(q, cache, block_table, lens, qo, 512, scale, True, new)[0]
    if fi_workspace is not None:
        import flashinfer

        ckv = cache[:, :, 0, :512].contiguous()
        kpe = cache[:, :, 0, 512:].contiguous()
        q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
        kv_indptr = torch.arange(0, b * pages_per + 1, pages_per, device="cuda", dtype=torch.int32)
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(fi_workspace, backend="fa3")
        wrapper.plan(qo, kv_indptr, block_table.flatten(), lens, h, 512, 64, PAGE, True, scale,
                     torch.bfloat16, torch.bfloat16)
        try_variant("paged", cell, "flashinfer_mla_fa3", lambda: wrapper.run(q_nope, q_pe, ckv, kpe), flops,
                    lambda o: rel(o, base))
    for name, cfg in variants.items():
        try_variant("paged", cell, name, functools.partial(
            tpaged.paged_varlen_attention, q, cache, block_table, lens, qo, 512, scale, True, new, config=cfg),
            flops, lambda o: rel(o[0], base))


def bench_merge():
    print("\n== merge_state, bf16 ==", flush=True)
    copy_gbs = copy_ceiling()
    for t, h, d in MERGE_GRID:
        merge_cell(t, h, d, copy_gbs)
        torch.cuda.empty_cache()


def copy_ceiling() -> float:
    """Device-to-device copy of 1 GiB: GB/s counting bytes read plus written."""
    x = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x))
    gbs = 2 * x.numel() * 2 / ms / 1e6
    record("merge", "copy 1 GiB", "torch_copy", ms, gbs, "GB/s", "ceiling")
    return gbs


def merge_cell(t, h, d, copy_gbs):
    cell = f"T{t} H{h} D{d}"
    v_a, v_b = rnd(t, h, d), rnd(t, h, d)
    s_a, s_b = torch.randn(t, h, device="cuda") * 3, torch.randn(t, h, device="cuda") * 3
    nbytes = 3 * v_a.numel() * 2 + 3 * t * h * 4
    out, out_lse = torch.empty_like(v_a), torch.empty_like(s_a)
    for name, fn in (
        ("triton", lambda: tmerge.merge_state(v_a, s_a, v_b, s_b, out, out_lse)),
        ("triton_in_place", lambda: tmerge.merge_state(v_a, s_a, v_b, s_b, v_a, s_a)),
    ):
        ms = timed(fn)
        gbs = nbytes / ms / 1e6
        record("merge", cell, name, ms, gbs, "GB/s", f"{gbs / copy_gbs:.0%} of copy")


def summary():
    print("\n== summary (ratio = pagedmla's default kernel choice, 'triton', / baseline, same run) ==")
    cells = dict.fromkeys((r["section"], r["cell"]) for r in rows)
    for section, cell in cells:
        sel = [r for r in rows if (r["section"], r["cell"]) == (section, cell) and r["value"] is not None]
        mine = [r for r in sel if r["impl"].startswith("triton") or r["impl"].startswith("m")]
        if not mine:
            continue
        best = next((r for r in mine if r["impl"] == "triton"), mine[0])
        parts = [f"{section:<6} {cell:<22} {best['impl']} {best['value']:7.1f} {best['unit']}"]
        for r in sel:
            if r not in mine and r["impl"] != "torch_copy":
                parts.append(f"{r['impl']} {r['value']:.1f} -> x{best['value'] / r['value']:.2f}")
        print(" | ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashinfer", action="store_true", help="also time FlashInfer fa3 (JIT compiles 30-80 s)")
    parser.add_argument("--variants", action="store_true", help="time several Triton tile configurations")
    parser.add_argument("--quick", action="store_true", help="fewer cells")
    parser.add_argument("--csv", metavar="PATH", help="write every measurement to PATH")
    parser.add_argument("--only", choices=("ragged", "skewed", "paged", "merge"), action="append",
                        help="run only these parts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__},"
          f" {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.flashinfer else None
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
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    summary()


if __name__ == "__main__":
    main()
