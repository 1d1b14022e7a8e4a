"""Serving benchmark: pagedmla's engine against transformers' ``generate`` on the same random-weight model.

N requests arrive together (an offline burst) with prompt / output lengths drawn uniformly from the given
ranges. For each attention provider (torch / triton / flashmla where available) and CUDA-graph setting,
the engine serves them and the run reports output tokens/s, time to first token (TTFT) and inter-token
latency (ITL) percentiles (p50 / p90 / p99), and the mean decode step time (the CUDA-graph on/off
comparison). ``--speculative mtp`` serves each configuration a second time with MTP speculative decoding
(``--num-speculative-tokens`` drafts per step from one MTP layer with random weights, sharing the
target's embedding and head) and reports its acceptance rate and tokens per request and verify step
beside plain decoding; random weights draft poorly, so this measures the cost of the draft and verify
path rather than a speed-up (``benchmarks/bench_mtp.py`` measures the trained test model's).
``--kv-cache-dtype auto,fp8_e4m3,fp8_ds_mla`` serves each configuration once per cache format: the table's
last column is the latent cache tokens one GiB holds in that format (the concurrent tokens at the same
memory), and each FP8 row's decode step and capacity are given against the model-dtype row's.
transformers then generates the same prompts greedily in left-padded batches of ``--batch-size`` (its
tokens/s counts the requested output tokens only, although it runs every row of a batch to the longest
output). ``match`` counts requests whose greedy tokens equal transformers'
(float32 should match everywhere; bf16 may part at near-ties).

    python benchmarks/bench_engine.py --preset v2-lite                     # GPU: bf16, batch 64
    python benchmarks/bench_engine.py --preset tiny --device cpu --num-requests 4 --prompt-len 8:24 \\
        --output-len 4:8 --batch-size 4                                    # CPU smoke run
    pagedmla bench engine [--quick]                                        # installed package, with a plot

Without ``--preset`` the run takes ``v2-lite`` on CUDA and ``tiny`` on CPU; workload options left unset take
the defaults of WORKLOADS for the device and ``--quick``.

Presets: ``v2-lite`` is DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads, kv_lora 512, rope 64,
nope 128, v 128, 64 routed experts top-6 + 2 shared, moe_intermediate 1408, first layer dense with
intermediate 10944, vocab 102400, YaRN rope) with random weights; ``tiny`` the same layout scaled down.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from collections.abc import Sequence

import torch

from pagedmla import kv_format
from pagedmla.bench.common import bar_plot, check_plotting, command
from pagedmla.bench.options import PRESETS, engine_arguments
from pagedmla.config import resolve_dtype
from pagedmla.engine import LLM, SamplingParams
from pagedmla.engine.mtp_drafter import MAX_DRAFT_TOKENS
from pagedmla.model.build import build_empty
from pagedmla.model.config import DeepseekConfig
from pagedmla.model.mtp import DeepseekMTP, build_empty_mtp
from pagedmla.model.random_weights import init_random_
from pagedmla.ops.providers import available_providers

# (num_requests, prompt_len, output_len, batch_size) for options left unset, by device type and --quick.
WORKLOADS = {("cuda", False): (64, "128:512", "64:256", 64), ("cuda", True): (16, "64:256", "32:64", 16),
             ("cpu", False): (8, "16:64", "8:16", 8), ("cpu", True): (4, "8:24", "4:8", 4)}


def length_range(text: str, name: str) -> tuple[int, int]:
    """A ``MIN:MAX`` (or ``N``) option of token counts as (MIN, MAX); ValueError naming the option ``name``
    unless 1 <= MIN <= MAX."""
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{name}: expected MIN:MAX (or one number), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}: expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p50, p90, p99) by nearest rank; zeros for no values."""
    if not values:
        return 0.0, 0.0, 0.0
    data = sorted(values)
    return tuple(data[min(len(data), max(1, math.ceil(q * len(data)))) - 1] for q in (0.5, 0.9, 0.99))


def build_models(preset: str, device: torch.device, dtype: torch.dtype, seed: int, with_hf: bool):
    """pagedmla's model with random weights and (optionally) transformers' model holding the same weights."""
    raw = PRESETS[preset]
    ours = init_random_(build_empty(DeepseekConfig.from_dict(raw), device, dtype), seed)
    if not with_hf:
        return ours, None
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw["model_type"], **fields), dtype=dtype)
    # Same checkpoint names and layouts (routed experts stacked in both); routers stay float32 in both.
    hf.load_state_dict(ours.state_dict())
    return ours, hf.eval()


