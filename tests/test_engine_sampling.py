"""SamplingParams validation and the sampler."""

from __future__ import annotations

import pytest
import torch

from pagedmla.engine import SamplingParams, sample


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_params_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def _logits(bs=3, vocab=50, seed=0):
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_one_take_the_argmax():
    logits = _logits()
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.0)]
    assert sample(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_best_token():
    logits = _logits()
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 3
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_restricts_the_support():
    logits = _logits(bs=1, vocab=20)
    allowed = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(logits, [SamplingParams(temperature=5.0, top_k=3)], [gen])[0] for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = _logits(bs=2)
    p = SamplingParams(temperature=1.0, seed=7)
    first = [sample(logits[:1], [p], [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    paired = sample(logits, [p, p], [torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)])
    assert len(set(first)) == 1 and paired[0] == first[0]


def test_rows_must_match_params():
    with pytest.raises(ValueError, match="logits/params/generators"):
        sample(_logits(bs=2), [SamplingParams()], [None])
