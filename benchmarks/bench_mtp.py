"""MTP speculative decoding on the tiny model with a trained MTP layer: its speed-up over plain decoding, and
the draft-graph choice (one CUDA graph for the k - 1 draft decodes, or one per step) by measurement.

    python3 benchmarks/bench_mtp.py --csv mtp.csv        # GPU: bf16, batch 1 and 32, CUDA graphs and eager
    python3 benchmarks/bench_mtp.py --quick              # GPU: batch 32, CUDA graphs only, one timed run
    python3 benchmarks/bench_mtp.py --device cpu         # CPU smoke run: float32, eager, K = 1, 2

The run first makes the model (``tests/trained_tiny.py``, ``write_trained_mtp_checkpoint``: the tiny
configuration's random target with its LM head fitted so that its greedy tokens follow a successor chain,
and its MTP layer trained to predict the target's next choice; the MTP layer trains on ``--train-device``,
seconds on a GPU), or loads one written before (``--checkpoint DIR``). For each batch size of
``--batch-sizes`` the same greedy workload (``--num-requests`` chain prompts of the training task, so that
acceptance is that of a draft layer trained for its target) is then served by the engine with plain
decoding and with MTP for each K of ``--ks``: with CUDA graphs once per draft-graph mode of
``--draft-graphs`` (K = 1 has no draft decodes, so one row), and eagerly (``--cuda-graph both``, the default
on CUDA; eager MTP has no draft graphs, so one row per K).

Each configuration's engine is built (its graphs captured), serves the workload once to warm up (compiles,
kernel specialisations), then ``--repeats`` times more, timed: the wall clock of ``LLM.generate`` with a
device synchronisation before and after it and none added inside (the engine reads each step's tokens back
itself). Training, graph capture and warm-up are outside the clock. Columns: output tok/s = output tokens /
the median wall time; speed-up = that over plain decoding's at the same batch size and graph setting;
acceptance = accepted / proposed draft tokens; tokens / verify step = what a request gains from one verify
step (its accepted drafts + the target's own token, ``EngineStats.tokens_per_verify``); decode step ms = the
engine's mean step time over decode and verify steps (an MTP step's draft decodes and draft extend
included); greedy = plain: requests whose greedy tokens in every timed run equal plain decoding's (first
run) in the same setting. Mismatches are listed after the table and make the exit status 1.

Needs the test extra (pytest, and transformers with ``MtpLayer``), which ``tests/trained_tiny.py`` imports.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from pagedmla.bench.common import command
from pagedmla.bench.engine import length_range
from pagedmla.config import resolve_dtype
from pagedmla.engine import LLM, EngineStats, SamplingParams
from pagedmla.engine.mtp_drafter import DRAFT_GRAPH_MODES, MAX_DRAFT_TOKENS
from pagedmla.model import load_model, load_mtp
from pagedmla.model.mtp import DeepseekMTP

# The trained model's recipe lives beside the tests that use it (pagedmla/ never imports from tests/).
TESTS = Path(__file__).resolve().parents[1] / "tests"
# (batch sizes, prompt lengths, output lengths, timed runs, K list) for options left unset, by device type
# and --quick. Prompt + output stay within ~1.5x the 128 positions the model was trained on (its chain holds
# well past them: acceptance 0.96-1.0 at 200 positions on CPU).
DEFAULTS = {("cuda", False): ("1,32", "16:48", "64:128", 3, "1,2,3,4"),
            ("cuda", True): ("32", "16:48", "32:64", 1, "1,2,3,4"),
            ("cpu", False): ("2", "8:12", "4:6", 1, "1,2"),
            ("cpu", True): ("2", "8:10", "3:4", 1, "1")}
# Requests per batch size when --num-requests is unset: at least this many, so batch 1 serves several.
MIN_REQUESTS = 4
# Chain prompts start with 1 .. this many random task ids (the training prompts had 1 .. 24).
RANDOM_PREFIX = 8
# Columns of the CSV (a row's tokens stay out).
CSV_FIELDS = ("batch_size", "config", "cuda_graphs", "k", "draft_graph", "provider", "requests", "output_tokens",
              "wall_s", "tok_s", "speedup", "acceptance", "tokens_per_verify", "step_ms", "match")


class Config(NamedTuple):
    """One served configuration: ``k`` draft tokens per step (0: plain decoding), CUDA graphs on or off, and
    with graphs and k > 1 the draft-graph mode (None otherwise: it does not apply)."""

    k: int
    graphs: bool
    draft_graph: str | None = None

    @property
    def name(self) -> str:
        if not self.k:
            return "plain"
        return f"mtp k={self.k}" + (f" {self.draft_graph}" if self.draft_graph else "")


def configurations(ks: Sequence[int], draft_graphs: Sequence[str], graph_settings: Sequence[bool]) -> list[Config]:
    """Per graph setting: plain decoding first (the reference of the rows after it), then MTP for each k,
    once per draft-graph mode where one applies."""
    out = []
    for graphs in graph_settings:
        out.append(Config(0, graphs))
        for k in ks:
            out += [Config(k, graphs, mode) for mode in (draft_graphs if graphs and k > 1 else [None])]
    return out


def trained_tiny():
    """``tests/trained_tiny.py`` as a module."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import trained_tiny as module

    return module


def workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
             seed: int) -> tuple[list[list[int]], list[int]]:
    """Chain prompts of the training task (lengths uniform in ``prompt_len``) and their output lengths
    (uniform in ``output_len``)."""
    tt = trained_tiny()
    succ = tt.successor_map()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts, out_lens = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompts.append(tt.chain_prompt(length, gen, succ, rng.randint(1, min(RANDOM_PREFIX, length))))
        out_lens.append(rng.randint(*output_len))
    return prompts, out_lens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(target, mtp: DeepseekMTP, prompts: list[list[int]], out_lens: list[int], config: Config,
          batch_size: int, page_size: int, provider: str | None, repeats: int) -> dict:
    """Build the engine of ``config`` (graphs captured), serve the workload once to warm up, then ``repeats``
    times timed; returns the row (``tokens``: every timed run's greedy tokens per request)."""
    device = target.model.embed_tokens.weight.device
    context = max(map(len, prompts)) + max(out_lens) + 1
    pages_per_request = -(-(context + config.k) // page_size) + 1
    speculative = dict(speculative="mtp", num_speculative_tokens=config.k, draft_model=mtp,
                       draft_graph=config.draft_graph or DRAFT_GRAPH_MODES[0]) if config.k else {}
    start = time.perf_counter()
    llm = LLM(target, page_size=page_size, num_pages=batch_size * pages_per_request + 1, provider=provider,
              max_batch_size=batch_size, max_context_len=context, enable_cuda_graph=config.graphs, tokenizer=None,
              **speculative)
    built = time.perf_counter()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts, params)
    llm.stats = EngineStats()
    warm = time.perf_counter()
    walls, runs = [], []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(device)
        walls.append(time.perf_counter() - t0)
        runs.append([o.token_ids for o in outs])
    s = llm.stats
    wall = statistics.median(walls)
    row = {"batch_size": batch_size, "config": config.name, "cuda_graphs": config.graphs, "k": config.k,
           "draft_graph": config.draft_graph or "", "provider": llm.runner.backend.provider,
           "requests": len(prompts), "output_tokens": sum(out_lens), "wall_s": wall, "tok_s": sum(out_lens) / wall,
           "acceptance": s.acceptance_rate if config.k else None,
           "tokens_per_verify": s.tokens_per_verify if config.k else None,
           "step_ms": 1e3 * s.decode_seconds / max(1, s.decode_steps), "tokens": runs}
    print(f"# batch {batch_size}, {config.name}{' +graphs' if config.graphs else ''}: built in {built - start:.1f} s, "
          f"warm-up {warm - built:.1f} s, {repeats} timed run(s) {sum(walls):.2f} s", flush=True)
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def compare(rows: list[dict]) -> list[str]:
    """Fill each row's ``match`` (requests whose tokens in every timed run equal the first run of plain
    decoding at its batch size and graph setting) and ``speedup`` (tok/s over that plain row's); returns a
    line per row with a mismatch, naming the first request and token that differ."""
    plain = {(r["batch_size"], r["cuda_graphs"]): r for r in rows if r["k"] == 0}
    problems = []
    for r in rows:
        ref = plain[r["batch_size"], r["cuda_graphs"]]
        want = ref["tokens"][0]
        equal = [all(run[i] == tokens for run in r["tokens"]) for i, tokens in enumerate(want)]
        r["match"] = f"{sum(equal)}/{len(want)}"
        r["speedup"] = r["tok_s"] / ref["tok_s"]
        if all(equal):
            continue
        i = equal.index(False)
        got = next(run[i] for run in r["tokens"] if run[i] != want[i])
        pos = next((j for j, (a, b) in enumerate(zip(got, want[i])) if a != b), min(len(got), len(want[i])))
        problems.append(f"MISMATCH batch {r['batch_size']}, {r['config']}{' +graphs' if r['cuda_graphs'] else ''}: "
                        f"{len(want) - sum(equal)} request(s) differ from plain decoding; request {i} first at "
                        f"output token {pos} ({got[pos:pos + 4]} against {want[i][pos:pos + 4]})")
    return problems


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print("| batch | config | CUDA graphs | output tok/s | speed-up vs plain | acceptance | tokens / verify step | "
          "decode step ms | greedy = plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['config']} | {'on' if r['cuda_graphs'] else 'off'} | {r['tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {_fmt(r['acceptance'], '.3f')} | {_fmt(r['tokens_per_verify'], '.2f')} | "
              f"{r['step_ms']:.2f} | {r['match']} |")


