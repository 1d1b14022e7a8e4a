"""FP8 latent caches against bf16 rows: decode, paged prefill and the quantise-on-store cost, one process.

Decode: the decode grid (``pagedmla.bench.decode.grid``: its lengths, permuted block tables, page 64, causal,
rotated input copies). Each cell's bf16 cache is quantised to ``fp8_e4m3`` (``k_scale`` fitted over the
rows) and to ``fp8_ds_mla``; pagedmla's public ``flash_mla_with_kvcache`` runs on all three, FlashMLA's bf16
decode (``flash_mla``, when installed) on the bf16 rows. Times are CUDA-graph replays (16 calls per graph
over the rotated copies, ``do_bench`` median per call), with ``--eager`` also the eager calls. Columns:
``flashmla/fp8`` = FlashMLA's bf16 time / the FP8 time (above 1: the FP8 cache is faster), ``bf16/fp8`` the
same against pagedmla's bf16 rows. ``cos`` checks each FP8 output against the torch reference provider on
the same FP8 cache (cos diff; a failed check prints ``BAD`` and makes the exit status 1).

Paged prefill: ``pagedmla.bench.prefill.PAGED_GRID`` (b requests of ``new`` tokens over ``cached``, causal),
``flash_mla_varlen_with_kvcache`` eager on bf16 and both FP8 caches (milliseconds per call: the host path
adds nothing measurable), ``bf16/fp8`` as above.

Skewed paged prefill: one long request among short ones (``SKEWED_GRID``: b requests of ``new`` tokens, the
first over ``long`` cached tokens, the rest over ``short``), where a dequantised workspace of one page per
block-table entry (b x the longest request's pages) passes ``paged_varlen.DEQUANT_MAX_BYTES`` and the call
runs the portable kernel; with the pages the host lengths span (``kv_page_indptr``, as ``MLABackend`` plans
it) the Hopper kernel runs over a workspace of those pages. ``flash_mla_varlen_with_kvcache`` eager on bf16 rows and
on both FP8 caches, each with and without the layout; ``cos`` as above for every FP8 variant.

Extend forms: one layer's EXTEND step over a cached prefix (``FORMS_B`` requests of ``FORMS_PREFIX`` cached
tokens, each of ``FORMS_NEW`` new tokens, ``FORMS_HEADS`` heads) through ``MLABackend``, in the absorbed form
(with the model's q absorption and output projection) and the chunked form (with the prefix's decompression),
eager, on every cache format: where ``MLAConfig.chunked_prefix_min_extend`` should put the switch.

Store: ``MLAKVCache.store`` of one decode step's rows (128, 576 wide, bf16 in) into one layer of each cache
format, against one decode call of 128 x 1 x 16 heads x 4096 on the same format (both as graphs): the store's
share of the attention work of a decode step, per layer (the whole step, with the model's matmuls, is
larger, so the share of the step is smaller).

    python3 benchmarks/bench_fp8.py [--quick] [--eager] [--only decode|prefill|skewed|store|forms] [--match SUBSTRING]
        [--csv fp8.csv]

``--match`` keeps the decode cells whose name (``b x q_len x heads x mean_seq``, e.g. ``128x1x16x4096``)
holds one of its strings.

On a machine without CUDA the same runs as a smoke test on tiny cells (float16, wall clock, no graphs).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import sys
from collections.abc import Callable

import torch
import triton

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend
from pagedmla.bench import decode as bdecode
from pagedmla.bench import prefill as bprefill
from pagedmla.bench.common import fp8_caches, wall_clock_us
from pagedmla.cache import MLAKVCache
from pagedmla.config import MLAConfig
from pagedmla.ops.attention import flash_mla_varlen_with_kvcache, flash_mla_with_kvcache
from pagedmla.ops.schedule import get_mla_metadata

D, DV, PAGE = bdecode.D, bdecode.DV, bdecode.PAGE
FORMATS = ("fp8_e4m3", "fp8_ds_mla")
COS_LIMIT = 1e-5  # the conformance suite's bound for FP8 caches against the reference on the same bytes
STORE_ROWS = 128
STORE_CELL = bdecode.Cell(128, 1, 16, 4096)
# The extend-forms part: requests, cached tokens, heads (a TP-sharded rank) and new tokens per request.
FORMS_B, FORMS_PREFIX, FORMS_HEADS, FORMS_NEW = 8, 4096, 16, (16, 32, 64, 128, 256)
CPU_PREFILL_GRID = [(2, 16, 48, 16)]
# Skewed paged prefill: (requests, new tokens each, the first request's cached tokens, the others', heads).
SKEWED_GRID = [(32, 16, 32768, 1024, 16), (32, 64, 32768, 1024, 128)]
CPU_SKEWED_GRID = [(3, 4, 100, 20, 2)]


def cuda() -> bool:
    return torch.cuda.is_available()


def timed(fn: Callable[[], object]) -> float:
    """Median µs of fn: ``do_bench`` (L2 flushed) on CUDA, a wall-clock median elsewhere."""
    return bdecode.bench(fn) if cuda() else wall_clock_us(fn, reps=1)


def cos_check(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    diff = bdecode.cos_diff(out, ref)
    return diff, math.isfinite(diff) and diff < COS_LIMIT


def decode_cell(cell: bdecode.Cell, eager: bool, l2_bytes: int, dtype: torch.dtype) -> dict:
    device = torch.device("cuda" if cuda() else "cpu")
    inp = bdecode.Inputs(cell, seed=0, l2_bytes=l2_bytes, device=device, dtype=dtype)
    copies = len(inp.q)
    caches = {"bf16": [(c, {}) for c in inp.cache]}
    for c in inp.cache:
        for fmt, pair in fp8_caches(c).items():
            caches.setdefault(fmt, []).append(pair)
    # Each format's schedule planned for it, as the backend plans (fp8_e4m3 up to 16 rows: two parts per SM).
    schedules = {fmt: get_mla_metadata(inp.seqlens, cell.q_len * cell.heads, 1, kv_format=fmt) for fmt in caches}

    def call_for(fmt: str) -> Callable[[int], torch.Tensor]:
        meta, splits = schedules[fmt]

        def call(i: int) -> torch.Tensor:
            cache, kw = caches[fmt][i]
            return flash_mla_with_kvcache(inp.q[i], cache, inp.table, inp.seqlens, DV, meta, splits, causal=True,
                                          **kw)[0]
        return call

    row = {"cell": f"{cell.b}x{cell.q_len}x{cell.heads}x{cell.mean}"}
    ok = True
    for fmt, call in {f: call_for(f) for f in caches}.items():
        if fmt != "bf16":
            cache, kw = caches[fmt][0]
            ref = flash_mla_with_kvcache(inp.q[0], cache, inp.table, inp.seqlens, DV, *schedules[fmt], causal=True,
                                         provider="torch", **kw)[0]
            row[f"cos_{fmt}"], good = cos_check(call(0), ref)
            ok &= good
            del ref
        if cuda():
            row[f"{fmt}_graph_us"] = bdecode.bench_graph(call, copies)
        if eager or not cuda():
            row[f"{fmt}_eager_us"] = timed(lambda call=call: call(inp.next()))
    flashmla = bdecode.flashmla_fn(inp) if cuda() else None
    if flashmla is not None:
        rotating, _, fcall = flashmla
        row["flashmla_graph_us"] = bdecode.bench_graph(lambda i: fcall(i)[0], copies)
        if eager:
            row["flashmla_eager_us"] = timed(rotating)
    row["ok"] = ok
    return row


def prefill_cell(b: int, new: int, cached: int, h: int, dtype: torch.dtype) -> dict:
    device = torch.device("cuda" if cuda() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    pages_per = triton.cdiv(new + cached, PAGE)
    num_pages = b * pages_per + 1
    cache = (torch.randn(num_pages, PAGE, 1, D, device=device, generator=g) / 10).to(dtype)
    table = (torch.randperm(num_pages - 1, device=device, generator=g)[: b * pages_per] + 1).int().view(b, pages_per)
    lens = torch.full((b,), new + cached, device=device, dtype=torch.int32)
    qo = torch.arange(0, b * new + 1, new, device=device, dtype=torch.int32)
    q = (torch.randn(b * new, h, D, device=device, generator=g) / 10).to(dtype)
    row = {"cell": f"{b}x{new} over {cached} h{h}"}
    ok = True
    formats = {"bf16": (cache, {})} | fp8_caches(cache)
    for fmt, (c, kw) in formats.items():
        def fn(c=c, kw=kw):
            return flash_mla_varlen_with_kvcache(q, c, table, lens, qo, DV, softmax_scale=D ** -0.5, causal=True,
                                                 max_q_len=new, **kw)[0]
        if fmt != "bf16":
            ref = flash_mla_varlen_with_kvcache(q, c, table, lens, qo, DV, softmax_scale=D ** -0.5, causal=True,
                                                max_q_len=new, provider="torch", **kw)[0]
            row[f"cos_{fmt}"], good = cos_check(fn(), ref)
            ok &= good
            del ref
        row[f"{fmt}_eager_us"] = timed(fn)
    row["ok"] = ok
    return row


def skewed_cell(b: int, new: int, long: int, short: int, h: int, dtype: torch.dtype) -> dict:
    """One skewed paged prefill cell (``SKEWED_GRID``): µs per eager call of each cache format, FP8 with and
    without ``kv_page_indptr``, and each FP8 output's cos diff to the torch reference on its cache."""
    device = torch.device("cuda" if cuda() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    lens = [long + new] + [short + new] * (b - 1)
    spans = [triton.cdiv(n, PAGE) for n in lens]
    width, total = max(spans), sum(spans)
    cache = (torch.randn(total + 1, PAGE, 1, D, device=device, generator=g) / 10).to(dtype)
    ids = (torch.randperm(total, device=device, generator=g) + 1).int().split(spans)
    table = torch.zeros(b, width, dtype=torch.int32, device=device)  # past a request's pages: the reserved page
    for r, pages in enumerate(ids):
        table[r, : pages.numel()] = pages
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    qo = torch.arange(0, b * new + 1, new, device=device, dtype=torch.int32)
    q = (torch.randn(b * new, h, D, device=device, generator=g) / 10).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32, device=device)
    row = {"cell": f"{b}x{new} over {long} / {short} h{h}"}
    ok = True
    for fmt, (c, kw) in ({"bf16": (cache, {})} | fp8_caches(cache)).items():
        call = functools.partial(flash_mla_varlen_with_kvcache, q, c, table, seqlens, qo, DV, softmax_scale=D ** -0.5,
                                 causal=True, max_q_len=new, **kw)
        variants = {"": {}} if fmt == "bf16" else {"_table": {}, "_spans": dict(kv_page_indptr=indptr,
                                                                                  num_kv_pages=total)}
        ref = None if fmt == "bf16" else flash_mla_varlen_with_kvcache(
            q, c, table, seqlens, qo, DV, softmax_scale=D ** -0.5, causal=True, provider="torch", **kw)[0]
        for name, extra in variants.items():
            fn = functools.partial(call, **extra)
            if ref is not None:
                row[f"cos_{fmt}{name}"], good = cos_check(fn()[0], ref)
                ok &= good
            row[f"{fmt}{name}_eager_us"] = timed(fn)
        del ref
    row["ok"] = ok
    return row


