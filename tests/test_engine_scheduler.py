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
