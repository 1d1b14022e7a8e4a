"""Tensor parallelism and decode context parallelism on several GPUs over NCCL, one process per GPU.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py                 # both parts, 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --only dcp --heads 16 --seq 32768 --batch 64

``tp``: the V2-Lite-shaped model (``pagedmla.bench.options.PRESETS["v2-lite"]``, random weights, bf16) at
TP=1 (every rank its own whole model, rank 0 reports) and at TP=N. Each prefills ``--batch`` requests of
``--context`` random tokens, then runs ``--steps`` greedy decode steps at that batch, replayed from CUDA
graphs; printed: the median decode step time (host preparation + replay, ``ModelRunner.execute``), the
TP=N / TP=1 ratio, and how the TP=N logits compare with TP=1 (max |diff| over the logits' scale, greedy
tokens equal up to the first difference). Every rank runs the same steps, so no step channel is needed
(the engine's ``LLM(..., tensor_parallel_size=N)`` adds only rank 0's broadcast of each step).

``dcp``: one attention layer's decode step (``MLABackend.forward``, CUDA-graph replay) at ``--heads`` query
heads over ``--batch`` requests of ``--seq`` tokens: on one GPU over the whole cache, and at DCP=N (each rank
holds every N-th token and 1/N of the heads, ``pagedmla.context_parallel``); printed: the step times, the
speed-up, and the cos diff of the DCP output against the one-GPU output (max over the ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from pagedmla import MLAConfig, MLAKVCache, PageAllocator, RequestTable
from pagedmla.backend import ForwardMode, MLABackend
from pagedmla.bench.decode import cos_diff
from pagedmla.bench.options import PRESETS
from pagedmla.engine.cuda_graph import CudaGraph
from pagedmla.engine.model_runner import ModelRunner, StepPlan
from pagedmla.model.build import build_empty
from pagedmla.model.config import DeepseekConfig
from pagedmla.model.random_weights import init_random_
from pagedmla.parallel import SINGLE, Group

PAGE = 64


def _say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ---------------------------------------------------------------------------------------------- TP
def _tp_run(tp: Group, args) -> tuple[list[float], list[torch.Tensor], list[list[int]]]:
    """(decode step seconds, [prefill logits, first decode logits] float32 [batch, vocab], greedy tokens)."""
    cfg = DeepseekConfig.from_dict(PRESETS["v2-lite"])
    model = init_random_(build_empty(cfg, "cuda", torch.bfloat16, tp), seed=0)
    ctx = args.context + args.steps + 2
    runner = ModelRunner(model, page_size=PAGE, num_pages=args.batch * -(-ctx // PAGE) + 2,
                         max_batch_size=args.batch, max_context_len=ctx)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.context), generator=gen).tolist()
    slots = [runner.table.add_request() for _ in prompts]
    for s in slots:
        runner.table.ensure_capacity(s, ctx)
    last = []
    chunk = max(1, 8192 // args.context)
    for i in range(0, args.batch, chunk):
        part = slots[i:i + chunk]
        last.append(runner.execute(StepPlan(ForwardMode.EXTEND, len(part), part, [0] * len(part),
                                            prompts[i:i + chunk])))
    logits = [torch.cat(last)]
    runner.capture_cuda_graphs([args.batch])
    tokens = [logits[0].argmax(-1).tolist()]
    times = []
    for step in range(args.steps):
        plan = StepPlan(ForwardMode.DECODE, 0, slots, [args.context + step] * args.batch, [[t] for t in tokens[-1]])
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = runner.execute(plan)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == 0:
            logits.append(out.clone())
        tokens.append(out.argmax(-1).tolist())
    del runner, model
    torch.cuda.empty_cache()
    return times, logits, tokens


def bench_tp(args) -> None:
    world = dist.get_world_size()
    one_times, one_logits, one_tokens = _tp_run(SINGLE, args)
    dist.barrier()
    times, logits, tokens = _tp_run(Group.of(None), args)
    one, many = statistics.median(one_times[2:]), statistics.median(times[2:])
    scale = max(x.abs().max().item() for x in one_logits)
    diff = max((a - b).abs().max().item() for a, b in zip(one_logits, logits))
    streams = list(zip(*one_tokens)), list(zip(*tokens))
    same = sum(a == b for a, b in zip(*streams))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*streams)]
    _say(f"TP decode, V2-Lite shape bf16, batch {args.batch}, context {args.context}, CUDA graphs:")
    _say(f"  TP=1 {one * 1e3:.3f} ms/step   TP={world} {many * 1e3:.3f} ms/step   ratio {many / one:.3f}")
    _say(f"  logits (prefill, first decode) max |TP={world} - TP=1| {diff:.4g} of scale {scale:.4g} "
         f"({diff / scale:.2e}); greedy streams identical {same}/{args.batch}; first differences at steps "
         f"{sorted(i for i in first if i is not None)[:8]}")


# ---------------------------------------------------------------------------------------------- DCP
def _decode_step(backend: MLABackend, cache: MLAKVCache, table: RequestTable, q: torch.Tensor, seq: int,
                 reps: int) -> tuple[torch.Tensor, float]:
    """(output [batch, heads * 512], seconds per CUDA-graph replay) of one decode step over ``cache``."""
    bs = q.shape[0]
    req = torch.arange(bs, device="cuda")
    seq_lens = torch.full((bs,), seq, dtype=torch.int32, device="cuda")
    loc = torch.zeros(bs, dtype=torch.int64, device="cuda")
    backend.init_cuda_graph_state(bs)
    backend.init_forward_metadata_capture_cuda_graph(bs, req, seq_lens, ForwardMode.DECODE)
    graph = CudaGraph()
    out = graph.capture(lambda: backend.forward(q, None, None, 0, loc, cache, save_kv_cache=False))
    backend.init_forward_metadata_replay_cuda_graph(bs, req, seq_lens, ForwardMode.DECODE,
                                                    block_table=table.block_table)
    graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return out.clone(), (time.perf_counter() - start) / reps


def bench_dcp(args) -> None:
    d, rank = dist.get_world_size(), dist.get_rank()
    if args.heads % d:
        raise ValueError(f"--heads: {args.heads} heads do not split over {d} ranks")
    bs, seq, kv = args.batch, args.seq, 576
    common = dict(num_heads=args.heads, dtype=torch.bfloat16, max_context_len=seq + 1, max_batch_size=bs)
    gen = torch.Generator(device="cuda").manual_seed(0)  # the same draws on every rank
    q = torch.randn(bs, args.heads, kv, generator=gen, device="cuda").bfloat16()
    # One GPU: every token, every head.
    one_cfg = MLAConfig(page_size=PAGE, **common)
    one_table = RequestTable(PageAllocator(bs * -(-seq // PAGE) + 2), PAGE, bs, one_cfg.max_pages_per_request,
                             device="cuda")
    one_cache = MLAKVCache(1, one_table.allocator.num_pages, PAGE, kv, dtype=torch.bfloat16, device="cuda")
    # DCP: this rank's heads and every d-th token; a block-table page holds PAGE * d tokens.
    dcp_cfg = MLAConfig(page_size=PAGE, attn_tp_size=d, dcp_size=d, dcp_rank=rank, **common)
    per_page = dcp_cfg.tokens_per_page
    dcp_table = RequestTable(PageAllocator(bs * -(-seq // per_page) + 2), per_page, bs,
                             dcp_cfg.max_pages_per_request, device="cuda")
    dcp_cache = MLAKVCache(1, dcp_table.allocator.num_pages, PAGE, kv, dtype=torch.bfloat16, device="cuda")
    pos = torch.arange(seq, device="cuda")
    mine = pos % d == rank
    for _ in range(bs):
        rows = torch.randn(seq, kv, generator=gen, device="cuda").bfloat16()
        s = one_table.add_request()
        one_table.ensure_capacity(s, seq)
        one_cache.write(0, one_table.token_slots(s, 0, seq).cuda(), rows)
        s = dcp_table.add_request()
        dcp_table.ensure_capacity(s, seq)
        pages = torch.tensor(dcp_table.pages[s], dtype=torch.int64, device="cuda")
        slots = pages[pos // per_page] * PAGE + pos % per_page // d
        dcp_cache.write(0, slots[mine], rows[mine])
    ref, one_s = _decode_step(MLABackend(one_cfg, "cuda"), one_cache, one_table, q, seq, args.reps)
    heads = slice(rank * args.heads // d, (rank + 1) * args.heads // d)
    got, dcp_s = _decode_step(MLABackend(dcp_cfg, "cuda"), dcp_cache, dcp_table, q[:, heads].contiguous(), seq,
                              args.reps)
    ref = ref.view(bs, args.heads, -1)[:, heads].reshape(bs, -1)
    diff = _max_over_ranks(cos_diff(got, ref))
    dcp_s = _max_over_ranks(dcp_s)
    _say(f"DCP decode attention, {args.heads} heads, batch {bs}, seq {seq}, page {PAGE}, bf16, CUDA graphs:")
    _say(f"  1 GPU {one_s * 1e6:.1f} us   DCP={d} {dcp_s * 1e6:.1f} us   speed-up {one_s / dcp_s:.2f}x   "
         f"cos diff {diff:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("tp", "dcp"), help="run one part (default: both)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="tp: prompt tokens per request")
    ap.add_argument("--steps", type=int, default=32, help="tp: decode steps timed (the first two are dropped)")
    ap.add_argument("--heads", type=int, default=16, help="dcp: query heads of the layer")
    ap.add_argument("--seq", type=int, default=32768, help="dcp: tokens per request")
    ap.add_argument("--reps", type=int, default=50, help="dcp: graph replays timed")
    args = ap.parse_args()
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("launch with torchrun --nproc-per-node N (N >= 2 GPUs)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        with torch.inference_mode():
            if args.only in (None, "tp"):
                bench_tp(args)
            if args.only in (None, "dcp"):
                bench_dcp(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
