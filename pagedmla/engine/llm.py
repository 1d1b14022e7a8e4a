"""LLM: the engine's Python API (nano-vllm style). ``LLM(model).generate(prompts, params)``.

Requests can also be driven step by step (``add_request`` / ``step``), which is how requests join a
running batch: anything added between steps is admitted by the scheduler at the next step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedmla.backend import ForwardMode
from pagedmla.engine.model_runner import ModelRunner
from pagedmla.engine.profiler import AttentionProfiler
from pagedmla.engine.sampling import SamplingParams, sample
from pagedmla.engine.scheduler import Scheduler
from pagedmla.engine.sequence import Sequence
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.factory import TINY, load_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class RequestOutput:
    """A finished request: its prompt, generated token ids (and text when a tokenizer exists)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None


@dataclass
class EngineStats:
    """Token counts and wall time per step kind since the last reset (prefill = EXTEND steps, decode =
    DECODE steps; MIXED steps are counted apart). Attention calls/seconds fill in when profiling."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    mixed_tokens: int = 0
    mixed_seconds: float = 0.0
    mixed_steps: int = 0
    attention_calls: dict[str, int] = field(default_factory=dict)
    attention_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _default_num_pages(model: DeepseekForCausalLM, page_size: int, dtype: torch.dtype, budget_bytes: int,
                       max_batch_size: int, max_context_len: int) -> int:
    cfg = model.config
    per_page = page_size * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * dtype.itemsize
    enough = max_batch_size * -(-max_context_len // page_size)
    return max(2, min(budget_bytes // per_page, enough) + 1)


class LLM:
    """Generate with a DeepSeek-V2/V3 model on pagedmla.

    model: "tiny", a checkpoint directory, or an already loaded DeepseekForCausalLM. device: default
    CUDA when available. dtype: default the checkpoint's (tiny: bf16 on CUDA, fp32 on CPU). page_size:
    tokens per cache page. num_pages: cache size (default: fits ``cache_bytes``). provider: attention
    provider ("torch", "triton", ...; default the best for the device). max_batch_size: running
    requests at most. max_num_batched_tokens: prompt tokens per prefill step at most (one prompt always
    fits). extend_prefix_mode: the backend's form for prefills over a cached prefix. mixed_batching:
    run new prefills together with running decodes in MIXED steps. profile_attention: count and time
    the model's attention calls (adds device synchronisation). seed: weights of ``tiny``. tokenizer:
    "auto" (the checkpoint's, if it ships one), None, or a tokenizer object. backend_options: further
    MLAConfig fields for the backend.
    """

    def __init__(self, model: str | os.PathLike | DeepseekForCausalLM = TINY, *,
                 device: str | torch.device | None = None, dtype: Any = None, page_size: int = 64,
                 num_pages: int | None = None, provider: str | None = None,
                 max_batch_size: int = 32, max_num_batched_tokens: int = 8192, max_context_len: int | None = None,
                 extend_prefix_mode: str = "auto", mixed_batching: bool = False, cache_bytes: int = 1 << 28,
                 profile_attention: bool = False, seed: int = 0, tokenizer: Any = "auto",
                 backend_options: dict | None = None):
        if isinstance(model, DeepseekForCausalLM):
            self.model = model
        else:
            dev = torch.device(device) if device is not None else \
                torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("device: CUDA was asked for but is not available on this machine")
            self.model = load_model(model, device=dev, dtype=dtype, seed=seed)
        cfg = self.model.config
        weight = self.model.model.embed_tokens.weight
        context = max_context_len or cfg.max_position_embeddings
        if num_pages is None:
            num_pages = _default_num_pages(self.model, page_size, weight.dtype, cache_bytes, max_batch_size, context)
        self.runner = ModelRunner(self.model, page_size=page_size, num_pages=num_pages, max_batch_size=max_batch_size,
                                  max_context_len=context, provider=provider, extend_prefix_mode=extend_prefix_mode,
                                  backend_options=backend_options)
        self.scheduler = Scheduler(self.runner.table, max_batch_size=max_batch_size,
                                   max_num_batched_tokens=max_num_batched_tokens, max_context_len=context,
                                   eos_token_ids=cfg.eos_token_id, mixed=mixed_batching)
        self.tokenizer = _load_tokenizer(model) if isinstance(tokenizer, str) and tokenizer == "auto" else tokenizer
        self.profiler = AttentionProfiler(self.runner.backend) if profile_attention else None
        self.stats = EngineStats()
        self._requests: dict[int, Sequence] = {}

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """A prompt as token ids: a list of ids as is (checked against the vocabulary), text through the tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer; this model has none, pass token id lists")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = list(prompt)
        vocab = self.model.config.vocab_size
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompts: expected a non-empty list of token ids in 0..{vocab - 1}, got {prompt!r}")
        return ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it joins the running batch at the next step. Returns its request id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        seq = Sequence(self.encode(prompt), params, self.device)
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        calls, secs = (self.profiler.calls, self.profiler.seconds) if self.profiler else (0, 0.0)
        start = time.perf_counter()
        logits = self.runner.run(batch.seqs, batch.mode, batch.num_extends, backend=self.profiler)
        tokens = sample(logits, [s.params for s in batch.seqs], [s.generator for s in batch.seqs])
        elapsed = time.perf_counter() - start  # sample() read the tokens back, so the device is done
        self._record(batch.mode, sum(s.num_new_tokens for s in batch.seqs), len(batch.seqs), elapsed)
        if self.profiler:
            kind = batch.mode.value
            self.stats.attention_calls[kind] = self.stats.attention_calls.get(kind, 0) + self.profiler.calls - calls
            self.stats.attention_seconds[kind] = self.stats.attention_seconds.get(kind, 0.0) + \
                self.profiler.seconds - secs
        return [self._output(seq) for seq in self.scheduler.postprocess(batch, tokens)]

    def _record(self, mode: ForwardMode, new_tokens: int, bs: int, seconds: float) -> None:
        s = self.stats
        if mode == ForwardMode.EXTEND:
            s.prefill_tokens += new_tokens
            s.prefill_seconds += seconds
            s.prefill_steps += 1
        elif mode == ForwardMode.DECODE:
            s.decode_tokens += bs
            s.decode_seconds += seconds
            s.decode_steps += 1
        else:
            s.mixed_tokens += new_tokens
            s.mixed_seconds += seconds
            s.mixed_steps += 1

    def _output(self, seq: Sequence) -> RequestOutput:
        del self._requests[seq.seq_id]
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=seq.output_token_ids, finish_reason=seq.finish_reason, text=text)

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt, or a list of token-id lists / strings) to completion; outputs in
        prompt order. ``params``: one SamplingParams for all, or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of prompts")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: expected {len(prompts)} SamplingParams (one per prompt), got {len(params)}")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(done) < len(ids) and self.has_unfinished():
            for out in self.step():
                done[out.request_id] = out
                bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def _load_tokenizer(model: Any):
    """transformers' AutoTokenizer from a checkpoint directory that ships tokenizer files, else None."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        return None
    if not any(os.path.isfile(os.path.join(model, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(model))
