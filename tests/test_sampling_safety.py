"""The sampler is safe for every parameter SamplingParams accepts, and a request whose logits hold
inf/NaN is reported alone."""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla.engine import SamplingParams, sample
from pagedmla.engine.sampling import MIN_TEMPERATURE, NonFiniteLogitsError, sampling_probs
from pagedmla.engine.speculative import verify

VOCAB = 512
TINY_TEMPERATURES = [5e-324, 1e-45, 1e-38, 1e-30, MIN_TEMPERATURE / 2]
TINY_TOP_P = [5e-324, 1e-45, 1e-38, 1e-20]


def _logits(rows: int, scale: float = 4.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_temperatures_below_the_floor_act_as_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=7, seed=1)
    assert params.greedy
    logits = _logits(4)
    assert sample(logits, [params] * 4, [None] * 4) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", TINY_TOP_P)
@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-3, 1.0, 1e30, 1e300])
def test_tiny_top_p_keeps_the_top_token_at_any_temperature(top_p, temperature):
    logits = _logits(3)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    params = [SamplingParams(temperature=temperature, top_p=top_p)] * 3
    probs = sampling_probs(logits, params[0])
    assert torch.isfinite(probs).all() and ((probs > 0).sum(-1) == 1).all()
    tokens = sample(logits, params, gens)
    assert tokens == probs.argmax(-1).tolist()
    if temperature <= 1.0:
        # (Hotter, softmax flattens to equal float32 probabilities and any of them is "the top".)
        assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-4, 0.7, 1e30, 1e300])
@pytest.mark.parametrize("scale", [1.0, 1e30, 3e38])
def test_any_finite_logits_give_a_distribution(temperature, scale):
    """Huge finite logits (up to float32's limit) with the smallest and largest accepted temperatures:
    a finite distribution summing to 1, and a token in the vocabulary."""
    logits = _logits(2, scale=1.0)
    logits = logits / logits.abs().max() * scale
    for top_k in (0, 5, 10 ** 12):
        p = SamplingParams(temperature=temperature, top_k=top_k, seed=3)
        probs = sampling_probs(logits, p)
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(2))
        tokens = sample(logits, [p, p], [torch.Generator().manual_seed(0), None])
        assert all(0 <= t < VOCAB for t in tokens)
    # At the floor the largest logit takes essentially all the mass.
    if temperature == MIN_TEMPERATURE:
        assert sampling_probs(logits, SamplingParams(temperature=temperature)).max(-1).values.min() > 0.99


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -1e-300}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": -0.0}, "top_p"),
    ({"seed": 1 << 64}, "seed"),
    ({"seed": -(1 << 63) - 1}, "seed"),
])
def test_validation_refuses_what_the_sampler_cannot_use(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [-(1 << 63), (1 << 64) - 1])
def test_seeds_at_the_ends_of_the_range_work(seed):
    p = SamplingParams(temperature=1.0, seed=seed)
    assert 0 <= sample(_logits(1), [p], [torch.Generator().manual_seed(seed)])[0] < VOCAB


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_row_is_reported_and_the_others_stand(bad):
    logits = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0, seed=6),
              SamplingParams()]
    clean = sample(logits, params, [torch.Generator().manual_seed(p.seed or 0) for p in params])
    for row in (0, 1):
        broken = logits.clone()
        broken[row, 17] = bad
        with pytest.raises(NonFiniteLogitsError) as exc:
            sample(broken, params, [torch.Generator().manual_seed(p.seed or 0) for p in params])
        assert exc.value.rows == [row]
        assert exc.value.tokens == [None if i == row else t for i, t in enumerate(clean)]


def test_verify_reports_a_non_finite_request_and_keeps_the_others():
    k = 2
    logits = _logits(3 * (k + 1))
    drafts = [[1, 2], [3, 4], [5, 6]]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=2), SamplingParams()]

    def gens():
        return [None, torch.Generator().manual_seed(2), None]

    clean = verify(logits, drafts, params, gens())
    for request in range(3):
        broken = logits.clone()
        broken[request * (k + 1) + 1, 0] = math.nan
        with pytest.raises(NonFiniteLogitsError) as exc:
            verify(broken, drafts, params, gens())
        assert exc.value.rows == [request]
        assert exc.value.tokens == [None if i == request else t for i, t in enumerate(clean)]
