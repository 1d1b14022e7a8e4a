"""Engine behaviour on the tiny model: scheduling, page accounting, stopping, request validation."""

from __future__ import annotations

import pytest
import torch

from pagedmla.backend import ForwardMode
from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


def _llm(model, **kwargs):
    kwargs.setdefault("num_pages", 32)
    return LLM(model, page_size=16, max_context_len=128, provider="torch", **kwargs)


def test_prefill_then_decode_steps_and_pages_return(tiny):
    llm = _llm(tiny, max_batch_size=2)
    free = llm.runner.table.allocator.num_free
    for p in ([1, 2, 3], [4] * 20, [5, 6]):
        llm.add_request(p, SamplingParams(max_tokens=4))
    modes = []
    while llm.has_unfinished():
        batch = llm.scheduler.schedule()
        modes.append((batch.mode, len(batch.seqs)))
        assert len(llm.scheduler.running) <= 2
        logits = llm.runner.run(batch.seqs, batch.mode, batch.num_extends)
        llm.scheduler.postprocess(batch, [[t] for t in logits.argmax(-1).tolist()])
    assert modes[0] == (ForwardMode.EXTEND, 2)
    assert (ForwardMode.EXTEND, 1) in modes[1:]  # the third request joined once a slot freed
    assert all(m in (ForwardMode.EXTEND, ForwardMode.DECODE) for m, _ in modes)
    assert llm.runner.table.allocator.num_free == free


def test_generate_is_batch_invariant_for_greedy(tiny):
    prompts = [[1, 2, 3], [7] * 17, [9, 8]]
    params = SamplingParams(max_tokens=6)
    together = _llm(tiny).generate(prompts, params)
    alone = [_llm(tiny).generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in together)


def test_stop_tokens_and_eos(tiny):
    first = _llm(tiny).generate([1, 2, 3], SamplingParams(max_tokens=5))[0].token_ids
    out = _llm(tiny).generate([1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=[first[1]]))[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop"
    llm = _llm(tiny)
    llm.scheduler.eos_token_ids = {first[0]}
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=5))[0].token_ids == first[:1]
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids == first


