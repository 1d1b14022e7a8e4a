"""The engine over two CPU processes (gloo): tensor parallelism (TP=2) and decode context parallelism inside it
(TP=2, DCP=2) give one process's logits and greedy tokens for a V3 model (the built-in tiny, random weights
sliced per rank) and a V2 model (a safetensors checkpoint each rank reads its slices of), through prefill,
decode, chunked prefill (both prefix forms), MIXED and verify steps; each rank reads only its slices; a
torchrun-style launch works; impossible splits and a rank that fails are clear errors. On two GPUs (``-m gpu``):
the same over NCCL with CUDA graphs, and the trained tiny model's greedy tokens in bf16."""

from __future__ import annotations

import json

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import save_file
from trained_tiny import PERIOD, continuation, periodic_batch, train_tiny

import pagedmla.model.loader as loader
from pagedmla.cli import main
from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_checkpoint
from pagedmla.model.build import build_empty
from pagedmla.model.config import DeepseekConfig, tiny_config
from pagedmla.model.parallel import shard_specs
from pagedmla.model.random_weights import init_random_
from pagedmla.parallel import Group

# A DeepSeek-V2 layout: plain q_proj, softmax router with group-limited greedy choice, default rope.
V2_CONFIG = {
    "model_type": "deepseek_v2", "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5, "first_k_dense_replace": 1,
    "max_position_embeddings": 256, "eos_token_id": None,
}
# Step kinds: prefill with a verify tail (n-gram drafts of the periodic prompt), chunked-prefix prefill in
# the MHA form over several prefix chunks; or MIXED steps with the absorbed prefix form.
RUNS = {
    "verify": dict(num_speculative_tokens=3, extend_prefix_mode="chunked",
                   backend_options=dict(chunked_prefix_capacity=8)),
    "mixed": dict(mixed_batching=True, extend_prefix_mode="absorbed"),
}
COMMON = dict(device="cpu", page_size=4, max_num_batched_tokens=16, max_batch_size=4)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [5, 6, 7], list(range(20, 60))]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
# float32 logits: partial sums added across ranks round differently from one GEMM; measured against the
# logits' scale (they reach ~15) the difference is ~1e-6.
TOL = 1e-5


def write_v2_checkpoint(path, per_expert: bool = True):
    """The V2 config with random weights (seed 1) as config.json + model.safetensors; routed experts per
    expert (the hub layout) or stacked."""
    path.mkdir(parents=True, exist_ok=True)
    model = init_random_(build_empty(DeepseekConfig.from_dict(V2_CONFIG), "cpu", torch.float32), seed=1)
    tensors = {}
    for name, t in model.state_dict().items():
        if per_expert and name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                tensors[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif per_expert and name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                tensors[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(V2_CONFIG))
    return path


@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory):
    return str(write_v2_checkpoint(tmp_path_factory.mktemp("v2")))


def _recorded(llm: LLM) -> list[tuple[str, torch.Tensor]]:
    """Every step's (mode, logits) of ``llm`` from now on."""
    steps = []
    run = llm.runner.run

    def spy(seqs, mode, num_extends, **kwargs):
        logits = run(seqs, mode, num_extends, **kwargs)
        steps.append((mode.value, logits.clone()))
        return logits

    llm.runner.run = spy
    return steps


