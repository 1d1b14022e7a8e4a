"""On a CUDA device: the tiny model in bf16 runs the same with the Triton and the torch providers.

The tiny configuration trained on a task that needs attention (tests/trained_tiny.py) generates
identical greedy tokens with both providers, eager and graph-replayed, and they are the right tokens.

With random weights, two numerically different bf16 attention paths cannot promise identical
free-running greedy tokens: the next-token logits often have near-ties and one flip changes everything
after it (measured on the H200, 2026-11-30: the torch provider in bf16 differs from itself when the same
prompts run one by one instead of batched in 2 of 5 streams, and from float32 in 5 of 5). So for the
random model the checks are: every attention call of a real generation is run by both providers on the
same inputs and agrees to bf16 accuracy; free-running, the token streams are equal up to their first
difference, and that difference is a near-tie smaller than the providers' measured logit difference.
"""

from __future__ import annotations

import pytest
import torch
from trained_tiny import PERIOD, continuation, periodic_batch, train_tiny

from pagedmla.backend import MLABackend
from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model

pytestmark = pytest.mark.gpu
PROMPT_LENS = (1, 8, 40, 100, 257)
NEW_TOKENS = 32
# Graph replays bypass the Python forward the shadow test wraps; the graph path has its own GPU test.
NO_GRAPHS = {"enable_cuda_graph": False}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _run(model, provider: str):
    """Greedy generation recording each step's logits per (prompt, output index)."""
    llm = LLM(model, page_size=64, max_batch_size=4, max_context_len=1024, provider=provider, **NO_GRAPHS)
    assert llm.runner.backend.provider == provider
    logits_of: dict[tuple, torch.Tensor] = {}
    run = llm.runner.run

    def recording_run(seqs, mode, num_extends, **kwargs):
        logits = run(seqs, mode, num_extends, **kwargs)
        for seq, row in zip(seqs, logits):
            logits_of[(tuple(seq.prompt_token_ids), seq.num_output_tokens)] = row.float().cpu()
        return logits

    llm.runner.run = recording_run
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return {tuple(o.prompt_token_ids): o.token_ids for o in outs}, logits_of


def test_every_attention_call_of_a_generation_agrees(monkeypatch):
    """The engine drives the torch provider; every attention call the model makes is also run, on the same
    inputs and cache, by a Triton backend planned from the same batches, and the two must agree."""
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, page_size=64, max_batch_size=4, max_context_len=1024, provider="torch", **NO_GRAPHS)
    ref_backend = llm.runner.backend
    triton_backend = MLABackend(ref_backend.config, device=ref_backend.device, provider="triton")
    plan, forward = ref_backend.init_forward_metadata, ref_backend.forward
    errors: dict[str, list[float]] = {}

    def plan_both(batch):
        plan(batch)
        triton_backend.init_forward_metadata(batch)

    def forward_both(q, k, v, layer, out_cache_loc, cache, *, save_kv_cache=True, **kwargs):
        ref = forward(q, k, v, layer, out_cache_loc, cache, save_kv_cache=save_kv_cache, **kwargs)
        # The rows are already stored: the Triton backend only reads them.
        out = triton_backend.forward(q, k, v, layer, out_cache_loc, cache, save_kv_cache=False, **kwargs)
        key = f"{ref_backend.metadata.mode.value}/{ref_backend.attention_form}"
        errors.setdefault(key, []).append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
        return ref

    monkeypatch.setattr(ref_backend, "init_forward_metadata", plan_both)
    monkeypatch.setattr(ref_backend, "forward", forward_both)
    llm.generate(_prompts(), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert {"extend/mha", "decode/absorbed"} <= set(errors)
    worst = {key: max(values) for key, values in errors.items()}
    print("worst relative difference per step kind:", worst)
    assert all(w < 2e-2 for w in worst.values()), worst


def test_free_running_greedy_tokens_agree_up_to_near_ties():
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    ref_tokens, ref = _run(model, "torch")
    got_tokens, got = _run(model, "triton")
    identical = 0
    for key, want in ref_tokens.items():
        have = got_tokens[key]
        first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if first is None:
            identical += 1
            continue
        # Same history up to `first`, so both providers' logits at that step are comparable.
        r, g = ref[(key, first)], got[(key, first)]
        gap = (r[want[first]] - r[have[first]]).item()
        noise = (g - r).abs().max().item()
        assert gap <= 2 * noise, (f"prompt length {len(key)}: tokens differ at step {first} although the torch "
                                  f"provider preferred {want[first]} by {gap:.3f} (provider difference {noise:.3f})")
    print(f"{identical}/{len(ref_tokens)} prompts generated identical {NEW_TOKENS}-token greedy streams")


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """(checkpoint directory, its next-token accuracy): the tiny model trained once per worker."""
    hf, accuracy = train_tiny("cuda")
    assert accuracy > 0.99, f"training the tiny model on the periodic task reached only {accuracy:.3f}"
    path = tmp_path_factory.mktemp("trained_tiny")
    hf.save_pretrained(path)
    return path, accuracy


def _trained_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [periodic_batch(1, n, gen, "cpu")[0].tolist() for n in (PERIOD, 17, 40, 100, 120)]


def _trained_streams(path, provider: str, graphs: bool, kv_cache_dtype: str = "auto") -> list[list[int]]:
    model = load_model(path, device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, page_size=16, max_batch_size=8, max_context_len=512, provider=provider,
              enable_cuda_graph=graphs, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_trained_prompts(), params)]


