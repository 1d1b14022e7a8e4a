"""MTP speculative decoding end to end on the tiny model with a trained MTP layer (``trained_tiny``): the
layer loaded from a Hugging Face-layout checkpoint, greedy tokens identical to plain decoding for K = 1..4
with chunked prefill, prefix caching and preemption on, the caches of rejected drafts audited, and the
draft's graphs (CPU stand-in) equal to eager."""

from __future__ import annotations

import json

import pytest
import torch
from graph_standin import ReRunGraph
from safetensors.torch import load_file, save_file
from trained_tiny import chain_prompt, hf_mtp_forward, hf_mtp_layer, successor_map

from pagedmla.backend import ForwardBatch, ForwardMode
from pagedmla.engine import LLM, SamplingParams
from pagedmla.engine.mtp_drafter import MTPDrafter
from pagedmla.model import CheckpointError, load_model, load_mtp
from pagedmla.model.context import StepContext
from pagedmla.model.mtp import DeepseekMTP


def _prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    """Chain prompts; the first four share a 40-token prefix (two full pages and a part: prefix caching)."""
    succ = successor_map()
    gen = torch.Generator().manual_seed(seed)
    shared = chain_prompt(40, gen, succ, 5)
    prompts = [shared + chain_prompt(3 + 2 * i, gen, succ, 1) for i in range(4)]
    return prompts + [chain_prompt(9 + 11 * i, gen, succ, 1 + i) for i in range(n - 4)]


PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 33, 9, 26, 14, 30)]


def _llm(checkpoint, k: int = 0, **kwargs) -> LLM:
    # 12 pages of 16 for six requests of up to ~90 tokens: the youngest are preempted and recomputed. A
    # 24-token budget prefills every prompt in chunks.
    options = dict(page_size=16, num_pages=12, max_batch_size=4, max_num_batched_tokens=24, max_context_len=160,
                   enable_prefix_caching=True, provider="torch", dtype=torch.float32, tokenizer=None)
    if k:
        options.update(speculative="mtp", num_speculative_tokens=k)
    return LLM(str(checkpoint), **{**options, **kwargs})


def _run(llm: LLM, audit: bool = False) -> tuple[dict[int, list[int]], int]:
    """Every prompt to completion, added two per step; with ``audit`` the cache rows of every running
    request past its accepted tokens are poisoned (NaN) after every step, in the target's cache and the
    draft's (both start all NaN), and each step must find the rows before them finite. Returns the tokens
    by prompt and the number of rows the audit found written past the accepted tokens and poisoned."""
    prompts = _prompts()
    ids, out, step, poisoned = {}, {}, 0, 0
    if audit:
        for cache in (llm.runner.cache, llm.drafter.backend.cache):
            for buffer in cache.buffers:
                buffer.fill_(float("nan"))
    while len(out) < len(prompts):
        for i in range(2 * step, min(2 * step + 2, len(prompts))):
            ids[llm.add_request(prompts[i], PARAMS[i])] = i
        for o in llm.step():
            out[ids[o.request_id]] = o.outputs[0].token_ids
        if audit:
            poisoned += _poison_unaccepted_rows(llm)
        step += 1
        assert step < 2000
    return out, poisoned


def _poison_unaccepted_rows(llm: LLM) -> int:
    """For each running request: its rows at positions < num_cached_tokens (those of accepted tokens, the
    only ones a later step may read) are finite in both caches; the rows at and past num_cached_tokens in
    its pages (drafts the target rejected, padding) become NaN. Returns how many of those were finite."""
    table, ps = llm.runner.table, llm.runner.table.page_size
    caches = [llm.runner.cache, llm.drafter.backend.cache]
    count = 0
    for seq in llm.scheduler.running:
        pages = table.pages[seq.slot]
        slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(len(pages) * ps)], dtype=torch.int64)
        keep, drop = slots[: seq.num_cached_tokens], slots[seq.num_cached_tokens:]
        for cache in caches:
            for layer in range(len(cache.buffers)):
                rows = cache.layer(layer).view(-1, cache.kv_dim)
                assert torch.isfinite(rows[keep]).all(), f"request {seq.seq_id}: an accepted row is not finite"
                count += int(torch.isfinite(rows[drop]).all(dim=-1).sum())
                rows[drop] = float("nan")
    return count