def workload(args) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    vocab = PRESETS[args.preset]["vocab_size"]
    p_lo, p_hi = length_range(args.prompt_len, "--prompt-len")
    o_lo, o_hi = length_range(args.output_len, "--output-len")
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(p_lo, p_hi))] for _ in range(args.num_requests)]
    return prompts, [rng.randint(o_lo, o_hi) for _ in range(args.num_requests)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_mtp(model, seed: int) -> DeepseekMTP:
    """One MTP layer with random weights for ``model`` (sharing its embedding and head)."""
    weight = model.model.embed_tokens.weight
    mtp = build_empty_mtp(model.config, weight.device, weight.dtype, num_layers=1)
    mtp.share_with(model)
    return init_random_(mtp, seed)


def run_engine(model, prompts, out_lens, args, provider: str, graphs: bool, profile: bool = False,
               mtp: DeepseekMTP | None = None, kv_cache_dtype: str = "auto") -> dict:
    """Serve the burst once (after a warm-up); returns the row of the results table. ``profile``
    times every attention call with a device synchronisation on both sides (eager only); ``mtp`` drafts
    ``args.num_speculative_tokens`` tokens per step with that draft model; ``kv_cache_dtype`` is LLM's."""
    device = model.model.embed_tokens.weight.device
    context = max(map(len, prompts)) + max(out_lens) + 1
    pages_per_request = -(-context // args.page_size) + 1
    llm = LLM(model, page_size=args.page_size, num_pages=args.batch_size * pages_per_request + 1, provider=provider,
              max_batch_size=args.batch_size, max_context_len=context, enable_cuda_graph=graphs,
              max_num_batched_tokens=args.max_num_batched_tokens, mixed_batching=args.mixed,
              profile_attention=profile, kv_cache_dtype=kv_cache_dtype,
              **(dict(speculative="mtp", num_speculative_tokens=args.num_speculative_tokens, draft_model=mtp,
                      draft_graph=args.draft_graph) if mtp else {}))
    # Warm-up: the same burst on other tokens (no prefix-cache hits later), prompt and output lengths alike, so
    # that every kernel specialisation the burst reaches (the shrinking decode batches and their context
    # lengths included) is compiled before the clock starts. A warm-up of 3 output tokens let the first row of
    # a V2-Lite run (plain decoding, 26.0 ms a step) look slower than the MTP row after it (22.9 ms).
    rng = random.Random(-1)
    vocab = model.config.vocab_size
    llm.generate([[rng.randrange(2, vocab) for _ in p] for p in prompts],
                 [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens])
    llm.stats = type(llm.stats)()
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens])
    _sync(device)
    wall = time.perf_counter() - start
    ttft = [o.token_times[0] - o.arrival_time for o in outs]
    itl = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])]
    s = llm.stats
    name = f"pagedmla {provider}" + (" +graphs" if graphs else "") + \
        (f" +mtp k={args.num_speculative_tokens}" if mtp else "") + \
        (f" {kv_cache_dtype}" if kv_cache_dtype != "auto" else "")
    cache = llm.runner.cache
    # Tokens per GiB of latent cache (every layer): what the same memory holds in this format.
    cache_bytes = sum(b.numel() * b.element_size() for b in cache.buffers)
    row = {"name": name, "tokens": [o.token_ids for o in outs],
           "tok_s": sum(out_lens) / wall, "wall": wall, "ttft": percentiles(ttft), "itl": percentiles(itl),
           "step_ms": 1e3 * s.decode_seconds / max(1, s.decode_steps), "stats": s,
           "tokens_per_gib": cache.num_slots * 2 ** 30 / cache_bytes}
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_hf(hf, prompts, out_lens, args, device: torch.device) -> dict:
    """transformers' greedy generate in left-padded batches; every row runs to its batch's longest output."""
    total = 0.0
    tokens: list[list[int]] = []
    for start in range(0, len(prompts), args.batch_size):
        batch, lens = prompts[start:start + args.batch_size], out_lens[start:start + args.batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens),
                              min_new_tokens=max(lens), pad_token_id=0)
        _sync(device)
        total += time.perf_counter() - t0
        tokens += [row[width:width + n].tolist() for row, n in zip(out, lens)]
    return {"name": "transformers generate", "tokens": tokens, "tok_s": sum(out_lens) / total, "wall": total,
            "ttft": None, "itl": None, "step_ms": None, "tokens_per_gib": None}