def print_summary(rows: list[dict]) -> None:
    """Per batch size and graph setting: the fastest configuration, and (with graphs) fused over per-step
    draft graphs for each k that has both."""
    for bs, graphs in dict.fromkeys((r["batch_size"], r["cuda_graphs"]) for r in rows):
        group = [r for r in rows if (r["batch_size"], r["cuda_graphs"]) == (bs, graphs)]
        best = max(group, key=lambda r: r["tok_s"])
        setting = "CUDA graphs" if graphs else "eager"
        print(f"batch {bs}, {setting}: fastest {best['config']}, {best['tok_s']:.1f} tok/s, "
              f"{best['speedup']:.2f}x plain decoding")
        modes = {(r["k"], r["draft_graph"]): r["tok_s"] for r in group if r["draft_graph"]}
        ratios = [f"k={k} {modes[k, 'fused'] / modes[k, 'per_step']:.3f}" for k in sorted({k for k, _ in modes})
                  if (k, "fused") in modes and (k, "per_step") in modes]
        if ratios:
            print(f"batch {bs}, {setting}: draft graphs, fused tok/s / per_step tok/s: {', '.join(ratios)}")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _int_list(text: str, flag: str, lo: int, hi: int | None) -> list[int]:
    """A comma-separated list of ints in lo .. hi (None: unbounded); ValueError naming ``flag`` otherwise."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated ints, got {text!r}") from None
    if not all(lo <= v and (hi is None or v <= hi) for v in values):
        raise ValueError(f"{flag}: expected ints in {lo}..{hi if hi is not None else ''}, got {text!r}")
    return values


def _device(text: str, flag: str) -> torch.device:
    """``text`` as a cpu or cuda device; ValueError naming ``flag`` for another name or CUDA that is missing."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"{flag}: {text!r} is not a device name") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag}: expected cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag}: CUDA is not available")
    return device


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--provider", default=None, help="attention provider (default: the engine's for the device)")
    parser.add_argument("--quick", action="store_true",
                        help="CUDA: batch 32 only, shorter outputs, graphs only, one timed run; CPU: K = 1 only")
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="serve this trained MTP checkpoint instead of training one")
    parser.add_argument("--train-device", default=None, help="where the MTP layer trains (default: --device)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (default on CUDA: 1,32)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests per batch size (default: the batch size, at least {MIN_REQUESTS})")
    parser.add_argument("--prompt-len", default=None, help="MIN:MAX, uniform (default on CUDA: 16:48)")
    parser.add_argument("--output-len", default=None, help="MIN:MAX, uniform (default on CUDA: 64:128)")
    parser.add_argument("--ks", default=None, help=f"MTP draft tokens per step, comma list in 1..{MAX_DRAFT_TOKENS} "
                                                   "(default on CUDA: 1,2,3,4)")
    parser.add_argument("--draft-graphs", default=",".join(DRAFT_GRAPH_MODES),
                        help="draft-graph modes with CUDA graphs, comma list")
    parser.add_argument("--cuda-graph", choices=("on", "off", "both"), default=None,
                        help="default on CUDA: both (graph rows and eager rows), on with --quick; off on CPU")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per configuration (default on CUDA: 3)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--csv", metavar="PATH", help="write the table as CSV to PATH")
    parser.add_argument("--seed", type=int, default=0, help="of the workload")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, train (or load) the model, serve every configuration, print the table; returns the
    exit status (1 when a configuration's greedy tokens differ from plain decoding's)."""
    return command("bench_mtp", __doc__, arguments, run, argv)


def run(args: argparse.Namespace) -> int:
    """``main`` after parsing: bad options raise ValueError naming the flag before anything trains."""
    device = _device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), "--device")
    cuda = device.type == "cuda"
    batch_sizes, prompt_len, output_len, repeats, ks = DEFAULTS[(device.type, args.quick)]
    batch_sizes = _int_list(args.batch_sizes or batch_sizes, "--batch-sizes", 1, None)
    ks = _int_list(args.ks or ks, "--ks", 1, MAX_DRAFT_TOKENS)
    prompt_len = length_range(args.prompt_len or prompt_len, "--prompt-len")
    output_len = length_range(args.output_len or output_len, "--output-len")
    repeats = repeats if args.repeats is None else args.repeats
    for flag, value in (("--repeats", repeats), ("--num-requests", args.num_requests), ("--page-size", args.page_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: expected a positive int, got {value}")
    draft_graphs = args.draft_graphs.split(",")
    if not draft_graphs or any(m not in DRAFT_GRAPH_MODES for m in draft_graphs):
        raise ValueError(f"--draft-graphs: expected a comma list of {DRAFT_GRAPH_MODES}, got {args.draft_graphs!r}")
    graph_mode = args.cuda_graph or (("on" if args.quick else "both") if cuda else "off")
    if graph_mode != "off" and not cuda:
        raise ValueError("--cuda-graph: CUDA graphs need --device cuda")
    graph_settings = {"on": [True], "off": [False], "both": [True, False]}[graph_mode]
    dtype = resolve_dtype(args.dtype or ("bfloat16" if cuda else "float32"), "--dtype")
    train_device = _device(args.train_device, "--train-device") if args.train_device else device
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise ValueError(f"--checkpoint: {args.checkpoint!r} is not a directory")

    if cuda:
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name}, {props.multi_processor_count} SMs"
    else:
        where = f"CPU, {torch.get_num_threads()} torch threads (a smoke run, not a speed)"
    print(f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.checkpoint is None:
            figures = trained_tiny().write_trained_mtp_checkpoint(scratch, device=train_device)
            print(f"trained on {train_device} in {figures['seconds']:.1f} s: probe accuracy "
                  f"{figures['probe_accuracy']:.3f}, MTP accuracy {figures['mtp_accuracy']:.3f} (last batch)",
                  flush=True)
        directory = args.checkpoint or scratch
        target = load_model(directory, device=device, dtype=dtype)
        mtp = load_mtp(target, directory)
    rows = []
    for bs in batch_sizes:
        n = args.num_requests or max(MIN_REQUESTS, bs)
        prompts, out_lens = workload(n, prompt_len, output_len, args.seed)
        print(f"batch {bs}: {n} requests, prompts {prompt_len[0]}:{prompt_len[1]}, outputs "
              f"{output_len[0]}:{output_len[1]} tokens ({sum(out_lens)} in all), {str(dtype).replace('torch.', '')}, "
              f"page {args.page_size}", flush=True)
        rows += [serve(target, mtp, prompts, out_lens, c, bs, args.page_size, args.provider, repeats)
                 for c in configurations(ks, draft_graphs, graph_settings)]
    problems = compare(rows)
    print(f"provider {rows[0]['provider']}; times: wall clock of LLM.generate after a warm-up run, median of "
          f"{repeats} (synchronised before and after)")
    print_table(rows)
    print_summary(rows)
    for line in problems:
        print(line)
    if args.csv:
        write_csv(args.csv, rows)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