@pytest.fixture(scope="module")
def plain(mtp_checkpoint):
    llm = _llm(mtp_checkpoint)
    out, _ = _run(llm)
    assert llm.stats.preemptions > 0 and llm.stats.cached_prefix_tokens > 0
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_greedy_equals_plain_decoding(mtp_checkpoint, plain, k):
    """Chunked prefill, prefix caching and preemption on; the audit poisons every unaccepted row after each
    step, so a step that read a rejected draft's row (in either cache) would produce NaN logits and fail."""
    llm = _llm(mtp_checkpoint, k)
    assert isinstance(llm.drafter, MTPDrafter) and llm.drafter.k == k
    out, poisoned = _run(llm, audit=True)
    s = llm.stats
    print(f"MTP k={k}: acceptance {s.acceptance_rate:.3f} ({s.accepted_draft_tokens}/{s.draft_tokens}), "
          f"{s.tokens_per_verify:.2f} tokens per verify, {s.verify_steps} verify steps, "
          f"{s.preemptions} preemptions, {s.cached_prefix_tokens} cached prefix tokens, {poisoned} rows poisoned")
    assert out == plain
    assert s.preemptions > 0 and s.cached_prefix_tokens > 0
    assert s.acceptance_rate > 0.8
    assert s.tokens_per_verify == pytest.approx(1 + s.accepted_draft_tokens / s.verified_requests)
    # Rejected drafts left rows past the accepted tokens (which the audit poisoned) wherever one was rejected.
    assert poisoned > 0 or s.accepted_draft_tokens == s.draft_tokens


@pytest.mark.parametrize("k,draft_graph", [(1, "fused"), (3, "fused"), (3, "per_step")])
def test_draft_graphs_replay_equal_to_eager(mtp_checkpoint, plain, k, draft_graph):
    """The target's DECODE / TARGET_VERIFY graphs and the draft's DRAFT_EXTEND and draft-decode graphs
    (CPU stand-in: re-runs over the static buffers, with the padding and replay planning of a real
    replay) give the eager tokens; batches past the largest captured size run eagerly."""
    llm = _llm(mtp_checkpoint, k)
    llm.runner.capture_cuda_graphs([1, 2], graph_factory=ReRunGraph)
    llm.drafter.capture_graphs([1, 2], ReRunGraph, mode=draft_graph)
    graphs = llm.drafter.graphs
    counts = {"extend": 0, "chain": 0}

    def counting(name, fn):
        def wrapped(*args):
            counts[name] += 1
            return fn(*args)
        return wrapped

    graphs.replay_extend = counting("extend", graphs.replay_extend)
    graphs.replay_chain = counting("chain", graphs.replay_chain)
    out, _ = _run(llm)
    assert out == plain
    assert counts["extend"] > 0 and counts["chain"] > 0
    assert llm.stats.acceptance_rate > 0.8


def test_mtp_layer_loads_from_the_checkpoint_and_matches_transformers(mtp_checkpoint):
    """The MTP layer read from the safetensors shard (``model.layers.3.*``) shares the target's embedding and
    head, and one draft extend through pagedmla's backend equals transformers' MtpLayer on the same rows."""
    target = load_model(str(mtp_checkpoint), dtype=torch.float32)
    mtp = load_mtp(target, str(mtp_checkpoint))
    assert isinstance(mtp, DeepseekMTP) and len(mtp.layers) == 1
    assert mtp.layers[0].embed_tokens is target.model.embed_tokens
    assert mtp.layers[0].shared_head.head is target.lm_head
    layer, rotary, _ = hf_mtp_layer(mtp)
    gen = torch.Generator().manual_seed(7)
    length = 21
    hidden = torch.randn(1, length, target.config.hidden_size, generator=gen)
    tokens = torch.randint(2, 60, (length,), generator=gen)
    want = hf_mtp_forward(layer, rotary, target.model.embed_tokens(tokens)[None], hidden)[0]
    llm = _llm(mtp_checkpoint, 1)
    drafter = llm.drafter
    table = llm.runner.table
    slot = table.add_request()
    table.ensure_capacity(slot, length)
    loc = table.token_slots(slot, 0, length)
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor([slot]), torch.tensor([length], dtype=torch.int32),
                         table.block_table, seq_lens_cpu=[length], extend_seq_lens_cpu=[length],
                         extend_prefix_lens_cpu=[0])
    with torch.inference_mode():
        drafter.backend.extend.init_forward_metadata(batch)
        got = mtp(tokens, torch.arange(length), hidden[0],
                  StepContext(drafter.backend.extend, drafter.backend.cache, loc))
    assert ((got - want).norm() / want.norm()) < 1e-5


