"""Text in and out of the engine with a tokenizer.json only (the ``tokenizers`` package, no transformers):
vLLM-shaped outputs, stop strings and stop token ids, n samples, per-token logprobs, streaming."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_checkpoint import train_tokenizer, write_checkpoint

from pagedmla.backend import ForwardMode
from pagedmla.engine import LLM, ModelRunner, SamplingParams, Sequence
from pagedmla.engine.tokenizer import Detokenizer, find_stop, load_tokenizer

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, device="cpu", page_size=16, max_context_len=128, num_pages=64, provider="torch")


def test_text_in_text_out(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    completion = out.outputs[0]
    assert len(completion.token_ids) == 10 and completion.finish_reason == "length"
    assert completion.text == llm.tokenizer.decode(completion.token_ids) and completion.text
    # The fields callers used before outputs existed read the first completion.
    assert (out.token_ids, out.text, out.finish_reason) == (completion.token_ids, completion.text, "length")


def test_tokenizer_argument_is_checked_at_construction(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"^tokenizer: .* neither a tokenizer.json"):
        LLM("tiny", device="cpu", tokenizer=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"^tokenizer: .* no tokenizer files"):
        LLM("tiny", device="cpu", tokenizer=tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^tokenizer: .*tokenizer.json is not a readable tokenizer.json"):
        LLM("tiny", device="cpu", tokenizer=tmp_path)
    with pytest.raises(TypeError, match=r"^tokenizer: "):
        LLM("tiny", device="cpu", tokenizer=42)
    # A directory or a file path both work for the built-in model.
    for path in (checkpoint, checkpoint / "tokenizer.json"):
        tiny = LLM("tiny", device="cpu", tokenizer=path, max_context_len=64, page_size=16)
        assert tiny.generate("Hello", SamplingParams(max_tokens=2))[0].text is not None


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    big = train_tokenizer(tmp_path / "tokenizer.json", vocab_size=900)
    llm = LLM("tiny", device="cpu", tokenizer=big, max_context_len=64, page_size=16)
    # The text of an id above the model's vocabulary encodes back to ids that high.
    text = next(t for t in (llm.tokenizer.decode([i]) for i in range(512, 900)) if max(llm.tokenizer.encode(t)) >= 512)
    with pytest.raises(ValueError, match=r"^tokenizer: .*outside the model's vocabulary"):
        llm.generate(text)


def test_stop_strings_cut_text_and_tokens(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0]
    # A stop string made of a later token's text: generation ends at that token.
    pieces = [llm.tokenizer.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    cut = next(i for i in range(3, len(pieces)) if len(pieces[i]) > len(pieces[i - 1]) + 1 and
               pieces[i][len(pieces[i - 1]):] not in pieces[i - 1])
    stop = pieces[cut][len(pieces[cut - 1]):]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop, "never seen text"]))[0]
    got = out.outputs[0]
    at = full.text.find(stop)
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == full.text[:at]
    assert got.token_ids == full.token_ids[:len(got.token_ids)] and len(got.token_ids) <= cut


def test_stop_token_ids_report_the_token(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[full[3]]))[0]
    first = full.index(full[3])
    assert out.token_ids == full[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == full[3]


def test_stop_strings_need_a_tokenizer():
    llm = LLM("tiny", device="cpu", max_context_len=64, page_size=16)
    with pytest.raises(ValueError, match=r"^stop: "):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"^prompts: text prompts need a tokenizer"):
        llm.generate("text")


def test_n_samples_follow_their_seeds(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    single = llm.generate(PROMPT, params)[0]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, n=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == single.token_ids
    second = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert out.outputs[1].token_ids == second.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(c.text == llm.tokenizer.decode(c.token_ids) for c in out.outputs)


def test_n_samples_through_add_request_and_abort(llm):
    rid = llm.add_request(PROMPT, SamplingParams(max_tokens=50, n=2, temperature=0.8, seed=1, ignore_eos=True))
    assert llm.step() == []
    out = llm.abort(rid)
    assert out.request_id == rid and len(out.outputs) == 2
    assert all(c.finish_reason == "abort" for c in out.outputs) and not llm.has_unfinished()


def _reference_logprobs(llm, prompt_ids, output_ids):
    """log_softmax of the model's logits at each generated position, from one prefill of the whole text."""
    runner = ModelRunner(llm.model, page_size=16, num_pages=16, max_batch_size=1, max_context_len=128,
                         provider="torch")
    seq = Sequence(prompt_ids + output_ids[:-1], SamplingParams(), torch.device("cpu"))
    seq.slot = runner.table.add_request()
    runner.table.ensure_capacity(seq.slot, len(seq))
    logits = runner.run([seq], ForwardMode.EXTEND, 1, all_logits=True)
    return logits[len(prompt_ids) - 1:].log_softmax(dim=-1)


