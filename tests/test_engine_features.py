"""Engine features against transformers (tiny HF models, float32, CPU): chunked prefill, MIXED steps,
prefix caching, preemption and speculative decoding each leave greedy output token for token equal to
transformers' greedy generate, and the page books balance after every step (``drive`` audits them)."""

from __future__ import annotations

import pytest
import torch
from engine_driver import drive
from hf_deepseek import HF_VARIANTS, hf_greedy, save_hf_checkpoint

from pagedmla.backend import ForwardMode
from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model

pytest.importorskip("transformers")

PAGE = 16
GEN = 24
# EOS stops both engines (transformers' min_new_tokens would instead forbid EOS, a different greedy rule).
GREEDY = SamplingParams(max_tokens=GEN)
VARIANTS = HF_VARIANTS


class Case:
    """A transformers model, pagedmla's model loaded from its checkpoint, and memoised HF greedy outputs."""

    def __init__(self, hf, ours):
        self.hf = hf
        self.model = ours
        self.vocab = ours.config.vocab_size
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def expected(self, prompts: list[list[int]]) -> dict[int, list[int]]:
        for p in prompts:
            if tuple(p) not in self._greedy:
                self._greedy[tuple(p)] = hf_greedy(self.hf, p, GEN, stop_at_eos=True)
        return {i: self._greedy[tuple(p)] for i, p in enumerate(prompts)}

    def llm(self, **kwargs) -> LLM:
        kwargs.setdefault("num_pages", 96)
        kwargs.setdefault("max_batch_size", 8)
        return LLM(self.model, page_size=PAGE, max_context_len=256, provider="torch", **kwargs)


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(request.param, path)
    return Case(hf, load_model(path, device="cpu", dtype=torch.float32))


