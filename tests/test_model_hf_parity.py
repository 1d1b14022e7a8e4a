"""pagedmla's DeepSeek-V2/V3 against transformers' implementation, float32 on CPU.

Each variant is randomly initialised by transformers, written with ``save_pretrained`` and loaded by
pagedmla from that directory. Logits are compared as max |ours - theirs| / max |theirs| <= 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from hf_deepseek import HF_VARIANTS, hf_greedy, hf_logits, relative_error, save_hf_checkpoint

from pagedmla.backend import ForwardMode
from pagedmla.engine import LLM, ModelRunner, SamplingParams, Sequence
from pagedmla.model import load_model

pytest.importorskip("transformers")

RTOL = 1e-4
PAGE = 16
GEN = 32


@pytest.fixture(scope="module", params=HF_VARIANTS)
def pair(request, tmp_path_factory):
    """(transformers model, pagedmla model loaded from its save_pretrained directory)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(request.param, path)
    return hf, load_model(path, device="cpu", dtype=torch.float32)


def _prompts(lengths, vocab, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def _runner(model, **kwargs):
    return ModelRunner(model, page_size=PAGE, num_pages=64, max_batch_size=8, max_context_len=256,
                       provider="torch", **kwargs)


def _open(runner, prompt, cached=0):
    seq = Sequence(prompt, SamplingParams(), torch.device("cpu"))
    seq.slot = runner.table.add_request()
    runner.table.ensure_capacity(seq.slot, len(seq))
    seq.num_cached_tokens = cached
    return seq


def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    prompts = _prompts([1, 9, 17, 40], ours.config.vocab_size)
    runner = _runner(ours)
    seqs = [_open(runner, p) for p in prompts]
    logits = runner.run(seqs, ForwardMode.EXTEND, len(seqs), all_logits=True)
    assert runner.backend.attention_form == "mha"
    offset = 0
    for p in prompts:
        got = logits[offset: offset + len(p)]
        offset += len(p)
        assert relative_error(got, hf_logits(hf, p)) <= RTOL


@pytest.mark.parametrize("form", ["absorbed", "chunked"])
def test_prefill_over_cached_prefix_matches_transformers(pair, form):
    """A prefill resumed after a cached prefix runs the absorbed or the chunked-prefix MHA form; the
    chunk capacity is small so the prefix is folded in over several chunks."""
    hf, ours = pair
    prompts = _prompts([21, 40, 5], ours.config.vocab_size, seed=2)
    split = [13, 17, 2]
    runner = _runner(ours, extend_prefix_mode=form, backend_options={"chunked_prefix_capacity": 24})
    seqs = [_open(runner, p[:s]) for p, s in zip(prompts, split)]
    runner.run(seqs, ForwardMode.EXTEND, len(seqs))
    for seq, p in zip(seqs, prompts):
        seq.num_cached_tokens = len(seq)
        seq.token_ids = list(p)
        runner.table.ensure_capacity(seq.slot, len(seq))
    logits = runner.run(seqs, ForwardMode.EXTEND, len(seqs), all_logits=True)
    assert runner.backend.attention_form == form
    if form == "chunked":
        assert len(runner.backend.prefix_chunks) > 1
    offset = 0
    for p, s in zip(prompts, split):
        got = logits[offset: offset + len(p) - s]
        offset += len(p) - s
        assert relative_error(got, hf_logits(hf, p)[s:]) <= RTOL


def test_greedy_generation_matches_transformers(pair):
    hf, ours = pair
    prompts = _prompts([3, 15, 16, 30], ours.config.vocab_size, seed=3)
    llm = LLM(ours, page_size=PAGE, num_pages=64, max_batch_size=8, max_context_len=256, provider="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, GEN)
    assert llm.runner.table.allocator.num_used == 0  # finished requests gave their pages back


@pytest.mark.parametrize("mixed", [False, True], ids=["extend_then_decode", "mixed_steps"])
def test_requests_joining_mid_run_match_transformers(pair, mixed):
    """Continuous batching: two requests start, more join while they decode (and one waits for a free
    slot); with ``mixed`` the newcomers' prefills share MIXED steps with the running decodes."""
    hf, ours = pair
    prompts = _prompts([7, 18, 2, 33, 11], ours.config.vocab_size, seed=4)
    llm = LLM(ours, page_size=PAGE, num_pages=64, max_batch_size=3, max_context_len=256, provider="torch",
              mixed_batching=mixed)
    params = SamplingParams(max_tokens=GEN, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts[:2]]
    outputs = {}
    steps = 0
    while llm.has_unfinished():
        if steps == 5:
            ids += [llm.add_request(p, params) for p in prompts[2:]]
        outputs.update((o.request_id, o) for o in llm.step())
        steps += 1
    if mixed:
        assert llm.stats.mixed_steps > 0
    for rid, p in zip(ids, prompts):
        assert outputs[rid].token_ids == hf_greedy(hf, p, GEN)
