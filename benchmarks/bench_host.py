"""Host cost of eager calls on the GPU: pagedmla's public calls and backend steps beside FlashMLA's C++ call.

Calls: ``flash_mla_with_kvcache`` on four decode cells (FlashMLA's beside each), ``get_mla_metadata``,
``flash_attn_varlen_func`` on three ragged cells and ``flash_mla_varlen_with_kvcache`` on one paged prefill cell;
and one decode, ragged and paged cell again with its lengths passed as a slice 4 bytes off a 16-byte boundary
(``buf[1:]``, as an engine passing a view of its lengths does), which has a bound launch of its own.
Host µs per call: wall time of ``n`` back-to-back calls issued without waiting (few enough that CUDA's launch
queue never fills, so the host is never held up by the GPU), divided by ``n``; best of five rounds (the host
is shared and noisy). GPU µs: the same calls captured in a CUDA graph and replayed (no host in the way),
``triton.testing.do_bench`` median (for get_mla_metadata that is its tensor-op form, which a capture runs;
eagerly it is one Triton launch). A call is host bound where its host µs exceed its GPU µs.

Steps: a DeepSeek-V3-shaped eager decode step (61 layers, 16 heads per rank, batch 64, mean context 4096:
one plan, then per layer the latent store and the decode attention) and an eager prefill step (61 layers of
ragged MHA over 8 prompts of 1024 tokens with their latent stores), through ``MLABackend`` as an engine
drives it.

    python3 benchmarks/bench_host.py [--csv out.csv] [--no-flashmla] [--profile]
"""

from __future__ import annotations

import argparse
import csv
import time

import torch
import triton

import pagedmla
from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend
from pagedmla.cache import MLAKVCache
from pagedmla.config import MLAConfig

D, DV, PAGE = 576, 512, 64