def test_mtp_checkpoint_errors(mtp_checkpoint, tmp_path):
    """No MTP layers, a missing tensor, an unexpected one: CheckpointError naming the field or tensor."""
    target = load_model(str(mtp_checkpoint), dtype=torch.float32)
    config = json.loads((mtp_checkpoint / "config.json").read_text())
    tensors = load_file(str(mtp_checkpoint / "model.safetensors"))

    def write(cfg, ts):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        save_file(ts, str(tmp_path / "model.safetensors"))

    write({**config, "num_nextn_predict_layers": 0}, tensors)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        load_mtp(target, str(tmp_path))
    write(config, {k: v for k, v in tensors.items() if k != "model.layers.3.eh_proj.weight"})
    with pytest.raises(ValueError, match="model.layers.3.eh_proj.weight"):
        load_mtp(target, str(tmp_path))
    write(config, {**tensors, "model.layers.3.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="model.layers.3.extra.weight"):
        load_mtp(target, str(tmp_path))


def test_mtp_refuses_a_split_target(monkeypatch):
    """MTP layers are built whole for a single-rank target; a tensor-parallel one is a ValueError, both when
    the layers are built and when a drafter is made for such a runner."""
    from pagedmla.engine.model_runner import ModelRunner
    from pagedmla.parallel import Group

    target = load_model("tiny", dtype=torch.float32)
    mtp = load_mtp(target)
    runner = ModelRunner(target, page_size=4, num_pages=16, max_batch_size=2, max_context_len=32,
                         num_speculative_tokens=2)
    monkeypatch.setattr(target, "tp", Group(None, 0, 2))
    with pytest.raises(ValueError, match="target: MTP layers are built whole"):
        load_mtp(target)
    with pytest.raises(ValueError, match="draft_model: MTP drafts on one rank"):
        MTPDrafter(runner, mtp, 2)


def test_cache_bytes_cover_the_draft_cache():
    """The draft's cache layer shares the pages: a cache_bytes budget holds fewer of them with MTP on."""
    budget = 1 << 22
    plain = LLM("tiny", dtype=torch.float32, tokenizer=None, cache_bytes=budget, max_batch_size=64)
    mtp = LLM("tiny", dtype=torch.float32, tokenizer=None, cache_bytes=budget, max_batch_size=64, speculative="mtp",
              num_speculative_tokens=1)
    layers = plain.model.config.num_hidden_layers
    page = plain.runner.table.page_size * plain.runner.mla_config.kv_dim * 4  # one layer's page, float32
    assert plain.runner.cache.num_pages - 1 == budget // (page * layers)
    assert mtp.runner.cache.num_pages - 1 == budget // (page * (layers + 1)) < budget // (page * layers)
    assert mtp.drafter.backend.cache.num_pages == mtp.runner.cache.num_pages


def test_speculative_arguments(mtp_checkpoint):
    with pytest.raises(ValueError, match="speculative"):
        _llm(mtp_checkpoint, speculative="medusa", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _llm(mtp_checkpoint, speculative="mtp")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _llm(mtp_checkpoint, 5)
    with pytest.raises(ValueError, match="draft_graph"):
        _llm(mtp_checkpoint, 2, draft_graph="one")
    with pytest.raises(TypeError, match="draft_model"):
        _llm(mtp_checkpoint, 2, draft_model=object())
    with pytest.raises(ValueError, match="draft_model"):
        _llm(mtp_checkpoint, draft_model=object(), speculative="ngram", num_speculative_tokens=2)


# ---------------------------------------------------------------------------------------------- GPU
def _timed_run(llm: LLM) -> tuple[dict[int, list[int]], float]:
    """The prompts served once to warm up (compiles, graph pools), then again timed: (tokens, tokens/s)."""
    import time

    _run(llm)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out, _ = _run(llm)
    torch.cuda.synchronize()
    return out, sum(map(len, out.values())) / (time.perf_counter() - start)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_with_cuda_graphs_in_bf16_equals_plain_decoding(mtp_checkpoint, k):
    """Real CUDA graphs (target DECODE / TARGET_VERIFY, draft DRAFT_EXTEND and draft decodes, fused and per
    step), bf16, the default (fastest) provider, chunked prefill, prefix caching and preemption on: the
    plain engine's greedy tokens, acceptance > 0.8. Prints tokens/s against plain decoding (no timing
    assert: the figures are for the report)."""
    gpu = dict(device="cuda", dtype=torch.bfloat16, provider=None, enable_cuda_graph=True)
    plain, plain_tps = _timed_run(_llm(mtp_checkpoint, **gpu))
    for draft_graph in ("fused", "per_step") if k > 1 else ("fused",):
        llm = _llm(mtp_checkpoint, k, draft_graph=draft_graph, **gpu)
        assert llm.runner.graphs is not None and llm.drafter.graphs is not None
        out, tps = _timed_run(llm)
        s = llm.stats
        print(f"GPU bf16 MTP k={k} {draft_graph}: {tps:.1f} tokens/s against {plain_tps:.1f} plain "
              f"({tps / plain_tps:.2f}x), acceptance {s.acceptance_rate:.3f}, {s.tokens_per_verify:.2f} tokens "
              f"per verify")
        assert out == plain
        assert s.acceptance_rate > 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 4])
def test_mtp_cuda_graphs_equal_eager_float32(mtp_checkpoint, k):
    """Same provider (torch), float32, on the GPU: replayed graphs give the eager MTP engine's tokens."""
    gpu = dict(device="cuda", dtype=torch.float32, provider="torch")
    eager, _ = _run(_llm(mtp_checkpoint, k, enable_cuda_graph=False, **gpu))
    graphed, _ = _run(_llm(mtp_checkpoint, k, enable_cuda_graph=True, **gpu))
    assert graphed == eager