def _prompts(lengths, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def _count_step_tokens(llm: LLM) -> list[int]:
    """Record the tokens every model step of ``llm`` runs (in the returned list, filled as it runs)."""
    run_tokens = []
    original = llm.runner.run

    def spy(seqs, mode, num_extends, *, tokens=None, **kwargs):
        run_tokens.append(sum(len(t) for t in tokens) if tokens is not None else len(seqs))
        return original(seqs, mode, num_extends, tokens=tokens, **kwargs)

    llm.runner.run = spy
    return run_tokens


def _shared_prefix_prompts(vocab, seed=5):
    """Four prompts behind one 40-token prefix (two full pages and a partial one), suffixes of 3..30 tokens."""
    prefix = _prompts([40], vocab, seed)[0]
    return [prefix + s for s in _prompts([3, 30, 9, 17], vocab, seed + 1)]


@pytest.mark.parametrize("mixed", [False, True], ids=["extend_steps", "mixed_steps"])
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_chunked_prefill_matches_transformers(case, budget, mixed):
    prompts = _prompts([5, 70, 23, 40, 17], case.vocab, seed=11)
    llm = case.llm(max_num_batched_tokens=budget, mixed_batching=mixed)
    run_tokens = _count_step_tokens(llm)
    run = drive(llm, prompts, GREEDY, join_at=[0, 0, 0, 3, 6])
    assert run.outputs == case.expected(prompts)
    s = llm.stats
    assert max(run_tokens) <= budget
    if budget == 16:
        # The 70-token prompt alone needs five chunks; its later chunks run over their cached prefix
        # (absorbed), in EXTEND steps, or with mixed batching in the MIXED steps they share with decodes.
        assert s.prefill_steps + s.mixed_steps >= 5
        assert (ForwardMode.MIXED if mixed else ForwardMode.EXTEND, "absorbed") in run.forms
    if mixed:
        assert s.mixed_steps > 0
    else:
        assert s.mixed_steps == 0
    assert llm.pages.allocator.num_used == 0


def test_budget_bounds_every_step(case):
    prompts = _prompts([70, 33, 4], case.vocab, seed=12)
    llm = case.llm(max_num_batched_tokens=16, mixed_batching=True)
    run_tokens = _count_step_tokens(llm)
    assert drive(llm, prompts, GREEDY).outputs == case.expected(prompts)
    assert max(run_tokens) <= 16 and run_tokens.count(16) >= 5


@pytest.mark.parametrize("form", ["absorbed", "chunked"])
def test_prefix_caching_matches_transformers_with_fewer_pages(case, form):
    prompts = _shared_prefix_prompts(case.vocab)
    join_at = [0, 2, 2, 3]  # the first request's prompt is written (and cached) before the others arrive
    plain = drive(case.llm(), prompts, GREEDY, join_at)
    llm = case.llm(enable_prefix_caching=True, extend_prefix_mode=form)
    cached = drive(llm, prompts, GREEDY, join_at)
    assert plain.outputs == cached.outputs == case.expected(prompts)
    # Three later requests each reuse the two full prefix pages (32 tokens).
    assert llm.stats.cached_prefix_tokens == 3 * 2 * PAGE
    assert (ForwardMode.EXTEND, form) in cached.forms
    assert cached.peak_pages < plain.peak_pages
    # Finished requests left their full pages to the cache; releasing the cache frees everything.
    assert llm.pages.allocator.num_used == len(llm.pages.prefix_cache) > 0
    llm.pages.prefix_cache.clear()
    assert llm.pages.allocator.num_used == 0


def test_preemption_under_a_tiny_cache_matches_transformers(case):
    prompts = _prompts([30, 12, 45, 20, 8], case.vocab, seed=13)
    # 9 usable pages: the longest request needs 5 (68 tokens), all of them together 17.
    llm = case.llm(num_pages=10, mixed_batching=True, max_num_batched_tokens=32)
    run = drive(llm, prompts, GREEDY)
    assert run.outputs == case.expected(prompts)
    assert llm.stats.preemptions > 0
    assert run.peak_pages <= 9 and llm.pages.allocator.num_used == 0


def test_preemption_with_prefix_caching_matches_transformers(case):
    prompts = _shared_prefix_prompts(case.vocab, seed=7)
    llm = case.llm(num_pages=11, enable_prefix_caching=True, max_num_batched_tokens=24)
    run = drive(llm, prompts, GREEDY, join_at=[0, 1, 1, 4])
    assert run.outputs == case.expected(prompts)
    assert llm.stats.preemptions > 0 and llm.stats.cached_prefix_tokens > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_decoding_matches_transformers(case, k):
    prompts = _prompts([6, 31, 18], case.vocab, seed=14)
    repetitive = list(range(2, 12)) * 4
    prompts.append(repetitive)
    llm = case.llm(num_speculative_tokens=k, max_num_batched_tokens=32)
    run = drive(llm, prompts, GREEDY, join_at=[0, 0, 2, 4])
    assert run.outputs == case.expected(prompts)
    s = llm.stats
    assert s.verify_steps > 0 and s.draft_tokens > 0
    assert 0 < s.acceptance_rate <= 1
    assert (ForwardMode.TARGET_VERIFY, "absorbed") in run.forms
    print(f"k={k}: acceptance rate {s.acceptance_rate:.2f} ({s.accepted_draft_tokens}/{s.draft_tokens}), "
          f"{s.verify_steps} verify steps, {s.decode_steps} decode steps")
    assert llm.pages.allocator.num_used == 0


def test_speculative_decoding_under_a_tiny_cache(case):
    prompts = _prompts([30, 12, 45], case.vocab, seed=15) + [list(range(2, 10)) * 3]
    llm = case.llm(num_pages=10, num_speculative_tokens=3, enable_prefix_caching=True, max_num_batched_tokens=32)
    run = drive(llm, prompts, GREEDY)
    assert run.outputs == case.expected(prompts)
    assert llm.stats.preemptions > 0 and llm.stats.verify_steps > 0