def store_rows_cost(dtype: torch.dtype) -> list[dict]:
    """Per format: one layer's store of STORE_ROWS rows and, on CUDA, one decode call on STORE_CELL."""
    device = torch.device("cuda" if cuda() else "cpu")
    cell = STORE_CELL if cuda() else bdecode.Cell(4, 1, 16, 128)
    inp = bdecode.Inputs(cell, seed=1, l2_bytes=0, device=device, dtype=dtype)
    rows = (torch.randn(STORE_ROWS, D, device=device) / 10).to(dtype)
    out = []
    for fmt, (cache, kw) in ({"bf16": (inp.cache[0], {})} | fp8_caches(inp.cache[0])).items():
        meta, splits = get_mla_metadata(inp.seqlens, cell.q_len * cell.heads, 1, kv_format=fmt)
        store = MLAKVCache(1, inp.num_pages, PAGE, D, dtype=dtype if fmt == "bf16" else fmt, device=device)
        slots = torch.randperm(store.num_slots, device=device)[:STORE_ROWS]
        def put(i: int = 0, store=store, slots=slots) -> None:
            store.store(0, slots, rows)
        # As a graph on CUDA, like the decode call beside it: the GPU's time, not the launch path's.
        store_us = bdecode.bench_graph(put, 1) if cuda() else timed(put)
        row = {"cell": f"store {STORE_ROWS} rows, {fmt}", "store_us": store_us,
               "decode_cell": f"{cell.b}x{cell.q_len}x{cell.heads}x{cell.mean}"}

        def call(i: int, cache=cache, kw=kw, meta=meta, splits=splits) -> torch.Tensor:
            return flash_mla_with_kvcache(inp.q[0], cache, inp.table, inp.seqlens, DV, meta, splits, causal=True,
                                          **kw)[0]
        row["decode_us"] = bdecode.bench_graph(call, 1) if cuda() else timed(lambda call=call: call(0))
        row["share"] = row["store_us"] / row["decode_us"]
        out.append(row)
    return out


