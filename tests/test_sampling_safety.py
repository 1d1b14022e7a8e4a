"""The sampler is safe for every parameter SamplingParams accepts, a request whose logits hold inf/NaN
fails alone, and an exception while sampling or post-processing one request finishes that request with
finish_reason "error" while the step's other requests go on."""

from __future__ import annotations

import math

import pytest
import torch

import pagedmla.engine.llm as llm_module
from pagedmla.engine import LLM, SamplingParams, sample
from pagedmla.engine.sampling import MIN_TEMPERATURE, NonFiniteLogitsError, sampling_probs
from pagedmla.engine.speculative import verify
from pagedmla.model import load_model

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


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


def _llm(model, **kwargs):
    return LLM(model, page_size=16, num_pages=64, max_context_len=128, provider="torch", **kwargs)


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


def test_extreme_parameters_generate_next_to_a_greedy_request(tiny):
    """The parameters that used to wedge the engine (temperature about 1e-38 or below, top_p below
    1.4e-45) each produce tokens, and a greedy request sharing their steps is unaffected."""
    alone = _llm(tiny).generate([PROMPT], GREEDY)[0].token_ids
    extreme = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, seed=1) for t in TINY_TEMPERATURES]
    extreme += [SamplingParams(temperature=1.0, top_p=p, max_tokens=6, ignore_eos=True, seed=2) for p in TINY_TOP_P]
    extreme += [SamplingParams(temperature=1e300, top_k=10 ** 12, max_tokens=6, ignore_eos=True, seed=3)]
    for mode in ({}, {"num_speculative_tokens": 2}, {"mixed_batching": True}):
        outs = _llm(tiny, **mode).generate([PROMPT] * (len(extreme) + 1), [GREEDY] + extreme)
        assert outs[0].token_ids == alone
        for out in outs:
            assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.error is None
            assert all(0 <= t < VOCAB for t in out.token_ids)
        # Below the floor, and with a top_p keeping one token, requests decode greedily.
        assert all(o.token_ids == alone for o in outs[1: 1 + len(TINY_TEMPERATURES) + len(TINY_TOP_P)])


def _poison_request(llm: LLM, victim: int, after_steps: int = 0) -> None:
    """Make the model's logits for request ``victim`` NaN from its ``after_steps``-th step on."""
    run = llm.runner.run
    seen = {"steps": 0}

    def poisoned(seqs, mode, num_extends, **kwargs):
        logits = run(seqs, mode, num_extends, **kwargs)
        ids = [s.seq_id for s in seqs]
        if victim in ids:
            seen["steps"] += 1
            if seen["steps"] > after_steps:
                per = logits.shape[0] // len(seqs)
                i = ids.index(victim)
                logits = logits.clone()
                logits[i * per:(i + 1) * per, 3] = math.nan
        return logits

    llm.runner.run = poisoned


@pytest.mark.parametrize("options", [{}, {"mixed_batching": True}, {"num_speculative_tokens": 2}],
                         ids=["extend_steps", "mixed_steps", "speculative"])
def test_nan_logits_fail_only_their_request(tiny, options):
    prompts = [PROMPT, [9, 10, 11], [12, 13] * 4]
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=6, ignore_eos=True)
    params = [GREEDY, sampled, GREEDY]
    expected = _llm(tiny, **options).generate(prompts, params)
    llm = _llm(tiny, **options)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    _poison_request(llm, ids[1], after_steps=2)
    outs = {}
    while llm.has_unfinished():
        for out in llm.step():
            outs[out.request_id] = out
        llm.pages.audit(llm.scheduler.running)
    failed = outs[ids[1]]
    assert failed.finish_reason == "error" and "inf or NaN" in failed.error
    assert failed.token_ids == expected[1].token_ids[: len(failed.token_ids)] and len(failed.token_ids) < 6
    for i in (0, 2):
        assert outs[ids[i]].token_ids == expected[i].token_ids and outs[ids[i]].error is None
    assert llm.pages.allocator.num_used == 0
    # The engine goes on serving.
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected[0].token_ids


def test_an_exception_sampling_one_request_fails_only_it(tiny, monkeypatch):
    """Any exception from the sampler: the batch is sampled again one request at a time and only the
    request that raises alone fails."""
    real = llm_module.sample

    def flaky(logits, params, generators):
        if any(p.max_tokens == 7 for p in params):
            raise RuntimeError("boom")
        return real(logits, params, generators)

    monkeypatch.setattr(llm_module, "sample", flaky)
    llm = _llm(tiny)
    outs = llm.generate([PROMPT, [1, 2, 3]], [GREEDY, SamplingParams(max_tokens=7)])
    assert outs[0].token_ids == _llm(tiny).generate([PROMPT], GREEDY)[0].token_ids
    assert outs[1].finish_reason == "error" and outs[1].error == "sampling raised RuntimeError: boom"
    assert outs[1].token_ids == [] and not llm.has_unfinished() and llm.pages.allocator.num_used == 0


def test_an_exception_post_processing_one_request_fails_only_it(tiny):
    llm = _llm(tiny)
    victim = llm.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    real = llm.scheduler._stop_reason

    def stop_reason(seq, token):
        if seq.seq_id == victim and seq.num_output_tokens == 2:
            raise KeyError("no such stop")
        return real(seq, token)

    llm.scheduler._stop_reason = stop_reason
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == _llm(tiny).generate([PROMPT], GREEDY)[0].token_ids
    failed = llm.pop_finished()[victim]
    assert failed.finish_reason == "error" and failed.error == "post-processing raised KeyError: 'no such stop'"
    assert llm.pages.allocator.num_used == 0