def print_attention_profile(rows: list[dict], num_layers: int) -> None:
    """Attention calls and time per step (synchronised around each call) next to the whole step's time."""
    print("| provider | step kind | steps | attention calls / step | attention ms / step | step ms | attention share |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["stats"]
        seconds = {"extend": (s.prefill_steps, s.prefill_seconds), "decode": (s.decode_steps, s.decode_seconds),
                   "mixed": (s.mixed_steps, s.mixed_seconds)}
        for kind, calls in s.attention_calls.items():
            steps, step_s = seconds.get(kind, (0, 0.0))
            if not steps:
                continue
            attn = s.attention_seconds[kind]
            print(f"| {r['name']} | {kind} | {steps} | {calls / steps:.0f} ({num_layers} layers) | "
                  f"{1e3 * attn / steps:.3f} | {1e3 * step_s / steps:.2f} | {attn / step_s:.0%} |")


def _fmt(values) -> str:
    return " / ".join(f"{1e3 * v:.1f}" for v in values) if values else "-"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run every configuration, print the table; returns the exit status."""
    return command("bench_engine", __doc__, engine_arguments, run, argv)


def run(args: argparse.Namespace) -> int:
    """Run every configuration and print the table (``args.plot``: also a PNG of the throughputs); bad
    options raise ValueError naming the flag before anything is built. Returns the exit status."""
    check_plotting(args.plot)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: CUDA is not available")
    args.preset = args.preset or ("v2-lite" if device.type == "cuda" else "tiny")
    defaults = WORKLOADS[("cuda" if device.type == "cuda" else "cpu", args.quick)]
    for name, value in zip(("num_requests", "prompt_len", "output_len", "batch_size"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"), "--dtype")
    for name in ("num_requests", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive int")
    prompts, out_lens = workload(args)
    if args.providers:
        providers = args.providers.split(",")
    elif device.type == "cuda":
        providers = [p for p in ("torch", "triton", "flashmla") if p in available_providers("paged_decode")]
    else:
        providers = ["torch"]
    graph_mode = args.cuda_graph or ("both" if device.type == "cuda" else "off")
    if graph_mode != "off" and device.type != "cuda":
        raise ValueError("--cuda-graph: CUDA graphs need --device cuda")
    graph_settings = {"on": [True], "off": [False], "both": [False, True]}[graph_mode]
    if args.speculative and not 1 <= args.num_speculative_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-speculative-tokens: MTP drafts 1..{MAX_DRAFT_TOKENS} tokens, "
                         f"got {args.num_speculative_tokens}")
    formats = args.kv_cache_dtype.split(",")
    for f in formats:
        if f != "auto" and kv_format.fp8_storage(f) is None:
            resolve_dtype(f, "--kv-cache-dtype")
    ours, hf = build_models(args.preset, device, dtype, args.seed, not args.no_hf)
    print(f"preset {args.preset}, {device}, {str(dtype).replace('torch.', '')}: {args.num_requests} requests, "
          f"prompts {args.prompt_len}, outputs {args.output_len} tokens ({sum(out_lens)} in all), "
          f"batch {args.batch_size}, page {args.page_size}")
    mtp = random_mtp(ours, args.seed) if args.speculative == "mtp" else None
    drafts = [None, mtp] if mtp is not None else [None]
    rows = [run_engine(ours, prompts, out_lens, args, p, g, mtp=m, kv_cache_dtype=f) for p in providers
            for g in graph_settings for m in drafts for f in formats]
    if hf is not None:
        rows.append(run_hf(hf, prompts, out_lens, args, device))
    reference = rows[-1]["tokens"] if hf is not None else None
    print("| run | output tok/s | wall s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | decode step ms | match | "
          "drafts accepted | tokens / verify step | cache tokens / GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        match = "-" if reference is None or r is rows[-1] else \
            f"{sum(a == b for a, b in zip(r['tokens'], reference))}/{len(reference)}"
        step = f"{r['step_ms']:.2f}" if r["step_ms"] is not None else "-"
        s = r.get("stats")
        spec = f"{s.acceptance_rate:.1%} | {s.tokens_per_verify:.2f}" if s is not None and s.draft_tokens else "- | -"
        per_gib = f"{r['tokens_per_gib']:.0f}" if r["tokens_per_gib"] else "-"
        print(f"| {r['name']} | {r['tok_s']:.1f} | {r['wall']:.2f} | {_fmt(r['ttft'])} | {_fmt(r['itl'])} | "
              f"{step} | {match} | {spec} | {per_gib} |")
    if args.profile_attention:
        profiled = [run_engine(ours, prompts, out_lens, args, p, False, profile=True) for p in providers]
        print_attention_profile(profiled, PRESETS[args.preset]["num_hidden_layers"])
    if hf is not None:
        best = max(r["tok_s"] for r in rows[:-1])
        print(f"best engine throughput / transformers: {best / rows[-1]['tok_s']:.1f}x")
    by_name = {r["name"]: r for r in rows}
    for p in providers:
        for f in formats:
            tail = f" {f}" if f != "auto" else ""
            eager, graphed = by_name.get(f"pagedmla {p}{tail}"), by_name.get(f"pagedmla {p} +graphs{tail}")
            if eager is not None and graphed is not None:
                print(f"{p}{tail}: decode step {eager['step_ms']:.2f} ms eager, {graphed['step_ms']:.2f} ms with "
                      f"CUDA graphs ({eager['step_ms'] / graphed['step_ms']:.2f}x)")
    for r in rows:
        base = by_name.get(r["name"].rsplit(" ", 1)[0]) if r["name"].rsplit(" ", 1)[-1].startswith("fp8") else None
        if base is not None and base["step_ms"] and r["step_ms"]:
            print(f"{r['name']}: decode step {r['step_ms'] / base['step_ms']:.3f}x {base['name']}'s, "
                  f"{r['tokens_per_gib'] / base['tokens_per_gib']:.2f}x its cache tokens per GiB")
    if args.plot:
        bar_plot(args.plot, [r["name"] for r in rows], {"output tokens/s": [r["tok_s"] for r in rows]},
                 "output tokens/s", f"engine, preset {args.preset}, {device}, {args.num_requests} requests "
                 "(wall clock, after a warm-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