@pytest.mark.parametrize("speculative", [0, 3], ids=["plain", "speculative"])
def test_logprobs_match_the_model_distribution(checkpoint, speculative):
    llm = LLM(checkpoint, device="cpu", page_size=16, max_context_len=128, num_pages=64, provider="torch",
              num_speculative_tokens=speculative)
    # A repetitive prompt gives the n-gram drafter proposals, so verify steps produce several tokens at once.
    prompt = "ab ab ab ab ab ab ab"
    out = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3))[0].outputs[0]
    ids = out.token_ids
    assert len(out.logprobs) == len(ids) == 10
    ref = _reference_logprobs(llm, llm.tokenizer.encode(prompt), ids)
    for j, (entry, token) in enumerate(zip(out.logprobs, ids)):
        top = ref[j].topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for t, value in entry.items():
            assert value == pytest.approx(ref[j, t].item(), abs=1e-4)
        assert entry[token] == max(entry.values())  # greedy: the produced token is the most likely
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(out.logprobs, ids)))
    if speculative:
        assert llm.stats.verify_steps > 0


def test_stream_deltas_add_up_to_the_output(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPT, params)[0]
    deltas = list(llm.stream(PROMPT, params))
    assert deltas[-1].output is not None and all(d.output is None for d in deltas[:-1])
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids == deltas[-1].output.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    stop = expected.text[len(expected.text) // 2:][:3]
    deltas = list(llm.stream(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop])))
    final = deltas[-1].output
    assert final.outputs[0].stop_reason == stop and "".join(d.text for d in deltas) == final.text
    with pytest.raises(ValueError, match=r"^params: "):
        next(llm.stream(PROMPT, SamplingParams(n=2)))


def test_detokenizer_holds_back_split_characters(checkpoint):
    tok = load_tokenizer(checkpoint)
    text = " héllo wörld ✓ zz"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # rare characters split into byte tokens
    det = Detokenizer(tok)
    pieces = [det.push(t) for t in ids]
    assert "".join(pieces) + det.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_find_stop_searches_only_new_text():
    assert find_stop("abcXYZdef", ["XYZ", "def"]) == (3, "XYZ")
    assert find_stop("abcXYZdef", ["XYZ"], start=7) is None
    assert find_stop("abcXYZ", ["XYZ"], start=5) == (3, "XYZ")


def test_tokenizer_objects_are_accepted(checkpoint):
    from tokenizers import Tokenizer

    expected = LLM(checkpoint, device="cpu", page_size=16, max_context_len=64).generate(
        PROMPT, SamplingParams(max_tokens=4))[0]
    objects = [Tokenizer.from_file(str(checkpoint / "tokenizer.json"))]
    if importlib.util.find_spec("transformers") is not None:
        from transformers import PreTrainedTokenizerFast

        objects.append(PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json")))
    for obj in objects:
        llm = LLM("tiny", device="cpu", page_size=16, max_context_len=64, tokenizer=obj)
        out = llm.generate(PROMPT, SamplingParams(max_tokens=4))[0]
        assert (out.prompt_token_ids, out.token_ids, out.text) == \
            (expected.prompt_token_ids, expected.token_ids, expected.text)
