"""CUDA-graph decode / verify steps.

On the CPU a stand-in graph (it re-runs the captured function on replay) exercises everything but the
capture itself: padding to the next captured batch size, the static input buffers, the backend's
replay planning over its graph buffers, the eager fallback for larger batches, and the MoE's
sync-free path that capture uses. On a GPU (``-m gpu``) real graphs must give the eager engine's
greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from engine_driver import drive
from graph_standin import ReRunGraph

from pagedmla.backend import ForwardMode
from pagedmla.engine import LLM, SamplingParams
from pagedmla.engine.cuda_graph import default_batch_sizes
from pagedmla.model import load_model
from pagedmla.model.moe import Experts, MoE, grouped_mm_supported

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
# Requests of different lengths, so that the running batch grows and shrinks through every size.
STAGGERED = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 30, 9, 14, 6, 22, 18)]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


def _llm(model, **kwargs):
    return LLM(model, page_size=16, num_pages=64, max_batch_size=8, max_context_len=128, provider="torch", **kwargs)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def _with_graphs(llm, sizes):
    graphs = llm.runner.capture_cuda_graphs(sizes, graph_factory=ReRunGraph)
    replays = []
    replay = graphs.replay

    def counting(batch, *tensors):
        replays.append((batch.batch_size, graphs.padded_batch_size(batch.batch_size), batch.forward_mode))
        return replay(batch, *tensors)

    graphs.replay = counting
    return replays


@pytest.mark.parametrize("k", [0, 2], ids=["decode", "verify"])
def test_replayed_steps_match_eager(tiny, k):
    prompts = _prompts([3, 20, 7, 33, 5, 12]) + [list(range(40, 48)) * 3]
    join_at = [0, 0, 1, 2, 3, 3, 4]
    eager = drive(_llm(tiny, num_speculative_tokens=k), prompts, STAGGERED, join_at)
    llm = _llm(tiny, num_speculative_tokens=k)
    replays = _with_graphs(llm, [1, 2, 4])
    graphed = drive(llm, prompts, STAGGERED, join_at)
    assert graphed.outputs == eager.outputs
    padded = {(raw, bs) for raw, bs, _ in replays}
    assert (3, 4) in padded and all(bs in (1, 2, 4) for _, bs in padded)
    assert llm.stats.decode_steps > len(replays), "batches of 5+ requests ran eagerly"
    if k:
        assert any(mode == ForwardMode.TARGET_VERIFY for *_, mode in replays)
        assert llm.stats.acceptance_rate > 0


def test_replay_pads_rows_into_reserved_page(tiny):
    llm = _llm(tiny)
    _with_graphs(llm, [4])
    for p in _prompts([5, 18, 9]):
        llm.add_request(p, GREEDY)
    llm.step()  # prefill
    llm.step()  # decode of 3 requests replays the 4-row graph
    g = llm.runner.graphs
    running = sorted(llm.scheduler.running, key=lambda s: s.seq_id)
    assert g.input_ids[:3].tolist() == [s.token_ids[-2] for s in running]
    assert g.positions[:4].tolist() == [len(s) - 2 for s in running] + [0]
    assert g.input_ids[3] == 0 and g.out_cache_loc[3] == 0
    state = llm.runner.backend._graph
    fill = llm.runner.backend.get_cuda_graph_seq_len_fill_value()
    assert state.seq_lens[:4].tolist() == [len(s) - 1 for s in running] + [fill]
    assert not state.block_table[3].any()
    for i, s in enumerate(running):
        pages = llm.runner.table.pages[s.slot]
        assert state.block_table[i, : len(pages)].tolist() == pages


def test_default_batch_sizes_and_bad_arguments(tiny):
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert default_batch_sizes(3) == [1, 2, 3]
    assert default_batch_sizes(1) == [1]
    with pytest.raises(ValueError, match="enable_cuda_graph"):
        _llm(tiny, enable_cuda_graph=True)
    with pytest.raises(ValueError, match="batch_sizes"):
        _llm(tiny).runner.capture_cuda_graphs([0, 4], graph_factory=ReRunGraph)
    with pytest.raises(ValueError, match="batch_sizes"):
        _llm(tiny).runner.capture_cuda_graphs([16], graph_factory=ReRunGraph)
    with pytest.raises(ValueError, match="batch_sizes"):
        _llm(tiny).runner.capture_cuda_graphs([], graph_factory=ReRunGraph)


def _naive_experts(experts, x, weights, ids):
    """Token by token, choice by choice, in float64: the definition the three expert paths must meet."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t].double()).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