def _extend_step(backend: MLABackend, form: str, x: dict) -> torch.Tensor:
    """One layer's EXTEND in ``form`` on the tensors ``x`` (``extend_forms_cost``), planned already: an
    engine plans a step once for all its layers."""
    t, heads = x["q_nope"].shape[:2]
    if form == "absorbed":
        q = torch.cat([torch.einsum("thn,hnc->thc", x["q_nope"], x["w_kc"]), x["q_pe"]], -1)
        o = backend.forward(q, x["latent"][:, None], None, 0, x["loc"], x["cache"])
        return torch.einsum("thc,hcv->thv", o.view(t, heads, DV), x["w_vc"])
    q = torch.cat([x["q_nope"], x["q_pe"]], -1)
    return backend.forward(q, x["k"], x["v"], 0, x["loc"], x["cache"], latent=x["latent"],
                           kv_decompress=x["decompress"])


def extend_forms_cost(dtype: torch.dtype) -> list[dict]:
    """Per cache format and new-token count: one layer's EXTEND over a cached prefix in the absorbed form (the
    paged kernel on the cache, with the model's q absorption and output projection around it) and in the
    chunked form (ragged MHA over the new tokens, then the prefix gathered, decompressed and attended), through
    ``MLABackend`` as an engine calls it, eager, the step planned once (not timed). Where the chunked form
    gets cheaper is what ``MLAConfig.chunked_prefix_min_extend`` should say for that format."""
    device = torch.device("cuda" if cuda() else "cpu")
    b, prefix, heads = (FORMS_B, FORMS_PREFIX, FORMS_HEADS) if cuda() else (2, 40, 4)
    news = FORMS_NEW if cuda() else (4,)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, device=device, generator=g) / 10).to(dtype)

    w_kv = rnd(DV, heads * 256)  # latent -> k_nope, v (the chunked form's decompression)

    def decompress(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = (rows[:, :DV] @ w_kv).view(-1, heads, 256)
        return torch.cat([kv[..., :128], rows[:, None, DV:].expand(-1, heads, -1)], -1), kv[..., 128:]

    # q_nope -> latent and latent -> v: the absorbed form's projections around the kernel.
    x = {"w_kc": rnd(heads, 128, DV), "w_vc": rnd(heads, DV, 128), "decompress": decompress}
    out = []
    for fmt in ("bf16", *FORMATS):
        pages_per = triton.cdiv(prefix + max(news), PAGE)
        x["cache"] = MLAKVCache(1, b * pages_per + 1, PAGE, D, dtype=dtype if fmt == "bf16" else fmt, device=device)
        table = (torch.randperm(b * pages_per, device=device, generator=g) + 1).int().view(b, pages_per)
        slots = (table.long()[:, :, None] * PAGE + torch.arange(PAGE, device=device)).view(b, -1)
        x["cache"].store(0, slots[:, :prefix].reshape(-1), rnd(b * prefix, D))
        for new in news:
            lens = torch.full((b,), prefix + new, device=device, dtype=torch.int32)
            batch = ForwardBatch(ForwardMode.EXTEND, torch.arange(b, device=device), lens, table,
                                 seq_lens_cpu=[prefix + new] * b, extend_seq_lens_cpu=[new] * b,
                                 extend_prefix_lens_cpu=[prefix] * b)
            x.update(loc=slots[:, prefix:prefix + new].reshape(-1), q_nope=rnd(b * new, heads, 128),
                     q_pe=rnd(b * new, heads, D - DV), latent=rnd(b * new, D))
            x["k"], x["v"] = decompress(x["latent"])
            row = {"cell": f"{fmt} {b}x{new} over {prefix} h{heads}"}
            for form in ("absorbed", "chunked"):
                cfg = MLAConfig(num_heads=heads, page_size=PAGE, dtype=dtype,
                                kv_cache_dtype=None if fmt == "bf16" else fmt, max_context_len=pages_per * PAGE,
                                max_batch_size=b, num_layers=1, extend_prefix_mode=form)
                backend = MLABackend(cfg, device=device, provider="triton")
                backend.init_forward_metadata(batch)
                step = functools.partial(_extend_step, backend, form, x)
                step()
                row[f"{form}_us"] = timed(step)
            out.append(row)
            print(f"extend forms {row['cell']}: absorbed {row['absorbed_us']:.1f} us, chunked "
                  f"{row['chunked_us']:.1f} us", flush=True)
    return out


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.3f}"


