"""Randomized soak: requests of random lengths arrive, finish and are aborted at random steps, sharing
prefixes, under a cache small enough to force preemption. After every step the page books must balance
(``KVPages.audit``: every page free, or referenced once by each running request listing it plus once by
the prefix cache); every completed request must equal a plain reference run."""

from __future__ import annotations

import random

import pytest
import torch

from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model

NUM_REQUESTS = 250


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


def _workload(seed: int):
    rng = random.Random(seed)
    stems = [[rng.randrange(512) for _ in range(n)] for n in (40, 33, 16)]
    requests = []
    for _ in range(NUM_REQUESTS):
        stem = rng.choice(stems + [[]])
        prompt = stem + [rng.randrange(512) for _ in range(rng.randint(1, 30))]
        requests.append((prompt, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)))
    return rng, requests


@pytest.mark.parametrize(("seed", "options"), [
    (0, {"mixed_batching": True, "max_num_batched_tokens": 32}),
    (1, {"max_num_batched_tokens": 24, "num_speculative_tokens": 2}),
], ids=["mixed", "speculative"])
def test_random_arrivals_aborts_prefix_sharing_and_preemption(tiny, seed, options):
    rng, requests = _workload(seed)
    reference = LLM(tiny, page_size=16, num_pages=256, max_batch_size=NUM_REQUESTS, max_context_len=128,
                    provider="torch").generate([p for p, _ in requests], [sp for _, sp in requests])
    llm = LLM(tiny, page_size=16, num_pages=14, max_batch_size=6, max_context_len=128, provider="torch",
              enable_prefix_caching=True, **options)
    pending = list(range(NUM_REQUESTS))
    ids: dict[int, int] = {}
    done: dict[int, object] = {}
    aborted = set()
    steps = 0
    while pending or llm.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                i = pending.pop(0)
                ids[llm.add_request(*requests[i])] = i
        unfinished = [rid for rid, i in ids.items() if i not in done and i not in aborted]
        if unfinished and rng.random() < 0.08:
            out = llm.abort(rng.choice(unfinished))
            assert out.finish_reason == "abort"
            aborted.add(ids[out.request_id])
        for out in llm.step():
            done[ids[out.request_id]] = out
        llm.pages.audit(llm.scheduler.running)
        steps += 1
        assert steps < 5000
    assert len(done) + len(aborted) == NUM_REQUESTS and aborted and done
    for i, out in done.items():
        assert out.token_ids == reference[i].token_ids, f"request {i} differs from the reference run"
    s = llm.stats
    assert s.preemptions > 0 and s.cached_prefix_tokens > 0
    # Nothing but the prefix cache holds pages now; emptying it frees them all.
    assert llm.pages.allocator.num_used == len(llm.pages.prefix_cache)
    llm.pages.prefix_cache.clear()
    assert llm.pages.allocator.num_used == 0
    print(f"{steps} steps, {len(done)} completed, {len(aborted)} aborted, {s.preemptions} preemptions, "
          f"{s.cached_prefix_tokens} prompt tokens from the prefix cache, acceptance {s.acceptance_rate:.2f}")


def test_abort_of_waiting_and_running_requests(tiny):
    llm = LLM(tiny, page_size=16, num_pages=32, max_batch_size=1, max_context_len=128, provider="torch")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = LLM(tiny, page_size=16, num_pages=32, max_context_len=128, provider="torch").generate([5, 6, 7], params)
    running = llm.add_request([1, 2, 3], params)
    waiting = llm.add_request([4] * 20, params)
    kept = llm.add_request([5, 6, 7], params)
    llm.step()
    llm.step()
    out = llm.abort(running)
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    assert llm.abort(waiting).token_ids == []
    assert llm.pages.allocator.num_used == 0
    with pytest.raises(ValueError, match="request_id"):
        llm.abort(running)
    outs = llm.generate([[9]], params)  # runs the kept request to completion too
    assert len(outs[0].token_ids) == 8
    assert not llm.has_unfinished() and kept not in llm._requests
    assert llm.pages.allocator.num_used == 0 and alone[0].token_ids
    # generate returned only its own request; the kept one's output waits for pop_finished, unchanged by
    # the aborts around it.
    finished = llm.pop_finished()
    assert list(finished) == [kept] and finished[kept].token_ids == alone[0].token_ids
    assert llm.pop_finished() == {}


def test_request_that_never_fits_fails_at_add(tiny):
    llm = LLM(tiny, page_size=16, num_pages=4, max_context_len=128, provider="torch")
    with pytest.raises(ValueError, match="num_pages"):
        llm.add_request([1] * 40, SamplingParams(max_tokens=20))
    llm.add_request([1] * 40, SamplingParams(max_tokens=8))  # 47 tokens: 3 pages fit
    spec = LLM(tiny, page_size=16, num_pages=4, max_context_len=128, provider="torch", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_pages"):
        spec.add_request([1] * 40, SamplingParams(max_tokens=8))  # + 2 draft slots: 4 pages
