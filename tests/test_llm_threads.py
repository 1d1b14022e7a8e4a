"""The thread contract of ``LLM``: concurrent ``generate`` calls run one after the other, each returning
exactly its own requests' outputs, and ``add_request`` / ``step`` / ``abort`` may be called from different
threads (a server). Bounded two-thread stress tests: every thread must finish within its timeout (no
hang) and every output must equal the same request run alone (no mixing)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model

JOIN_TIMEOUT_S = 120  # a hang, not a slow machine: each test's work takes a few seconds


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


def _llm(model, **kwargs):
    kwargs.setdefault("num_pages", 48)
    return LLM(model, page_size=16, max_context_len=128, max_num_batched_tokens=32, provider="torch", **kwargs)


def _workloads(seed: int, calls: int, per_call: int) -> list[list[tuple[list[int], SamplingParams]]]:
    rng = random.Random(seed)
    return [[([rng.randrange(512) for _ in range(rng.randint(1, 40))],
              SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)) for _ in range(per_call)]
            for _ in range(calls)]


def _run_threads(targets) -> list[BaseException]:
    """Start one thread per target at the same moment; join each within the timeout; the exceptions
    they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(target):
        def run():
            try:
                barrier.wait()
                target()
            except BaseException as exc:  # reported to the test thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive(), "a thread hung"
    return errors


def test_concurrent_generate_calls_run_one_after_the_other(tiny):
    """Two threads call generate() on one LLM, three times each: no step mixes the requests of two
    calls (the calls are serialised), and each call returns its own requests' outputs, equal to a
    single-threaded run of them."""
    workloads = _workloads(0, calls=6, per_call=4)
    reference = [_llm(tiny).generate([p for p, _ in w], [sp for _, sp in w]) for w in workloads]
    llm = _llm(tiny)
    step_requests: list[frozenset[int]] = []
    run = llm.runner.run

    def spy(seqs, *args, **kwargs):
        step_requests.append(frozenset(s.seq_id for s in seqs))
        return run(seqs, *args, **kwargs)

    llm.runner.run = spy
    results: dict[int, list] = {}

    def caller(calls):
        def go():
            for c in calls:
                results[c] = llm.generate([p for p, _ in workloads[c]], [sp for _, sp in workloads[c]])
        return go

    errors = _run_threads([caller([0, 2, 4]), caller([1, 3, 5])])
    assert not errors, errors
    for c, outs in results.items():
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference[c]], f"call {c} got other outputs"
    calls_of = {o.request_id: c for c, outs in results.items() for o in outs}
    assert len(calls_of) == 24
    for ids in step_requests:
        assert len({calls_of[i] for i in ids}) == 1, f"a step ran requests of two generate calls: {sorted(ids)}"
    assert not llm.has_unfinished() and llm.pages.allocator.num_used == 0 and llm.pop_finished() == {}


def test_a_stepping_thread_and_a_thread_adding_and_aborting(tiny):
    """A server's shape: one thread steps while the other adds 24 requests and aborts some of them. Every
    request ends exactly once (finished or aborted), the completed ones equal a single-threaded run,
    and the page books balance."""
    requests = _workloads(1, calls=1, per_call=24)[0]
    reference = _llm(tiny).generate([p for p, _ in requests], [sp for _, sp in requests])
    llm = _llm(tiny, num_pages=12, max_batch_size=4)  # small enough to preempt
    finished: dict[int, object] = {}
    aborted: dict[int, object] = {}
    ids: dict[int, int] = {}
    adding_done = threading.Event()

    def stepper():
        while not adding_done.is_set() or llm.has_unfinished():
            for out in llm.step():
                assert out.request_id not in finished
                finished[out.request_id] = out
            # Let the adder in between steps: Python's lock is not fair, and a stepper that takes it back at
            # once can finish every request before any abort gets the lock (a flaky empty ``aborted``).
            time.sleep(0)

    def adder():
        rng = random.Random(2)
        try:
            for i, (prompt, params) in enumerate(requests):
                time.sleep(rng.uniform(0, 0.02))  # spread the calls over the steps (pacing, nothing timed)
                rid = llm.add_request(prompt, params)
                ids[rid] = i
                # Until one abort has landed, the second half of the requests also abort the one just added
                # (most earlier ones may be done): the test needs aborts to check.
                if rng.random() < 0.25 or (not aborted and 2 * i >= len(requests)):
                    victim = rng.choice(list(ids)) if aborted else rid
                    try:
                        aborted[victim] = llm.abort(victim)
                    except ValueError:
                        pass  # it finished already
        finally:
            adding_done.set()

    errors = _run_threads([stepper, adder])
    assert not errors, errors
    assert aborted and not set(aborted) & set(finished) and len(finished) + len(aborted) == len(requests)
    for rid, out in finished.items():
        assert out.token_ids == reference[ids[rid]].token_ids, f"request {ids[rid]} mixed up"
    for rid, out in aborted.items():
        assert out.finish_reason == "abort"
        assert out.token_ids == reference[ids[rid]].token_ids[: len(out.token_ids)]
    llm.pages.audit(llm.scheduler.running)
    assert llm.pages.allocator.num_used == 0


def _lock_is_free(llm: LLM) -> bool:
    """Whether another thread could take the engine's lock now (probed without waiting)."""
    got: list[bool] = []

    def probe():
        ok = llm._lock.acquire(blocking=False)
        if ok:
            llm._lock.release()
        got.append(ok)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(JOIN_TIMEOUT_S)
    assert not t.is_alive(), "the probe hung"
    return got[0]


def test_a_stream_holds_the_lock_until_it_ends_or_is_closed(tiny):
    """LLM.stream is generate yielding midway: between its deltas no other thread may step, add or abort
    (they would take its request's output away from it), and the lock is free again once it ends or is
    closed."""
    llm = _llm(tiny)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    stream = llm.stream([1, 2, 3], params)
    assert _lock_is_free(llm)  # nothing runs before the first delta is asked for
    deltas = [next(stream)]
    assert not _lock_is_free(llm)
    deltas += list(stream)
    assert _lock_is_free(llm)
    assert deltas[-1].output.token_ids == _llm(tiny).generate([[1, 2, 3]], params)[0].token_ids
    abandoned = llm.stream([4, 5, 6], params)
    next(abandoned)
    assert not _lock_is_free(llm)
    abandoned.close()
    assert _lock_is_free(llm)
