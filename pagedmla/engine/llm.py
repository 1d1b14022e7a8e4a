"""LLM: the engine's Python API (nano-vllm style). ``LLM(model).generate(prompts, params)``.

Requests can also be driven step by step (``add_request`` / ``step`` / ``abort``), which is how requests
join a running batch: anything added between steps is admitted by the scheduler at the next step.
Features (each leaves greedy output unchanged): chunked prefill under a per-step token budget, MIXED
prefill + decode steps, prefix caching, preemption with recomputation when pages run out, CUDA graphs
for decode / verify steps, and n-gram speculative decoding verified in one target step.

A step never fails for one request: a request whose logits hold inf/NaN, or whose sampling or
post-processing raises, finishes with finish_reason "error" (``RequestOutput.error`` says why) and the
step's other requests go on.

Threads: one ``LLM`` may be shared. Its public methods hold one re-entrant lock, so concurrent
``generate`` calls run one after the other (each to completion, returning only its own requests), and
``add_request`` / ``step`` / ``abort`` / ``pop_finished`` / ``has_unfinished`` are safe to call from any
thread (a server: one thread stepping, others adding and aborting; an ``add_request`` waits at most for
the step in progress, or for a ``generate`` call in progress to return).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedmla.backend import ForwardMode
from pagedmla.config import resolve_dtype
from pagedmla.engine.cuda_graph import GraphRunner
from pagedmla.engine.drafter import NgramDrafter
from pagedmla.engine.kv_pages import KVPages
from pagedmla.engine.model_runner import ModelRunner
from pagedmla.engine.prefix_cache import PrefixCache
from pagedmla.engine.profiler import AttentionProfiler
from pagedmla.engine.sampling import NonFiniteLogitsError, SamplingParams, sample
from pagedmla.engine.scheduler import ScheduledBatch, Scheduler
from pagedmla.engine.sequence import Sequence
from pagedmla.engine.speculative import verify
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.factory import TINY, load_model
from pagedmla.model.memory import check_fits

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class RequestOutput:
    """A finished (or aborted) request: its prompt, generated token ids (and text when a tokenizer exists).

    finish_reason: "stop", "length", "abort", or "error" (the engine could not sample or post-process
    the request; ``error`` says why). arrival_time / token_times: ``time.perf_counter()`` when the
    request was added and when each generated token came out (time to first token, inter-token
    latency)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class EngineStats:
    """Token counts and wall time per step kind (prefill = EXTEND steps, decode = DECODE and verify steps,
    ``verify_steps`` of them verify steps; MIXED steps are counted apart). Prefill and mixed tokens are
    the tokens run; decode tokens are those the requests kept (up to a stop token or max_tokens).
    Attention calls/seconds fill in when profiling. Speculative decoding: draft tokens proposed, and
    accepted into the output (``acceptance_rate``). Prefix caching: tokens whose prefill a cached prefix
    saved, and admissions that looked up the cache / found a prefix there (``prefix_cache_hit_rate``).
    Preemptions: requests sent back to wait.

    Every field accumulates step by step from the engine's creation; assigning a fresh EngineStats to
    ``LLM.stats`` starts the counts again."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    mixed_tokens: int = 0
    mixed_seconds: float = 0.0
    mixed_steps: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    cached_prefix_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    attention_calls: dict[str, int] = field(default_factory=dict)
    attention_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any was proposed)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Admissions that reused a cached prefix / admissions that looked (0 before any looked)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill tokens per second of prefill step time (0 before any prefill step)."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decoded tokens per second of decode and verify step time (0 before any such step)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _check_positive_int(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _check_loaded_model(model: DeepseekForCausalLM, device: Any, dtype: Any, seed: int | None) -> None:
    """A model passed in already has its device, dtype and weights: arguments asking for others (which
    only apply to a model LLM loads) are errors rather than silently ignored."""
    weight = model.model.embed_tokens.weight
    if device is not None:
        dev = torch.device(device)
        # "cuda" names whichever CUDA device the model is on; "cuda:1" names one.
        if dev.type != weight.device.type or (dev.index is not None and dev.index != weight.device.index):
            raise ValueError(f"device: the given model is on {weight.device}, not {dev}; move the model there "
                             "or leave device unset")
    if dtype is not None and resolve_dtype(dtype, "dtype") != weight.dtype:
        raise ValueError(f"dtype: the given model is in {weight.dtype}, not {dtype}; convert the model or "
                         "leave dtype unset")
    if seed is not None:
        raise ValueError("seed: seeds the random weights of a model LLM builds ('tiny'); the given model "
                         "already has its weights, leave seed unset")


def _page_bytes(model: DeepseekForCausalLM, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one cache page: ``page_size`` latent rows in every layer."""
    cfg = model.config
    return page_size * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * dtype.itemsize