def _generate(model: str, run: str, **options) -> tuple[list[tuple[str, torch.Tensor]], list[list[int]], LLM]:
    with LLM(model, **{**COMMON, **RUNS[run], **options}) as llm:
        steps = _recorded(llm)
        tokens = [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    return steps, tokens, llm


def _check_matches_one_process(model: str, run: str, dcp: int, **options) -> None:
    ref_steps, ref_tokens, _ = _generate(model, run, **options)
    steps, tokens, llm = _generate(model, run, tensor_parallel_size=2, decode_context_parallel_size=dcp, **options)
    assert llm.runner.mla_config.num_local_heads == 2 and llm.runner.mla_config.dcp_size == dcp
    assert llm.runner.table.page_size == COMMON["page_size"] * dcp  # a page holds page_size tokens per DCP rank
    assert tokens == ref_tokens
    assert [m for m, _ in steps] == [m for m, _ in ref_steps]
    kinds = {"verify": {"extend", "decode", "target_verify"}, "mixed": {"extend", "decode", "mixed"}}[run]
    assert {m for m, _ in steps} == kinds
    scale = max(ref.abs().max().item() for _, ref in ref_steps)
    for (mode, got), (_, ref) in zip(steps, ref_steps):
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= TOL * scale, mode


@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("arch", ["v3", "v2"])
def test_parallel_engine_matches_one_process(arch, run, dcp, v2_checkpoint):
    _check_matches_one_process("tiny" if arch == "v3" else v2_checkpoint, run, dcp)


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("run", sorted(RUNS))
def test_parallel_engine_on_two_gpus_matches_one(run, dcp):
    """NCCL, float32 (the torch provider, eager: the oracle is not a graph-capture path): the random tiny
    model's logits and greedy tokens at TP=2 (DCP=1, 2) are one GPU's."""
    _check_matches_one_process("tiny", run, dcp, device="cuda", dtype=torch.float32, provider="torch",
                               enable_cuda_graph=False)


@pytest.mark.gpu
@TWO_GPUS
def test_trained_tiny_greedy_tokens_on_two_gpus(tmp_path):
    """bf16, the default provider, CUDA graphs on every rank (decode replays carry the NCCL collectives): the
    tiny model trained on a task that needs attention (tests/trained_tiny.py) generates the same greedy
    tokens at TP=2 and TP=2 with DCP=2 as on one GPU, and they continue the pattern."""
    hf, accuracy = train_tiny("cuda")
    assert accuracy > 0.99, f"training the tiny model on the periodic task reached only {accuracy:.3f}"
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [periodic_batch(1, n, gen, "cpu")[0].tolist() for n in (PERIOD, 17, 40, 100, 120)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    streams = {}
    for tp, dcp in ((1, 1), (2, 1), (2, 2)):
        with LLM(str(tmp_path), device="cuda", dtype=torch.bfloat16, page_size=16, max_batch_size=8,
                 max_context_len=512, enable_cuda_graph=True, tensor_parallel_size=tp,
                 decode_context_parallel_size=dcp) as llm:
            streams[(tp, dcp)] = [o.token_ids for o in llm.generate(prompts, params)]
    assert streams[(2, 1)] == streams[(1, 1)] and streams[(2, 2)] == streams[(1, 1)], streams
    want = [continuation(prompt, 32) for prompt in prompts]
    right = sum(a == b for got, w in zip(streams[(1, 1)], want) for a, b in zip(got, w))
    assert right >= 0.9 * len(prompts) * 32, streams[(1, 1)]


def _load_and_record(rank: int, world: int, path: str) -> dict:
    """Load ``path`` as rank ``rank`` of a TP group with safetensors' reads recorded; compare every tensor
    with the slice of the whole model."""
    reads: list[tuple[str, object]] = []
    real_open = loader.safe_open

    class Slice:
        def __init__(self, view, name):
            self.view, self.name = view, name

        def get_shape(self):
            return self.view.get_shape()

        def __getitem__(self, index):
            out = self.view[index]
            reads.append((self.name, out.numel()))
            return out

    class Handle:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return Slice(self.handle.get_slice(name), name)

        def get_tensor(self, name):
            out = self.handle.get_tensor(name)
            reads.append((name, "whole"))
            return out

    loader.safe_open = lambda *a, **k: Handle(real_open(*a, **k))
    try:
        model = load_checkpoint(path, tp=Group.of(None))
    finally:
        loader.safe_open = real_open
    full = load_checkpoint(path)
    full_state = full.state_dict()
    specs = shard_specs(model)
    mismatched = [name for name, t in model.state_dict().items()
                  if not torch.equal(t, specs[name].take(full_state[name]) if name in specs else full_state[name])]
    whole = {name for name, how in reads if how == "whole"}
    sliced = {name for name, how in reads if how != "whole"}
    elements = sum(how for _, how in reads if how != "whole") + sum(full_state[n].numel() for n in whole
                                                                    if n in full_state)
    return dict(mismatched=mismatched, whole=whole, sliced=sliced, elements=elements,
                total=sum(t.numel() for t in full_state.values()), specs=sorted(specs))


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_each_rank_reads_only_its_slices(layout, tmp_path):
    path = str(write_v2_checkpoint(tmp_path, per_expert=layout == "per_expert"))
    results = run_ranks(_load_and_record, path)
    for rank, r in enumerate(results):
        assert not r["mismatched"], (rank, r["mismatched"])
        # Sharded tensors (and, per expert, every expert projection) only through slices; the rest whole.
        assert not any(name in r["whole"] for name in r["specs"]), rank
        assert not any(".experts." in name for name in r["whole"]), rank
        assert r["sliced"] and all(".experts." in n or n in r["specs"] for n in r["sliced"]), rank
        # Together the two ranks read the replicated tensors twice and the sharded ones once.
        assert r["elements"] < 0.75 * r["total"], (rank, r["elements"], r["total"])
    assert results[0]["sliced"] == results[1]["sliced"]


def _torchrun_rank(rank: int, world: int) -> dict:
    """One rank of a torchrun-style launch (RANK / WORLD_SIZE / MASTER_* set, no process group yet)."""
    llm = LLM("tiny", device="cpu", tensor_parallel_size=2)
    if not llm.is_driver:  # returned once rank 0 shut the engine down
        try:
            llm.generate([[1, 2, 3]])
        except RuntimeError as exc:
            return dict(driver=False, error=str(exc))
        return dict(driver=False, error=None)
    tokens = [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    llm.shutdown()
    return dict(driver=True, tokens=tokens)


def test_torchrun_style_launch():
    ref = [out.token_ids for out in LLM("tiny", device="cpu").generate(PROMPTS, PARAMS)]
    driver, worker = run_ranks(_torchrun_rank, init_group=False)
    assert driver == dict(driver=True, tokens=ref)
    assert not worker["driver"] and "rank 1 of a tensor-parallel engine only runs rank 0's steps" in worker["error"]


def _failing_rank(rank: int, world: int) -> str:
    """Rank 1 cannot build its engine (its cache would not fit); rank 0 must hear of it, not hang."""
    if rank == 1:
        import pagedmla.engine.llm as llm_module

        def refuse(*args, **kwargs):
            raise ValueError("num_pages: refused on rank 1 for the test")

        llm_module._check_cache_fits = refuse
    try:
        LLM("tiny", device="cpu", tensor_parallel_size=2)
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "built"


def test_a_rank_that_fails_fails_every_rank():
    rank0, rank1 = run_ranks(_failing_rank, init_group=False)
    assert rank0.startswith("RuntimeError: tensor_parallel_size: rank 1 of 2 could not build its engine")
    assert "refused on rank 1" in rank0
    assert rank1 == "ValueError: num_pages: refused on rank 1 for the test"


def test_impossible_splits_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: num_attention_heads=4 \(attention heads\) does "
                                         r"not split evenly over tensor_parallel_size=3"):
        LLM("tiny", device="cpu", tensor_parallel_size=3)
    odd = dict(V2_CONFIG, num_attention_heads=8, moe_intermediate_size=30)
    (tmp_path / "config.json").write_text(json.dumps(odd))
    with pytest.raises(ValueError, match="tensor_parallel_size: moe_intermediate_size=30"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size: intermediate_size=90"):
        DeepseekConfig.from_dict(dict(V2_CONFIG, intermediate_size=90)).check_tensor_parallel(4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: vocab_size=161 \(the vocabulary\)"):
        DeepseekConfig.from_dict(dict(V2_CONFIG, vocab_size=161)).check_tensor_parallel(2)
    with pytest.raises(ValueError, match="decode_context_parallel_size: 2 does not divide tensor_parallel_size=1"):
        LLM("tiny", device="cpu", decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="decode_context_parallel_size: 4 does not divide tensor_parallel_size=2"):
        LLM("tiny", device="cpu", tensor_parallel_size=2, decode_context_parallel_size=4)
    with pytest.raises(ValueError, match="model: with tensor_parallel_size > 1 each rank loads its own slices"):
        LLM(build_empty(tiny_config(), "cpu", torch.float32), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="device: cpu:0 names one device"):
        LLM("tiny", device="cpu:0", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a positive int"):
        LLM("tiny", device="cpu", tensor_parallel_size=0)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2, but the launcher started 3 ranks"):
        LLM("tiny", device="cpu", tensor_parallel_size=2)


def test_cli_tensor_parallel_generate(capsys):
    args = ["generate", "--model", "tiny", "--device", "cpu", "--prompt-ids", "1 2 3 4 5", "--max-new-tokens", "6",
            "--no-stream"]
    assert main(args) == 0
    single = [line for line in capsys.readouterr().out.splitlines() if "generated ids" in line]
    assert main(args + ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "generated ids" in line] == single
    assert "tensor parallel 2 (decode context parallel 2)" in out
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--tensor-parallel-size", "3"])
    assert exit_info.value.code == 2
    assert "error: --tensor-parallel-size: num_attention_heads=4 (attention heads)" in capsys.readouterr().err