def test_seeded_sampling_reproducible(tiny):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3, max_tokens=8)
    a = _llm(tiny).generate([[1, 2, 3], [4, 5]], params)
    b = _llm(tiny).generate([[1, 2, 3], [4, 5]], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_context_limit_ends_generation(tiny):
    out = _llm(tiny).generate([1] * 120, SamplingParams(max_tokens=50))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_bad_requests_name_the_argument(tiny):
    llm = _llm(tiny)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([[1, 2, 512]])
    with pytest.raises(ValueError, match="prompts"):
        llm.generate("text without a tokenizer")
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([[1] * 128])
    with pytest.raises(ValueError, match="params"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(TypeError, match="params"):
        llm.add_request([1], {"max_tokens": 3})
    with pytest.raises(ValueError, match="num_pages"):
        _llm(tiny, num_pages=3).generate([1, 2], SamplingParams(max_tokens=100))


def test_generate_queues_nothing_when_a_prompt_is_bad(tiny):
    llm = _llm(tiny, num_pages=4)  # 3 usable pages: 48 tokens
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([[1, 2, 3], [1, 512]], SamplingParams(max_tokens=4))
    with pytest.raises(TypeError, match="params"):
        llm.generate([[1, 2], [3]], [SamplingParams(), {"max_tokens": 2}])
    with pytest.raises(ValueError, match="num_pages"):
        llm.generate([[1, 2], [3] * 40], [SamplingParams(), SamplingParams(max_tokens=20)])
    assert not llm.has_unfinished() and not llm._requests
    assert len(llm.generate([[7, 8]], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_generate_keeps_other_requests_outputs(tiny):
    llm = _llm(tiny)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    early = llm.add_request([4, 5, 6], params)
    late = llm.add_request([6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    outs = llm.generate([[1, 2]], params)
    assert len(outs) == 1 and outs[0].request_id not in (early, late)
    # The early request finished inside generate: kept, not returned; the late one is still running.
    finished = llm.pop_finished()
    alone = _llm(tiny).generate([4, 5, 6], params)[0]
    assert list(finished) == [early] and finished[early].token_ids == alone.token_ids
    assert llm.has_unfinished() and llm.pop_finished() == {}
    while llm.has_unfinished():
        done = llm.step()
    assert [o.request_id for o in done] == [late] and llm.pop_finished() == {}


def test_engine_arguments_name_themselves(tiny):
    for kwargs, name in ((dict(max_context_len=0), "max_context_len"), (dict(cache_bytes=-1), "cache_bytes"),
                         (dict(ngram_max_n=0, num_speculative_tokens=2), "ngram_max_n"),
                         (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
                         (dict(device="meta"), "device"), (dict(dtype="bfloat16"), "dtype"), (dict(seed=1), "seed")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            LLM(tiny, **{"page_size": 16, "max_context_len": 128, "num_pages": 32, "provider": "torch", **kwargs})
    # Arguments that agree with the given model are fine.
    assert _llm(tiny, device="cpu", dtype=torch.float32).device.type == "cpu"


def test_stats_count_only_the_tokens_requests_keep(tiny, monkeypatch):
    """A verify step's tokens past max_tokens or a stop token are dropped, so they are neither decoded
    tokens nor accepted drafts (every draft is accepted here, the bonus token is 1)."""
    import pagedmla.engine.llm as llm_module

    monkeypatch.setattr(llm_module, "verify", lambda logits, drafts, params, generators: [d + [1] for d in drafts])
    for params, kept in ((SamplingParams(max_tokens=2, ignore_eos=True), 1),
                         (SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[503]), 3)):
        llm = _llm(tiny, num_speculative_tokens=4)
        llm.drafter.propose = lambda tokens: [501, 502, 503, 504]
        out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], params)[0]
        assert out.token_ids[1:] == [501, 502, 503][:kept]
        s = llm.stats
        assert s.verify_steps == 1 and s.draft_tokens == 4
        assert s.decode_tokens == s.accepted_draft_tokens == kept


def test_prefix_reuse_is_counted_once_per_admission(tiny):
    """A request whose admission fails for want of pages while its prefix is cached, step after step,
    counts its reuse once: when it is admitted."""
    llm = _llm(tiny, num_pages=8, enable_prefix_caching=True)  # 7 usable pages of 16 tokens
    prefix = list(range(10, 42))  # two full pages
    llm.generate([prefix + [1]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(llm.pages.prefix_cache) == 2 and llm.stats.cached_prefix_tokens == 0
    llm.add_request(list(range(100, 160)), SamplingParams(max_tokens=15, ignore_eos=True))  # 4-5 pages
    shared = llm.add_request(prefix + list(range(200, 220)), SamplingParams(max_tokens=4, ignore_eos=True))
    attempts = 0
    while llm.has_unfinished():
        waiting = any(s.seq_id == shared for s in llm.scheduler.waiting)
        llm.step()
        attempts += waiting
    assert attempts > 5 and llm.stats.preemptions == 0
    s = llm.stats
    assert s.cached_prefix_tokens == 32
    assert (s.prefix_cache_hits, s.prefix_cache_queries, s.prefix_cache_hit_rate) == (1, 3, 1 / 3)


def test_prepare_builds_slots_on_the_host(tiny):
    llm = _llm(tiny)
    for prompt in ([1] * 20, [2, 3], [4] * 33):
        llm.add_request(prompt, SamplingParams(max_tokens=4))
    batch = llm.scheduler.schedule()
    inputs = llm.runner.prepare(batch.seqs, batch.mode, batch.num_extends)
    table = llm.runner.table
    expect = torch.cat([table.token_slots(s.slot, 0, len(s)) for s in batch.seqs])
    assert torch.equal(inputs.out_cache_loc, expect)
    assert inputs.positions.tolist() == [p for s in batch.seqs for p in range(len(s))]
    assert inputs.last_token_index.tolist() == [19, 21, 54]
    assert inputs.batch.seq_lens.dtype == torch.int32 and inputs.batch.seq_lens.tolist() == [20, 2, 33]
    seq = batch.seqs[0]
    seq.num_cached_tokens = len(seq) - 1
    with pytest.raises(ValueError, match="seqs"):
        llm.runner.prepare([seq], ForwardMode.EXTEND, 1, tokens=[[1] * 20])