def _default_num_pages(model: DeepseekForCausalLM, page_size: int, dtype: torch.dtype, budget_bytes: int,
                       max_batch_size: int, max_context_len: int) -> int:
    enough = max_batch_size * (-(-max_context_len // page_size) + 1)
    return max(2, min(budget_bytes // _page_bytes(model, page_size, dtype), enough) + 1)


def _check_cache_fits(model: DeepseekForCausalLM, page_size: int, num_pages: int, max_batch_size: int,
                      context: int, pages_field: str, context_field: str) -> None:
    """ValueError naming the field at fault when the cache's pages (``pages_field``: num_pages or the
    cache_bytes that sized it) and its two int32 page tables (the request table's and the backend's, rows
    of ``context`` tokens: ``context_field``) would not fit in the device's available memory."""
    weight = model.model.embed_tokens.weight
    pages = num_pages * _page_bytes(model, page_size, weight.dtype)
    tables = 2 * max_batch_size * -(-context // page_size) * 4
    field, value = (pages_field, num_pages) if pages >= tables else (context_field, context)
    where = " (from the model's config.json; set max_context_len)" if field == "max_position_embeddings" else ""
    check_fits(pages + tables, field, value, weight.device, "the KV cache and its page tables", where)


class LLM:
    """Generate with a DeepSeek-V2/V3 model on pagedmla.

    model: "tiny", a checkpoint directory, or an already loaded DeepseekForCausalLM. device: default
    CUDA when available. dtype: default the checkpoint's (tiny: bf16 on CUDA, fp32 on CPU). page_size:
    tokens per cache page. num_pages: cache size (default: fits ``cache_bytes``); pages are allocated
    as tokens arrive, and when they run out the youngest requests are preempted and recomputed later.
    provider: attention provider ("torch", "triton", ...; default the best for the device).
    max_batch_size: running requests at most. max_num_batched_tokens: tokens per step at most (longer
    prompts are prefilled in chunks over several steps). extend_prefix_mode: the backend's form for
    prefills over a cached prefix. mixed_batching: run prefill chunks together with running decodes in
    MIXED steps. enable_prefix_caching: share the full pages of common prompt prefixes between requests.
    num_speculative_tokens: k > 0 drafts up to k tokens per request by prompt lookup (n-gram matches of
    up to ``ngram_max_n`` tokens) and verifies them in one step. enable_cuda_graph: replay CUDA graphs
    for decode / verify steps (None: on for CUDA devices) of ``cuda_graph_batch_sizes`` (default 1, 2,
    4, 8, 16, ... up to max_batch_size). profile_attention: count and time the model's attention calls
    (adds device synchronisation; such steps run eagerly). seed: the random weights of ``tiny`` (default
    0; a checkpoint's weights ignore it). device, dtype and seed apply to a model LLM loads: with a
    loaded model they must be unset or agree with it (ValueError otherwise). max_context_len: tokens per
    request at most, prompt included (None: the model's max positions). cache_bytes: cache size in
    bytes that the default num_pages fills. tokenizer: "auto" (the checkpoint's, if it ships one),
    None, or a tokenizer object. backend_options: further MLAConfig fields for the backend.

    ``generate`` returns its own requests' outputs; requests queued with ``add_request`` that finish
    during a ``generate`` call are kept for ``pop_finished``.
    """

    def __init__(self, model: str | os.PathLike | DeepseekForCausalLM = TINY, *,
                 device: str | torch.device | None = None, dtype: Any = None, page_size: int = 64,
                 num_pages: int | None = None, provider: str | None = None,
                 max_batch_size: int = 32, max_num_batched_tokens: int = 8192, max_context_len: int | None = None,
                 extend_prefix_mode: str = "auto", mixed_batching: bool = False, cache_bytes: int = 1 << 28,
                 enable_prefix_caching: bool = False, num_speculative_tokens: int = 0, ngram_max_n: int = 4,
                 enable_cuda_graph: bool | None = None, cuda_graph_batch_sizes: list[int] | None = None,
                 profile_attention: bool = False, seed: int | None = None, tokenizer: Any = "auto",
                 backend_options: dict | None = None):
        # Arguments are checked before any model is loaded or cache allocated.
        for name, value in (("enable_prefix_caching", enable_prefix_caching), ("mixed_batching", mixed_batching)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: expected a bool, got {value!r}")
        if enable_cuda_graph is not None and not isinstance(enable_cuda_graph, bool):
            raise ValueError(f"enable_cuda_graph: expected a bool or None, got {enable_cuda_graph!r}")
        # The model runner sizes the backend for k draft tokens before the scheduler exists: checked here only.
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens: expected an int >= 0, got {num_speculative_tokens!r}")
        # The default num_pages is sized from max_context_len, before the scheduler (which checks it too) exists.
        if max_context_len is not None:
            _check_positive_int("max_context_len", max_context_len)
        _check_positive_int("cache_bytes", cache_bytes)
        _check_positive_int("ngram_max_n", ngram_max_n)
        _check_positive_int("page_size", page_size)
        _check_positive_int("max_batch_size", max_batch_size)
        if num_pages is not None:
            _check_positive_int("num_pages", num_pages)
        if isinstance(model, DeepseekForCausalLM):
            _check_loaded_model(model, device, dtype, seed)
            self.model = model
        else:
            dev = torch.device(device) if device is not None else \
                torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("device: CUDA was asked for but is not available on this machine")
            self.model = load_model(model, device=dev, dtype=dtype, seed=0 if seed is None else seed)
        cfg = self.model.config
        weight = self.model.model.embed_tokens.weight
        context = cfg.max_position_embeddings if max_context_len is None else max_context_len
        pages_field = "num_pages" if num_pages is not None else "cache_bytes"
        if num_pages is None:
            num_pages = _default_num_pages(self.model, page_size, weight.dtype, cache_bytes, max_batch_size, context)
        _check_cache_fits(self.model, page_size, num_pages, max_batch_size, context + num_speculative_tokens,
                          pages_field, "max_context_len" if max_context_len is not None else "max_position_embeddings")
        self.runner = ModelRunner(self.model, page_size=page_size, num_pages=num_pages, max_batch_size=max_batch_size,
                                  max_context_len=context, provider=provider, extend_prefix_mode=extend_prefix_mode,
                                  backend_options=backend_options, num_speculative_tokens=num_speculative_tokens)
        table = self.runner.table
        prefix_cache = PrefixCache(table.allocator, page_size) if enable_prefix_caching else None
        self.pages = KVPages(table, prefix_cache)
        self.scheduler = Scheduler(self.pages, max_batch_size=max_batch_size,
                                   max_num_batched_tokens=max_num_batched_tokens, max_context_len=context,
                                   eos_token_ids=cfg.eos_token_id, mixed=mixed_batching,
                                   num_speculative_tokens=num_speculative_tokens)
        self.drafter = NgramDrafter(num_speculative_tokens, max_n=ngram_max_n) if num_speculative_tokens else None
        if enable_cuda_graph is None:
            enable_cuda_graph = self.runner.device.type == "cuda"
        if enable_cuda_graph:
            self.runner.graphs = GraphRunner(self.runner, cuda_graph_batch_sizes)
        self.tokenizer = _load_tokenizer(model) if isinstance(tokenizer, str) and tokenizer == "auto" else tokenizer
        self.profiler = AttentionProfiler(self.runner.backend) if profile_attention else None
        self.stats = EngineStats()
        self._requests: dict[int, Sequence] = {}
        # Outputs of add_request'ed requests that finished inside a generate call, for pop_finished.
        self._finished: dict[int, RequestOutput] = {}
        # Held by every public method that reads or changes the requests (the module's thread contract).
        self._lock = threading.RLock()

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
        seq = self._new_sequence(prompt, params)
        with self._lock:
            self._enqueue(seq)
        return seq.seq_id

    def _new_sequence(self, prompt: str | Seq[int], params: SamplingParams | None) -> Sequence:
        """A request checked to be runnable (ValueError / TypeError naming the argument otherwise), not queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        seq = Sequence(self.encode(prompt), params, self.device, arrival_time=time.perf_counter())
        self.scheduler.check(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        """Queue a checked request and track it until it finishes or is aborted."""
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        with self._lock:
            return self.scheduler.has_unfinished()

    def pop_finished(self) -> dict[int, RequestOutput]:
        """Outputs, by request id, of requests queued with ``add_request`` that finished during a
        ``generate`` call (which returns only its own requests' outputs). They are handed over once: the
        engine forgets them, so an application that mixes the two should collect them after each call."""
        with self._lock:
            finished, self._finished = self._finished, {}
        return finished

    def abort(self, request_id: int) -> RequestOutput:
        """Stop an unfinished request now (waiting or running), freeing its pages; returns its output so
        far with finish_reason "abort"."""
        with self._lock:
            seq = self._requests.get(request_id)
            if seq is None:
                raise ValueError(f"request_id: {request_id!r} is not an unfinished request of this engine")
            self.scheduler.finish(seq, "abort")
            return self._output(seq)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the requests that finished in it (those that failed in it
        included, with finish_reason "error")."""
        with self._lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        before = self._page_counts()
        batch = self.scheduler.schedule()
        if batch is None:
            # Scheduling may still have preempted requests.
            self._record_page_counts(before)
            return []
        calls, secs = (self.profiler.calls, self.profiler.seconds) if self.profiler else (0, 0.0)
        start = time.perf_counter()
        mode, tokens, drafts, proposed = batch.mode, None, None, []
        if batch.speculative:
            drafts, proposed = self._draft(batch)
            if drafts is not None:
                mode = ForwardMode.TARGET_VERIFY
                tokens = [[seq.token_ids[-1]] + d for seq, d in zip(batch.seqs, drafts)]
        elif batch.num_extends:
            tokens = [seq.token_ids[seq.num_cached_tokens: seq.num_cached_tokens + n]
                      for seq, n in zip(batch.seqs, batch.num_tokens)]
        logits = self.runner.run(batch.seqs, mode, batch.num_extends, tokens=tokens, all_logits=drafts is not None,
                                 backend=self.profiler)
        new_tokens, errors = self._sample(batch, logits, drafts)
        now = time.perf_counter()  # the tokens were read back, so the device is done
        if self.profiler:
            kind = mode.value
            self.stats.attention_calls[kind] = self.stats.attention_calls.get(kind, 0) + self.profiler.calls - calls
            self.stats.attention_seconds[kind] = self.stats.attention_seconds.get(kind, 0.0) + \
                self.profiler.seconds - secs
        lengths = [len(seq) for seq in batch.seqs]
        finished = self.scheduler.postprocess(batch, new_tokens, verified=drafts is not None, now=now,
                                              errors=errors)
        # Stop tokens and max_tokens may cut a request's new tokens short: count what it kept.
        kept = [len(seq) - n for seq, n in zip(batch.seqs, lengths)]
        self._record(batch, mode, new_tokens, kept, proposed, now - start)
        self._record_page_counts(before)
        return [self._output(seq) for seq in finished]

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor,
                drafts: list[list[int]] | None) -> tuple[list[list[int]], dict[int, str]]:
        """Each request's new tokens this step (none for a prompt chunk that is not its last), and a
        message for each batch row that could not be sampled (its tokens are then []).

        The batch is sampled at once; rows reported non-finite fail alone. Any other exception samples
        the requests one at a time, so that only those that raise again fail."""
        seqs = batch.seqs
        if drafts is not None:
            rows = list(range(len(seqs)))
            width = logits.shape[0] // len(seqs)

            def draw(idx: list[int]) -> list[list[int] | None]:
                part = logits if len(idx) == len(seqs) else logits[idx[0] * width:(idx[0] + 1) * width]
                return verify(part, [drafts[i] for i in idx], [seqs[i].params for i in idx],
                              [seqs[i].generator for i in idx])
        else:
            # Only a step that reaches a request's last token samples (not the earlier prompt chunks).
            rows = [i for i in range(len(seqs)) if batch.samples(i)]

            def draw(idx: list[int]) -> list[list[int] | None]:
                tokens = sample(logits[idx], [seqs[i].params for i in idx], [seqs[i].generator for i in idx])
                return [[t] for t in tokens]
        new_tokens: list[list[int]] = [[] for _ in seqs]
        errors: dict[int, str] = {}
        if not rows:
            return new_tokens, errors
        try:
            drawn = draw(rows)
        except NonFiniteLogitsError as exc:
            drawn = [None if t is None else (t if drafts is not None else [t]) for t in exc.tokens]
        except Exception:
            drawn = []
            for i in rows:
                try:
                    drawn += draw([i])
                except Exception as exc:
                    drawn.append(None)
                    errors[i] = f"sampling raised {type(exc).__name__}: {exc}"
        for i, tokens in zip(rows, drawn):
            if tokens is None:
                errors.setdefault(i, "logits: inf or NaN in this request's logits (the model's numbers "
                                     "overflowed or its weights are corrupt); no token could be sampled")
            else:
                new_tokens[i] = tokens
        return new_tokens, errors

    def _page_counts(self) -> tuple[int, int, int, int]:
        """The scheduler's and page manager's running totals that EngineStats mirrors, to take differences of."""
        p = self.pages
        return self.scheduler.num_preemptions, p.cached_prefix_tokens, p.prefix_queries, p.prefix_hits

    def _record_page_counts(self, before: tuple[int, int, int, int]) -> None:
        # Added as differences rather than copied, so that a fresh EngineStats counts from its assignment.
        preempted, cached, queries, hits = (a - b for a, b in zip(self._page_counts(), before))
        s = self.stats
        s.preemptions += preempted
        s.cached_prefix_tokens += cached
        s.prefix_cache_queries += queries
        s.prefix_cache_hits += hits

    def _draft(self, batch: ScheduledBatch) -> tuple[list[list[int]] | None, list[int]]:
        """Each request's k draft tokens (its n-gram proposal, padded with its last token: padding is simply
        verified like any draft) and how many of them were proposed; (None, []) when no request has a
        proposal (a plain decode step is cheaper)."""
        k = self.drafter.k
        proposals = [self.drafter.propose(seq.token_ids) for seq in batch.seqs]
        if not any(proposals):
            return None, []
        drafts = [p + [(p or seq.token_ids)[-1]] * (k - len(p)) for seq, p in zip(batch.seqs, proposals)]
        return drafts, [len(p) for p in proposals]

    def _record(self, batch: ScheduledBatch, mode: ForwardMode, new_tokens: list[list[int]], kept: list[int],
                proposed: list[int], seconds: float) -> None:
        """Add one step to the stats: ``new_tokens`` are the tokens each request produced, ``kept`` how many
        of them postprocess appended, ``proposed`` each request's real draft tokens (verify steps)."""
        s = self.stats
        if mode == ForwardMode.EXTEND:
            s.prefill_tokens += sum(batch.num_tokens)
            s.prefill_seconds += seconds
            s.prefill_steps += 1
        elif mode.is_decode_like():
            s.decode_tokens += sum(kept)
            s.decode_seconds += seconds
            s.decode_steps += 1
            if mode == ForwardMode.TARGET_VERIFY:
                s.verify_steps += 1
                for n, produced, appended in zip(proposed, new_tokens, kept):
                    # Real proposals only: tokens padding a short draft do not count as drafted. Accepted
                    # drafts are the produced tokens before the target's own (the last), as far as the
                    # request kept them.
                    s.draft_tokens += n
                    s.accepted_draft_tokens += min(n, len(produced) - 1, appended)
        else:
            s.mixed_tokens += sum(batch.num_tokens)
            s.mixed_seconds += seconds
            s.mixed_steps += 1

    def _output(self, seq: Sequence) -> RequestOutput:
        """The output of a request that just finished; a tokenizer that cannot decode its tokens fails the
        request ("error") rather than the step."""
        del self._requests[seq.seq_id]
        text = None
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            except Exception as exc:
                seq.finish_reason = "error"
                seq.error = f"tokenizer: decoding the output raised {type(exc).__name__}: {exc}"
        return RequestOutput(request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=seq.output_token_ids, finish_reason=seq.finish_reason, text=text,
                             arrival_time=seq.arrival_time, token_times=list(seq.token_times), error=seq.error)

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt, or a list of token-id lists / strings) to completion; outputs in
        prompt order. ``params``: one SamplingParams for all, or one per prompt.

        Every prompt and its params are checked before any is queued, so an error queues nothing.
        Requests queued earlier with ``add_request`` run alongside: those finishing during the call are
        kept for ``pop_finished``, and those still unfinished when this call's requests are done stay
        queued (``step`` or a later ``generate`` runs them). Concurrent calls run one after the other."""
        with self._lock:
            return self._generate(prompts, params, use_tqdm)

    def _generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                  params: SamplingParams | Seq[SamplingParams] | None, use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of prompts")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: expected {len(prompts)} SamplingParams (one per prompt), got {len(params)}")
        seqs = [self._new_sequence(p, sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            self._enqueue(seq)
        ids = [seq.seq_id for seq in seqs]
        wanted = set(ids)
        done: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(done) < len(ids) and self.scheduler.has_unfinished():
            for out in self._step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
                else:
                    # A request queued earlier through add_request: not this call's, but not to be lost.
                    self._finished[out.request_id] = out
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