def test_expert_paths_equal_the_definition(tiny):
    """forward_sorted (grouped GEMMs, sync-free), forward_dense (batched, sync-free) and forward_grouped
    (per-expert GEMMs) all equal a per-token float64 loop; float64 to 1e-12 where the path runs in float64,
    float32 to GEMM rounding. Token counts leave some experts without tokens and give others several."""
    moe = next(m for m in tiny.modules() if isinstance(m, MoE))
    gen = torch.Generator().manual_seed(0)
    for dtype, rel in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        experts = copy.deepcopy(moe.experts).to(dtype)
        for tokens in (0, 1, 3, 17):
            x = torch.randn(tokens, tiny.config.hidden_size, generator=gen)
            weights, ids = moe.gate(x)
            x = x.to(dtype)
            want = _naive_experts(experts, x, weights, ids)
            scale = want.abs().max() if tokens else 1.0
            paths = {"grouped": experts.forward_grouped, "dense": experts.forward_dense}
            if grouped_mm_supported(x.device, dtype):
                paths["sorted"] = experts.forward_sorted
            for name, path in paths.items():
                got = path(x, weights, ids)
                assert got.dtype == dtype and got.shape == x.shape, name
                assert torch.all((got.double() - want).abs() <= rel * scale), (name, dtype, tokens)
            # forward() takes the sync-free grouped GEMM wherever this torch build supports it.
            chosen = "sorted" if grouped_mm_supported(x.device, dtype) else "grouped"
            assert torch.equal(experts(x, weights, ids), paths[chosen](x, weights, ids))


def test_unaligned_expert_sizes_take_the_per_expert_path():
    """Grouped GEMM kernels need hidden and intermediate sizes that are multiples of 8; other sizes run the
    per-expert GEMMs (same function)."""
    experts = Experts(4, 12, 6)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen))
    x = torch.randn(5, 12, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    assert torch.equal(experts(x, weights, ids), experts.forward_grouped(x, weights, ids))
    assert torch.all((experts(x, weights, ids).double() - _naive_experts(experts, x, weights, ids)).abs() <= 1e-4)


# ---------------------------------------------------------------------------------------------- GPU
def _gpu_run(model, graphs: bool, k: int, provider: str):
    llm = LLM(model, page_size=16, num_pages=128, max_batch_size=8, max_context_len=256, provider=provider,
              enable_cuda_graph=graphs, num_speculative_tokens=k)
    prompts = _prompts([3, 20, 7, 33, 5, 12, 60, 9, 2]) + [list(range(40, 48)) * 3]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 40, 9, 14, 6, 22, 18, 30, 11, 26)]
    run = drive(llm, prompts, params, [0, 0, 1, 2, 3, 3, 4, 6, 6, 8])
    return run.outputs, llm


@pytest.mark.gpu
def test_grouped_gemm_experts_capture_on_hopper():
    """On sm_90+ in bf16 the sync-free grouped-GEMM path is what runs, eagerly and inside a CUDA graph."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM kernels need sm_90")
    device = torch.device("cuda")
    assert grouped_mm_supported(device, torch.bfloat16)
    experts = Experts(8, 256, 128).to(device, torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 256 ** -0.5)
        experts.down_proj.normal_(0, 128 ** -0.5)
        x = torch.randn(24, 256, device=device, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(8, device=device)[:2] for _ in range(24)])
        ids[:6] = torch.tensor([0, 1], device=device)  # some experts get many tokens, some none
        weights = torch.rand(24, 2, device=device)
        want = experts.forward_sorted(x, weights, ids)
        assert torch.equal(experts(x, weights, ids), want)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(x, weights, ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts(x, weights, ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, want)
        ref = _naive_experts(experts.cpu().float(), x.cpu().float(), weights.cpu(), ids.cpu())
        assert ((want.cpu().double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 3], ids=["decode", "verify"])
def test_cuda_graph_greedy_equals_eager_float32(k):
    """Same provider, float32: replayed graphs must give the eager engine's tokens exactly (batches of 1..9
    requests: padded replays of 1, 2, 4, 8 and eager steps of 9)."""
    model = load_model("tiny", device="cuda", dtype=torch.float32)
    eager, _ = _gpu_run(model, False, k, "torch")
    graphed, llm = _gpu_run(model, True, k, "torch")
    assert llm.runner.graphs is not None and llm.runner.graphs.batch_sizes == [1, 2, 4, 8]
    assert graphed == eager
    if k:
        assert llm.stats.acceptance_rate > 0


@pytest.mark.gpu
def test_cuda_graph_greedy_equals_eager_bf16_triton():
    """bf16 through the Triton kernels, captured: the same tokens as the same kernels run eagerly."""
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    eager, _ = _gpu_run(model, False, 0, "triton")
    graphed, _ = _gpu_run(model, True, 0, "triton")
    assert graphed == eager
