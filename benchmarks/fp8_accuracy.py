"""Accuracy of the FP8 latent caches against the model's own (bf16) cache, on two models.

1. The trained tiny model (``tests/trained_tiny.py``: the ``tiny`` configuration trained to copy a periodic
   pattern, ~99.5% next-token accuracy; trained here, ~20 s on a GPU): 32 greedy tokens for five prompts
   served with each cache format. Printed per format: how many streams equal the bf16 cache's, the first
   position where each other one departs, and how many tokens continue the pattern.
2. A DeepSeek-V2-Lite-shaped model with random weights (``--preset``): one burst of requests served with the
   bf16 cache, and every attention call repeated on a shadow cache of each FP8 format (same queries, same
   latent rows stored into it, same page tables), so each layer's figure is that layer's own error from
   the cache format and never an accumulation through earlier layers. Printed per format and layer: the
   relative error ||o_fp8 - o|| / ||o|| of the attention outputs over all the burst's decode calls (the
   steps that read the cache), and over the prefill calls that read cached rows (none in a burst without
   prefix hits: MHA prefill attends the new rows directly).

    python3 benchmarks/fp8_accuracy.py [--preset v2-lite] [--skip-tiny] [--csv fp8_accuracy.csv]

``fp8_e4m3`` caches use the engine's default ``k_scale`` of 1.0. Needs CUDA for the defaults; ``--device
cpu --preset tiny --skip-tiny`` runs part 2 as a smoke test with the torch provider.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from pagedmla.bench.common import write_csv
from pagedmla.bench.engine import build_models
from pagedmla.bench.options import PRESETS
from pagedmla.cache import MLAKVCache
from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model

# The trained model's recipe lives beside the tests that use it (pagedmla/ never imports from tests/).
TESTS = Path(__file__).resolve().parents[1] / "tests"
FORMATS = ("fp8_e4m3", "fp8_ds_mla")
NEW_TOKENS = 32


def trained_tiny_greedy(workdir: Path) -> list[dict]:
    """Part 1: the trained tiny model's greedy streams with each cache format (bf16 first)."""
    sys.path.insert(0, str(TESTS))
    from trained_tiny import PERIOD, continuation, periodic_batch, train_tiny

    hf, accuracy = train_tiny("cuda")
    hf.save_pretrained(workdir)
    gen = torch.Generator().manual_seed(1)
    prompts = [periodic_batch(1, n, gen, "cpu")[0].tolist() for n in (PERIOD, 17, 40, 100, 120)]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [continuation(p, NEW_TOKENS) for p in prompts]
    streams = {}
    for fmt in ("auto", *FORMATS):
        model = load_model(workdir, device="cuda", dtype=torch.bfloat16)
        llm = LLM(model, page_size=16, max_batch_size=8, max_context_len=512, provider="triton",
                  enable_cuda_graph=True, kv_cache_dtype=fmt)
        streams[fmt] = [o.token_ids for o in llm.generate(prompts, params)]
    rows = []
    for fmt, got in streams.items():
        same = sum(a == b for a, b in zip(got, streams["auto"]))
        departs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                   for a, b in zip(got, streams["auto"])]
        right = sum(x == y for g, w in zip(got, want) for x, y in zip(g, w))
        rows.append({"part": "trained tiny", "format": fmt if fmt != "auto" else "bf16", "layer": "",
                     "decode_rel_err": "", "extend_rel_err": "",
                     "streams_equal_bf16": f"{same}/{len(prompts)}",
                     "first_departure": ",".join("-" if d is None else str(d) for d in departs),
                     "tokens_continue_pattern": f"{right}/{len(prompts) * NEW_TOKENS}",
                     "model_accuracy": f"{accuracy:.4f}"})
    return rows


