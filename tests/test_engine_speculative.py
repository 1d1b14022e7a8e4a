"""Draft verification rules: greedy acceptance, and rejection sampling that leaves the target distribution
unchanged for point-mass (n-gram) drafts."""

from __future__ import annotations

import pytest
import torch

from pagedmla.engine import LLM, SamplingParams
from pagedmla.engine.sampling import sampling_probs
from pagedmla.engine.speculative import accept_greedy, accept_sampled, verify
from pagedmla.model import load_model


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert accept_greedy(logits, [3, 5, 7]) == [3, 5, 7, 9]  # all accepted + bonus
    assert accept_greedy(logits, [3, 4, 7]) == [3, 5]  # first mismatch replaced by the target's choice
    assert accept_greedy(logits, [0, 5, 7]) == [3]


@pytest.mark.parametrize("draft_token", [0, 2, 4])
def test_rejection_sampling_keeps_the_target_distribution(draft_token):
    """First emitted token over many trials ~ p, whatever the draft (likely, middling or unlikely)."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0], [0.0] * 5])
    params = SamplingParams(temperature=0.8)
    p = sampling_probs(logits[0], params)
    gen = torch.Generator().manual_seed(draft_token)
    trials = 6000
    counts = torch.zeros(5)
    accepted = 0
    for _ in range(trials):
        out = accept_sampled(logits, [draft_token], params, gen)
        counts[out[0]] += 1
        accepted += len(out) == 2
    tv = 0.5 * (counts / trials - p).abs().sum().item()
    assert tv < 0.03, f"emitted distribution is {tv:.3f} (total variation) from the target's"
    assert abs(accepted / trials - p[draft_token].item()) < 0.03  # acceptance probability = p(draft)


def test_rejection_with_top_p_mass_renormalised():
    """top_p leaves unnormalised mass; a rejected draft must still resample from what remains."""
    logits = torch.tensor([[3.0, 2.9, -5.0, -5.0], [0.0] * 4])
    params = SamplingParams(temperature=1.0, top_p=0.5)
    gen = torch.Generator().manual_seed(0)
    outs = {accept_sampled(logits, [1], params, gen)[0] for _ in range(200)}
    assert outs == {0}  # top_p keeps only token 0; draft 1 is always rejected


def test_verify_checks_shapes():
    logits = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="drafts"):
        verify(logits, [[1, 2], [3]], [SamplingParams()] * 2, [None] * 2)
    with pytest.raises(ValueError, match="logits"):
        verify(logits, [[1]] * 4, [SamplingParams()] * 4, [None] * 4)
    assert verify(logits, [[0, 0], [1, 1]], [SamplingParams()] * 2, [None] * 2) == [[0, 0, 0], [0]]


def test_two_drafts_keep_the_target_distribution_at_each_position():
    """With two drafts, the first emitted token follows p_0, and after an accepted first draft the second
    follows p_1 (a different distribution), accepted or resampled."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0], [-0.5, 1.5, 0.0, 1.0, 0.5], [0.0] * 5])
    params = SamplingParams(temperature=0.8, top_k=4)
    p = sampling_probs(logits, params)
    gen = torch.Generator().manual_seed(7)
    trials = 8000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(trials):
        out = accept_sampled(logits, [0, 3], params, gen)
        first[out[0]] += 1
        if out[0] == 0:  # the first draft was accepted (a rejection resamples without it)
            second[out[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        tv = 0.5 * (counts / counts.sum() - target).abs().sum().item()
        assert tv < 0.03, f"emitted distribution is {tv:.3f} (total variation) from the target's"
    assert second.sum() > trials / 3  # p_0(0) ~ 0.6: enough samples behind the first draft


def test_sampled_speculative_decoding_in_the_engine():
    """Seeded sampling with k = 3 drafts: runs to max_tokens inside the vocabulary, verifying drafts, and
    the same seeds give the same tokens."""
    tiny = load_model("tiny", device="cpu", dtype=torch.float32)
    prompts = [list(range(2, 12)) * 4, [5, 6, 7] * 5, [300, 301]]
    params = [SamplingParams(temperature=0.7, top_k=8, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]

    def run():
        llm = LLM(tiny, page_size=16, max_context_len=128, provider="torch", num_speculative_tokens=3)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.stats

    tokens, stats = run()
    assert all(len(t) == 30 and all(0 <= x < tiny.config.vocab_size for x in t) for t in tokens)
    assert stats.verify_steps > 0 and stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0
    assert stats.decode_tokens == sum(len(t) for t in tokens) - len(prompts)  # the first came from prefill
    assert run()[0] == tokens