def print_decode(rows: list[dict], mode: str) -> None:
    print(f"\n### decode, {mode} (µs per call; ratios: baseline time / FP8 time)\n")
    print("| b×q×H×seq | FlashMLA bf16 | pagedmla bf16 | fp8_e4m3 | fp8_ds_mla | flashmla/e4m3 | flashmla/ds_mla | "
          "bf16/e4m3 | bf16/ds_mla | cos e4m3 / ds_mla |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fm, bf = r.get(f"flashmla_{mode}_us"), r.get(f"bf16_{mode}_us")
        e4, ds = r.get(f"fp8_e4m3_{mode}_us"), r.get(f"fp8_ds_mla_{mode}_us")
        flag = "" if r["ok"] else " BAD"
        print(f"| {r['cell']} | {_fmt(fm)} | {_fmt(bf)} | {_fmt(e4)} | {_fmt(ds)} | {_ratio(fm, e4)} | "
              f"{_ratio(fm, ds)} | {_ratio(bf, e4)} | {_ratio(bf, ds)} | {r['cos_fp8_e4m3']:.1e} / "
              f"{r['cos_fp8_ds_mla']:.1e}{flag} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the decode grid's quick cells, two prefill cells")
    ap.add_argument("--eager", action="store_true", help="also time the eager decode calls")
    ap.add_argument("--only", choices=("decode", "prefill", "skewed", "store", "forms"), action="append",
                    help="run only these parts")
    ap.add_argument("--match", action="append", metavar="SUBSTRING",
                    help="only the decode cells whose name holds one of these (repeatable)")
    ap.add_argument("--csv", metavar="PATH", help="write every row's figures to PATH")
    args = ap.parse_args(argv)
    parts = args.only or ["decode", "prefill", "skewed", "store", "forms"]
    dtype = torch.bfloat16 if cuda() else torch.float16  # the interpreter's dot is wrong for bf16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda() else 0
    where = torch.cuda.get_device_name() if cuda() else "CPU (smoke run: tiny cells, wall clock)"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}, {dtype}", flush=True)
    rows: list[dict] = []
    decode_rows, prefill_rows = [], []
    if "decode" in parts:
        device = torch.device("cuda" if cuda() else "cpu")
        for cell in bdecode.grid(args.quick, device):
            if args.match and not any(m in f"{cell.b}x{cell.q_len}x{cell.heads}x{cell.mean}" for m in args.match):
                continue
            decode_rows.append(decode_cell(cell, args.eager, l2, dtype))
            print(f"decode {decode_rows[-1]['cell']} done", flush=True)
            if cuda():
                torch.cuda.empty_cache()
    if "prefill" in parts:
        grid = bprefill.PAGED_GRID if cuda() else CPU_PREFILL_GRID
        for b, new, cached, h in grid[:2] if args.quick else grid:
            prefill_rows.append(prefill_cell(b, new, cached, h, dtype))
            print(f"prefill {prefill_rows[-1]['cell']} done", flush=True)
    skewed_rows = []
    if "skewed" in parts:
        for cell in SKEWED_GRID if cuda() else CPU_SKEWED_GRID:
            skewed_rows.append(skewed_cell(*cell, dtype))
            print(f"skewed {skewed_rows[-1]['cell']} done", flush=True)
    store_rows = store_rows_cost(dtype) if "store" in parts else []
    form_rows = extend_forms_cost(dtype) if "forms" in parts else []
    if decode_rows:
        print_decode(decode_rows, "graph" if cuda() else "eager")
        if args.eager and cuda():
            print_decode(decode_rows, "eager")
        for base in ("flashmla", "bf16"):
            for fmt in FORMATS:
                ratios = [r[f"{base}_graph_us"] / r[f"{fmt}_graph_us"] for r in decode_rows
                          if r.get(f"{base}_graph_us") and r.get(f"{fmt}_graph_us")]
                if ratios:
                    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
                    print(f"{base} / {fmt} as graphs: geomean {geo:.3f}, min {min(ratios):.3f}, "
                          f"max {max(ratios):.3f} over {len(ratios)} cells")
    if prefill_rows:
        print("\n### paged prefill, eager (µs per call; ratio: bf16 time / FP8 time)\n")
        print("| cell | bf16 | fp8_e4m3 | fp8_ds_mla | bf16/e4m3 | bf16/ds_mla | cos e4m3 / ds_mla |")
        print("|---|---|---|---|---|---|---|")
        for r in prefill_rows:
            bf, e4, ds = r["bf16_eager_us"], r["fp8_e4m3_eager_us"], r["fp8_ds_mla_eager_us"]
            print(f"| {r['cell']} | {bf:.1f} | {e4:.1f} | {ds:.1f} | {bf / e4:.3f} | {bf / ds:.3f} | "
                  f"{r['cos_fp8_e4m3']:.1e} / {r['cos_fp8_ds_mla']:.1e}{'' if r['ok'] else ' BAD'} |")
    if skewed_rows:
        print("\n### skewed paged prefill, eager (µs per call): FP8 with a workspace per table entry (table) or "
              "per spanned page (spans)\n")
        print("| cell | bf16 | e4m3 table | e4m3 spans | ds_mla table | ds_mla spans | bf16 / spans e4m3, ds_mla |")
        print("|---|---|---|---|---|---|---|")
        for r in skewed_rows:
            bf = r["bf16_eager_us"]
            e4, ds = r["fp8_e4m3_spans_eager_us"], r["fp8_ds_mla_spans_eager_us"]
            print(f"| {r['cell']} | {bf:.1f} | {r['fp8_e4m3_table_eager_us']:.1f} | {e4:.1f} | "
                  f"{r['fp8_ds_mla_table_eager_us']:.1f} | {ds:.1f} | {bf / e4:.3f}, {bf / ds:.3f}"
                  f"{'' if r['ok'] else ' BAD'} |")
    if store_rows:
        print(f"\n### store of one step's rows vs one decode call ({store_rows[0]['decode_cell']}), per layer\n")
        print("| store | store µs | decode µs | store / decode |")
        print("|---|---|---|---|")
        for r in store_rows:
            print(f"| {r['cell']} | {r['store_us']:.1f} | {r['decode_us']:.1f} | {100 * r['share']:.1f}% |")
    if form_rows:
        print("\n### EXTEND over a cached prefix, one layer, eager: absorbed vs chunked form (µs per step)\n")
        print("| cell | absorbed | chunked | absorbed / chunked |")
        print("|---|---|---|---|")
        for r in form_rows:
            print(f"| {r['cell']} | {r['absorbed_us']:.1f} | {r['chunked_us']:.1f} | "
                  f"{r['absorbed_us'] / r['chunked_us']:.3f} |")
    rows = decode_rows + prefill_rows + skewed_rows + store_rows + form_rows
    if args.csv and rows:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    bad = [r["cell"] for r in decode_rows + prefill_rows + skewed_rows if not r["ok"]]
    if bad:
        print(f"\nBAD: FP8 outputs off the reference in {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