def shadow_errors(preset: str, device: torch.device, provider: str, num_requests: int, prompt_len: int,
                  output_len: int) -> list[dict]:
    """Part 2: per-layer attention-output error of each FP8 format, on shadow caches beside the bf16 one."""
    model, _ = build_models(preset, device, torch.bfloat16 if device.type == "cuda" else torch.float32, 0, False)
    page = 64
    context = prompt_len + output_len + 1
    llm = LLM(model, page_size=page, max_batch_size=num_requests, max_context_len=context, provider=provider,
              num_pages=num_requests * (-(-context // page) + 1) + 1, enable_cuda_graph=False)
    runner = llm.runner
    cache = runner.cache
    shadows = {fmt: MLAKVCache(len(cache.buffers), cache.num_pages, cache.page_size, cache.kv_dim, dtype=fmt,
                               device=device) for fmt in FORMATS}
    backend = runner.backend
    real = backend.forward
    # (format, layer, kind) -> [sum of squared differences, sum of squares of the bf16 output]
    sums: dict[tuple[str, int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])

    def forward(q, k, v, layer, out_cache_loc, cache_, **kwargs):
        out = real(q, k, v, layer, out_cache_loc, cache_, **kwargs)
        kind = "decode" if backend._decode_step(backend._meta()) else "extend"
        ref = out.double()
        for fmt, shadow in shadows.items():
            diff = real(q, k, v, layer, out_cache_loc, shadow, **kwargs).double() - ref
            acc = sums[(fmt, int(layer), kind)]
            acc[0] += diff.square().sum().item()
            acc[1] += ref.square().sum().item()
        return out

    backend.forward = forward
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(2, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    layers = sorted({layer for _, layer, _ in sums})
    rows = []
    for fmt in FORMATS:
        for layer in layers:
            err = {}
            for kind in ("decode", "extend"):
                d2, r2 = sums.get((fmt, layer, kind), (0.0, 0.0))
                # MHA-form prefill reads no cached row: both outputs are the same call's, error 0 by construction.
                err[kind] = (d2 / r2) ** 0.5 if r2 else float("nan")
            rows.append({"part": f"{preset} random", "format": fmt, "layer": layer,
                         "decode_rel_err": f"{err['decode']:.3e}", "extend_rel_err": f"{err['extend']:.3e}",
                         "streams_equal_bf16": "", "first_departure": "", "tokens_continue_pattern": "",
                         "model_accuracy": ""})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="v2-lite")
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--provider", default=None, help="default: triton on CUDA, torch on CPU")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--skip-tiny", action="store_true", help="skip part 1 (the trained tiny model)")
    ap.add_argument("--workdir", default="/tmp/pagedmla_fp8_accuracy", help="where part 1 saves its checkpoint")
    ap.add_argument("--csv", help="write every row here")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.skip_tiny and device.type != "cuda":
        sys.exit("fp8_accuracy: part 1 trains the tiny model on CUDA; pass --skip-tiny on a CPU")
    provider = args.provider or ("triton" if device.type == "cuda" else "torch")
    rows = [] if args.skip_tiny else trained_tiny_greedy(Path(args.workdir))
    rows += shadow_errors(args.preset, device, provider, args.num_requests, args.prompt_len, args.output_len)
    if not args.skip_tiny:
        print("\n### trained tiny model, greedy tokens by cache format (triton, CUDA graphs, page 16)\n")
        print("| cache | streams equal to bf16's | first departure per prompt | tokens continuing the pattern |")
        print("|---|---|---|---|")
        for r in rows:
            if r["part"] == "trained tiny":
                print(f"| {r['format']} | {r['streams_equal_bf16']} | {r['first_departure']} | "
                      f"{r['tokens_continue_pattern']} |")
    shadow = [r for r in rows if r["part"] != "trained tiny"]
    print(f"\n### {args.preset} (random weights, {provider}, {device.type}): attention-output relative error "
          f"per layer, {args.num_requests} x {args.prompt_len} prompts + {args.output_len} decode steps\n")
    print("| layer | " + " | ".join(f"{f} decode" for f in FORMATS) + " |")
    print("|---|" + "---|" * len(FORMATS))
    by = {(r["format"], r["layer"]): r for r in shadow}
    layers = sorted({r["layer"] for r in shadow})
    for layer in layers:
        print(f"| {layer} | " + " | ".join(by[(f, layer)]["decode_rel_err"] for f in FORMATS) + " |")
    for f in FORMATS:
        errs = [float(by[(f, layer)]["decode_rel_err"]) for layer in layers]
        print(f"{f}: decode relative error mean {sum(errs) / len(errs):.3e}, max {max(errs):.3e} over "
              f"{len(errs)} layers")
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