def _continuing(streams: list[list[int]]) -> int:
    """Generated tokens that continue their prompt's pattern."""
    want = [continuation(prompt, NEW_TOKENS) for prompt in _trained_prompts()]
    return sum(a == b for got, w in zip(streams, want) for a, b in zip(got, w))


def test_trained_tiny_model_greedy_tokens_identical_across_providers(trained_tiny):
    """bf16, page size 16 (every prompt crosses pages): torch, Triton and Triton with CUDA graphs give the
    same 32 greedy tokens for every prompt, and nearly all of them continue the pattern (attention does
    the work). Prompt + output stay within the 160 positions the model was trained on."""
    path, accuracy = trained_tiny
    streams = {(provider, graphs): _trained_streams(path, provider, graphs)
               for provider, graphs in (("torch", False), ("triton", False), ("triton", True))}
    for prompt, *runs in zip(_trained_prompts(), *streams.values()):
        assert all(run == runs[0] for run in runs), (len(prompt), runs)
    # The model is ~99.5% accurate, so a rare wrong token (made identically by every provider) is allowed;
    # with broken attention about 1 token in 64 would continue the pattern.
    right = _continuing(streams[("torch", False)])
    total = len(_trained_prompts()) * NEW_TOKENS
    print(f"trained tiny model (accuracy {accuracy:.3f}): {right}/{total} generated tokens "
          "continue the pattern; torch, triton and triton + CUDA graphs identical")
    assert right >= 0.9 * total, streams[("torch", False)]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_trained_tiny_model_greedy_tokens_with_an_fp8_cache(trained_tiny, fmt):
    """The same prompts served from an FP8 cache (Triton, CUDA graphs): the latent rows' FP8 rounding leaves
    the copy attention intact, so the generated tokens continue the pattern as with the bf16 cache (no more
    than 2% fewer). The streams need not equal the bf16 cache's: the figure is printed, not asserted."""
    path, _ = trained_tiny
    bf16 = _trained_streams(path, "triton", True)
    fp8 = _trained_streams(path, "triton", True, fmt)
    total = len(_trained_prompts()) * NEW_TOKENS
    right, right_bf16 = _continuing(fp8), _continuing(bf16)
    same = sum(a == b for a, b in zip(fp8, bf16))
    print(f"{fmt}: {right}/{total} generated tokens continue the pattern (bf16 cache {right_bf16}); "
          f"{same}/{len(bf16)} streams equal the bf16 cache's")
    assert right >= right_bf16 - 0.02 * total, (fp8, bf16)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_step_forwards_do_not_synchronise(graphs):
    """Every step's forward (its host-built indices reaching the device, the backend's planning, the model,
    the graph replay) runs inside ``torch.cuda.set_sync_debug_mode("error")``: only the read-back of the
    sampled tokens after it waits for the device. Chunked prefill (16 tokens a step), MIXED steps, prefix-cache
    hits (the second burst shares the first's prompts' pages) and shrinking decode batches."""
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, page_size=16, max_batch_size=4, max_context_len=512, provider="triton",
              max_num_batched_tokens=16, mixed_batching=True, enable_prefix_caching=True,
              enable_cuda_graph=graphs)
    run, modes = llm.runner.run, []

    def checked(seqs, mode, num_extends, **kwargs):
        modes.append(mode)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(seqs, mode, num_extends, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    llm.runner.run = checked
    prompts = _prompts()[:4]
    for _ in range(2):
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12)])
        assert [len(o.token_ids) for o in outs] == [3, 9, 5, 12]
    assert {m.value for m in modes} >= {"extend", "decode", "mixed"}, {m.value for m in modes}
    assert llm.stats.prefix_cache_hits > 0