def host_us(fn, n: int = 200, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def gpu_us(fn, reps: int = 8) -> float:
    """Median µs of ``fn`` as a CUDA-graph replay (``reps`` calls per graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1e3 / reps


def decode_inputs(b: int, q_len: int, heads: int, mean: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.normal(float(mean), mean / 2, (b,), generator=g).clamp(min=q_len).int()
    pages = (lens + PAGE - 1) // PAGE
    total = int(pages.sum()) + 1
    perm = torch.randperm(total - 1, generator=g) + 1
    width = int(pages.max())
    table = torch.zeros(b, width, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(pages.tolist()):
        table[i, :n] = perm[cursor:cursor + n].int()
        cursor += n
    cache = (torch.randn(total, PAGE, 1, D, generator=g) / 10).clamp(-1, 1).bfloat16().cuda()
    q = (torch.randn(b, q_len, heads, D, generator=g) / 10).bfloat16().cuda()
    return q, cache, table.cuda(), lens.cuda()


def _sliced(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as ``buf[1:]`` of a buffer one element longer: 4 bytes off a 16-byte boundary."""
    return torch.cat([t[:1], t])[1:]


def _decode_row(b: int, q_len: int, heads: int, mean: int, use_flashmla: bool, sliced: bool = False) -> dict:
    """``sliced``: the lengths are ``buf[1:]`` of a longer buffer (4 bytes off a 16-byte boundary), as an engine
    passing a view of its lengths does."""
    q, cache, table, lens = decode_inputs(b, q_len, heads, mean)
    if sliced:
        lens = _sliced(lens)
    meta, splits = pagedmla.get_mla_metadata(lens, q_len * heads, 1)

    def ours():
        return pagedmla.flash_mla_with_kvcache(q, cache, table, lens, DV, meta, splits, causal=True)

    row = {"call": f"flash_mla_with_kvcache {b}x{q_len}x{heads}x{mean}" + (" lens[1:]" if sliced else ""),
           "host_us": host_us(ours),
           "gpu_us": gpu_us(ours)}
    if use_flashmla:
        import flash_mla

        sched, _ = flash_mla.get_mla_metadata()

        def theirs():
            return flash_mla.flash_mla_with_kvcache(q, cache, table, lens, DV, sched, None, causal=True,
                                                    use_legacy=True)

        theirs()
        row["flashmla_host_us"], row["flashmla_gpu_us"] = host_us(theirs), gpu_us(theirs)
    return row


def _varlen_row(b: int, length: int, heads: int, sliced: bool = False) -> dict:
    t = b * length
    qm = (torch.randn(t, heads, 192, device="cuda") / 10).bfloat16()
    km = (torch.randn(t, heads, 192, device="cuda") / 10).bfloat16()
    vm = (torch.randn(t, heads, 128, device="cuda") / 10).bfloat16()
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda")
    cu = _sliced(cu) if sliced else cu

    def fn():
        return pagedmla.flash_attn_varlen_func(qm, km, vm, cu, cu, length, length, causal=True)

    return {"call": f"flash_attn_varlen_func {b}x{length}x{heads}" + (" cu[1:]" if sliced else ""),
            "host_us": host_us(fn, n=50), "gpu_us": gpu_us(fn, reps=2)}


def _paged_row(b: int, new: int, heads: int, mean: int, sliced: bool = False) -> dict:
    """The paged (absorbed) prefill: ``new`` tokens of each of ``b`` requests over a cache of mean length ``mean``."""
    q, cache, table, lens = decode_inputs(b, new, heads, mean)
    lens = _sliced(lens) if sliced else lens
    q = q.view(b * new, heads, D)
    qo = torch.arange(0, b * new + 1, new, dtype=torch.int32, device="cuda")

    def fn():
        return pagedmla.flash_mla_varlen_with_kvcache(q, cache, table, lens, qo, DV, causal=True)

    return {"call": f"flash_mla_varlen_with_kvcache {b}x{new}x{heads}x{mean}" + (" lens[1:]" if sliced else ""),
            "host_us": host_us(fn, n=50), "gpu_us": gpu_us(fn, reps=2)}


def public_calls(use_flashmla: bool) -> list[dict]:
    rows = [_decode_row(*cell, use_flashmla) for cell in ((1, 1, 128, 4096), (8, 1, 128, 4096), (128, 1, 16, 1024),
                                                          (64, 4, 16, 4096))]
    rows.append(_decode_row(128, 1, 16, 1024, use_flashmla, sliced=True))
    lens = torch.randint(1, 8192, (64,), dtype=torch.int32, device="cuda")
    rows.append({"call": "get_mla_metadata 64x16", "host_us": host_us(lambda: pagedmla.get_mla_metadata(lens, 16, 1)),
                 "gpu_us": gpu_us(lambda: pagedmla.get_mla_metadata(lens, 16, 1))})
    return rows + [_varlen_row(8, 4096, 16), _varlen_row(256, 128, 16), _varlen_row(8, 512, 16),
                   _varlen_row(8, 512, 16, sliced=True), _paged_row(8, 128, 16, 4096),
                   _paged_row(8, 128, 16, 4096, sliced=True)]


def step_costs(profile: bool) -> list[dict]:
    """The two engine steps of the module docstring, host and GPU µs per step (GPU: the layers' calls as a
    CUDA-graph replay, planned once); ``profile`` prints a cProfile of five decode steps."""
    layers, heads, bs, mean = 61, 16, 64, 4096
    cfg = MLAConfig(num_heads=heads, page_size=PAGE, dtype=torch.bfloat16, max_context_len=16384, max_batch_size=bs,
                    num_layers=layers)
    backend = MLABackend(cfg, device="cuda", provider="triton")
    q, cache1, table, lens = decode_inputs(bs, 1, heads, mean)
    num_pages = cache1.shape[0]
    cache = MLAKVCache(layers, num_pages, PAGE, D, torch.bfloat16, "cuda")
    for buf in cache.buffers:
        buf.copy_(cache1.view(-1, 1, D))
    slots = torch.arange(bs, device="cuda")
    lens_cpu = lens.tolist()
    loc = (table[torch.arange(bs, device="cuda"), (lens.long() - 1) // PAGE].long() * PAGE
           + (lens.long() - 1) % PAGE)
    qd = q.view(bs, heads, D)
    latent = (torch.randn(bs, 1, D, device="cuda") / 10).bfloat16()

    def decode_step():
        backend.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, slots, lens, table, seq_lens_cpu=lens_cpu))
        for layer in range(layers):
            backend.forward(qd, latent, None, layer, loc, cache)

    def decode_layers():
        for layer in range(layers):
            backend.forward(qd, latent, None, layer, loc, cache)

    decode_step()
    torch.cuda.synchronize()
    rows = [{"call": f"backend decode step {layers} layers {bs}x{heads}x{mean}", "host_us": host_us(decode_step, n=5),
             "gpu_us": gpu_us(decode_layers, reps=1)}]
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            decode_step()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)

    b, length = 8, 1024
    t = b * length
    cfg = MLAConfig(num_heads=heads, page_size=PAGE, dtype=torch.bfloat16, max_context_len=4096, max_batch_size=b,
                    num_layers=layers)
    backend = MLABackend(cfg, device="cuda", provider="triton")
    pages = length // PAGE
    pcache = MLAKVCache(layers, b * pages + 1, PAGE, D, torch.bfloat16, "cuda")
    ptable = (torch.arange(b * pages, dtype=torch.int32, device="cuda") + 1).view(b, pages)
    ploc = torch.arange(PAGE, (b * pages + 1) * PAGE, device="cuda")
    qm = (torch.randn(t, heads, 192, device="cuda") / 10).bfloat16()
    km = (torch.randn(t, heads, 192, device="cuda") / 10).bfloat16()
    vm = (torch.randn(t, heads, 128, device="cuda") / 10).bfloat16()
    plat = (torch.randn(t, D, device="cuda") / 10).bfloat16()
    plens = torch.full((b,), length, dtype=torch.int32, device="cuda")

    def prefill_step():
        backend.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, torch.arange(b, device="cuda"), plens, ptable,
                                                   seq_lens_cpu=[length] * b, extend_seq_lens_cpu=[length] * b,
                                                   extend_prefix_lens_cpu=[0] * b))
        for layer in range(layers):
            backend.forward(qm, km, vm, layer, ploc, pcache, latent=plat)

    def prefill_layers():
        for layer in range(layers):
            backend.forward(qm, km, vm, layer, ploc, pcache, latent=plat)

    prefill_step()
    torch.cuda.synchronize()
    rows.append({"call": f"backend prefill step {layers} layers {b}x{length}x{heads}",
                 "host_us": host_us(prefill_step, n=2, rounds=3), "gpu_us": gpu_us(prefill_layers, reps=1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the decode step's host time")
    args = ap.parse_args()
    use_flashmla = not args.no_flashmla
    if use_flashmla:
        try:
            import flash_mla  # noqa: F401
        except ImportError:
            use_flashmla = False
    rows = public_calls(use_flashmla) + step_costs(args.profile)
    print(f"{'call':<52} {'host us':>9} {'GPU us':>9} {'FlashMLA host':>14} {'FlashMLA GPU':>13}")
    for r in rows:
        fm = (f"{r['flashmla_host_us']:>14.1f} {r['flashmla_gpu_us']:>13.1f}" if "flashmla_host_us" in r else "")
        print(f"{r['call']:<52} {r['host_us']:>9.1f} {r['gpu_us']:>9.1f} {fm}")
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