def test_a_tokenizer_that_cannot_decode_fails_only_its_request(tiny):
    class Tokenizer:
        def encode(self, text):
            return [int(t) for t in text.split()]

        def decode(self, ids, skip_special_tokens=False):
            if len(ids) == 3:
                raise IndexError("piece id is out of range")
            return " ".join(map(str, ids))

    llm = _llm(tiny, tokenizer=Tokenizer())
    outs = llm.generate(["5 6 7 8", "1 2"], [GREEDY, SamplingParams(max_tokens=3, ignore_eos=True)])
    # The text continues the prompt's (it is detokenised after the prompt's last tokens), so this tokenizer's
    # separating space comes first.
    assert outs[0].finish_reason == "length" and outs[0].text == "".join(f" {t}" for t in outs[0].token_ids)
    assert outs[1].finish_reason == "error" and outs[1].text is None and len(outs[1].token_ids) == 3
    assert outs[1].error == "tokenizer: decoding the output raised IndexError: piece id is out of range"


# ------------------------------------------------------------------------ samples, logprobs, streaming
def test_nan_logits_fail_only_their_sample_of_n(tiny):
    """A request of n samples: the one sample whose logits turn NaN ends "error", its siblings finish as
    they would have; RequestOutput.error reads the first sample's."""
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True, n=3)
    expected = _llm(tiny).generate([PROMPT], params)[0]
    llm = _llm(tiny)
    rid = llm.add_request(PROMPT, params)
    _poison_request(llm, llm._requests[rid].seqs[1].seq_id, after_steps=2)
    outs = {}
    while llm.has_unfinished():
        for out in llm.step():
            outs[out.request_id] = out
    out = outs[rid]
    failed = out.outputs[1]
    assert failed.finish_reason == "error" and "inf or NaN" in failed.error
    assert failed.token_ids == expected.outputs[1].token_ids[: len(failed.token_ids)] and len(failed.token_ids) < 6
    for i in (0, 2):
        assert out.outputs[i].token_ids == expected.outputs[i].token_ids and out.outputs[i].error is None
        assert out.outputs[i].finish_reason == "length"
    assert out.error is None and out.finish_reason == "length"
    assert llm.pages.allocator.num_used == 0


def test_an_exception_computing_logprobs_fails_only_that_request(tiny, monkeypatch):
    real = llm_module.token_logprobs

    def flaky(logits, tokens, top):
        if 3 in top:
            raise RuntimeError("boom")
        return real(logits, tokens, top)

    prompts = [PROMPT, [1, 2, 3], [9, 10]]
    params = [SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3), GREEDY]
    expected = _llm(tiny).generate(prompts, params)
    monkeypatch.setattr(llm_module, "token_logprobs", flaky)
    llm = _llm(tiny)
    outs = llm.generate(prompts, params)
    assert outs[1].finish_reason == "error" and outs[1].error == "log-probabilities raised RuntimeError: boom"
    assert outs[1].token_ids == [] and outs[1].outputs[0].logprobs == []
    for i in (0, 2):
        assert outs[i].token_ids == expected[i].token_ids and outs[i].error is None
    got, want = outs[0].outputs[0].logprobs, expected[0].outputs[0].logprobs
    # (Batched with other rows, the same logits may differ in the last bits.)
    assert len(got) == 5 and [e.keys() for e in got] == [e.keys() for e in want]
    assert all(e[t] == pytest.approx(w[t], abs=1e-4) for e, w in zip(got, want) for t in e)
    assert outs[2].outputs[0].logprobs is None and not llm.has_unfinished()
    assert llm.pages.allocator.num_used == 0


class _BreakableTokenizer:
    """Ids as space-separated numbers; ``decode`` raises while ``broken``."""

    broken = False

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        if self.broken:
            raise RuntimeError("decoder state lost")
        return " ".join(map(str, ids))


def test_a_tokenizer_failing_mid_stream_fails_only_the_stream(tiny):
    """The stream's text is built step by step: a decode that raises there finishes the streamed request
    with "error" (its last delta carries it) while a request running alongside finishes normally."""
    tok = _BreakableTokenizer()
    other = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = _llm(tiny).generate([[1, 2], PROMPT], [other, GREEDY])
    llm = _llm(tiny, tokenizer=tok)
    rid = llm.add_request([1, 2], other)
    stream = llm.stream(" ".join(map(str, PROMPT)), GREEDY)
    first = next(stream)
    assert first.token_ids == reference[1].token_ids[:1] and first.text == f" {first.token_ids[0]}"
    tok.broken = True
    rest = list(stream)
    tok.broken = False
    final = rest[-1].output
    assert final is not None and final.finish_reason == "error" and final.text is None
    assert final.error == "tokenizer: decoding the output raised RuntimeError: decoder state lost"
    assert final.token_ids == reference[1].token_ids[: len(final.token_ids)] and len(final.token_ids) == 2
    # The text streamed is what was decoded before the failure.
    assert "".join(d.text for d in [first, *rest]) == first.text
    outs = {}
    while llm.has_unfinished():
        outs.update((o.request_id, o) for o in llm.step())
    assert outs[rid].token_ids == reference[0].token_ids and outs[rid].error is None
    assert outs[rid].text == "".join(f" {t}" for t in reference[0].token_ids)
    assert llm.pages.allocator.num_used == 0
