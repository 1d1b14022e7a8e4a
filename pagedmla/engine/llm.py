"""LLM: the engine's Python API (nano-vllm style). ``LLM(model).generate(prompts, params)``.

Requests can also be driven step by step (``add_request`` / ``step`` / ``abort``), which is how requests
join a running batch: anything added between steps is admitted by the scheduler at the next step.
Features (each leaves greedy output unchanged): chunked prefill under a per-step token budget, MIXED
prefill + decode steps, prefix caching, preemption with recomputation when pages run out, CUDA graphs
for decode / verify steps, and speculative decoding verified in one target step, drafted by n-gram lookup
or by the model's own MTP layer (``pagedmla.engine.mtp_drafter``).

A step never fails for one request: a sample (one of a request's ``n``) whose logits hold inf/NaN, or
whose sampling, log-probabilities, post-processing or detokenisation raises, finishes with finish_reason
"error" (``CompletionOutput.error`` says why; ``RequestOutput.error`` reads the first sample's) and the
step's other samples go on. Its tokens and text are what it had made before (text None when decoding
was what failed).

Threads: one ``LLM`` may be shared. Its public methods hold one re-entrant lock, so concurrent
``generate`` calls run one after the other (each to completion, returning only its own requests), a
``stream`` holds the lock from its first delta to its last (or until it is closed), and ``add_request``
/ ``step`` / ``abort`` / ``pop_finished`` / ``has_unfinished`` / ``encode`` are safe to call from any
thread (a server: one thread stepping, others adding and aborting; an ``add_request`` waits at most for
the step in progress, or for a ``generate`` call or a stream in progress to end).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedmla import kv_format
from pagedmla.backend import ForwardMode
from pagedmla.config import resolve_dtype
from pagedmla.engine import distributed
from pagedmla.engine.drafter import NgramDrafter
from pagedmla.engine.kv_pages import KVPages
from pagedmla.engine.model_runner import ModelRunner
from pagedmla.engine.mtp_drafter import DRAFT_CACHE_LAYERS, DRAFT_GRAPH_MODES, MAX_DRAFT_TOKENS, MTPDrafter
from pagedmla.engine.prefix_cache import PrefixCache
from pagedmla.engine.profiler import AttentionProfiler
from pagedmla.engine.sampling import NonFiniteLogitsError, SamplingParams, sample, token_logprobs
from pagedmla.engine.scheduler import ScheduledBatch, Scheduler
from pagedmla.engine.sequence import Sequence
from pagedmla.engine.speculative import verify
from pagedmla.engine.tokenizer import Detokenizer, find_stop, missing_tokenizer_hint, resolve_tokenizer
from pagedmla.model.config import DeepseekConfig, tiny_config
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.factory import TINY, load_model, load_mtp
from pagedmla.model.memory import check_fits
from pagedmla.model.mtp import DeepseekMTP
from pagedmla.parallel import SINGLE

_DEVICE_TYPES = ("cpu", "cuda")
SPECULATIVE_METHODS = ("ngram", "mtp")


@dataclass
class CompletionOutput:
    """One sample of a request (``RequestOutput.outputs[index]``).

    text: the generated text (None without a tokenizer), cut before a stop string; token_ids: the
    generated ids (up to the token that completed a stop string, or the stop token itself);
    finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the context),
    "abort", or "error" (the engine could not sample, post-process or decode this sample; ``error`` says
    why); stop_reason: the stop string or stop token id that ended it (None otherwise, EOS included);
    logprobs: with ``SamplingParams.logprobs``, per generated token a {token id: log-probability} dict
    (the token's and the top-k); cumulative_logprob: the sum of the generated tokens' log-probabilities;
    token_times: ``time.perf_counter()`` when each token came out; error: why it failed (None unless
    finish_reason is "error")."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class RequestOutput:
    """A finished (or aborted) request, shaped as vLLM's: its prompt and ``outputs``, one CompletionOutput
    per sample (``SamplingParams.n``). ``token_ids``, ``text``, ``finish_reason``, ``token_times`` and
    ``error`` read the first sample's.

    prompt: the prompt text (None for a prompt of ids); arrival_time: ``time.perf_counter()`` when the
    request was added (with ``token_times``: time to first token, inter-token latency)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None
    arrival_time: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def token_times(self) -> list[float]:
        return self.outputs[0].token_times

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


@dataclass
class StreamDelta:
    """What one engine step added to a streamed request (``LLM.stream``): its new token ids and, with a
    tokenizer, their text (held back while it could still turn into a stop string); ``output`` is set on
    the last delta, the request's final RequestOutput."""

    token_ids: list[int]
    text: str | None
    output: RequestOutput | None = None


@dataclass
class _Request:
    """A queued prompt and its n samples (one Sequence each); ``done`` holds the finished samples by index."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    done: dict[int, CompletionOutput] = field(default_factory=dict)


@dataclass
class _Sample:
    """The engine's bookkeeping for one Sequence beyond the scheduler's: its request and index there, the
    incremental text (stop strings and streaming), its tokens' log-probabilities, what stopped it."""

    request: _Request
    index: int
    detokenizer: Detokenizer | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None
    stop_at: int | None = None  # where the stop string starts in the detokenizer's text


@dataclass
class EngineStats:
    """Token counts and wall time per step kind (prefill = EXTEND steps, decode = DECODE and verify steps,
    ``verify_steps`` of them verify steps; MIXED steps are counted apart). Prefill and mixed tokens are
    the tokens run; decode tokens are those the requests kept (up to a stop token or max_tokens).
    Attention calls/seconds fill in when profiling. Speculative decoding: draft tokens proposed, and
    accepted into the output (``acceptance_rate``), over ``verified_requests`` request-steps of verify
    (``tokens_per_verify``: what a request gains from one). Prefix caching: tokens whose prefill a cached prefix
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
    verified_requests: int = 0
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
    def tokens_per_verify(self) -> float:
        """Tokens a request gained per verify step: its accepted drafts plus the target's own token (0 before
        any verify step)."""
        return 1.0 + self.accepted_draft_tokens / self.verified_requests if self.verified_requests else 0.0

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


def parse_device(device: Any) -> torch.device:
    """``device`` (None: CUDA when available, else CPU) as a torch.device the engine runs on; ValueError
    naming ``device`` for a malformed name, a device type other than cpu / cuda, or CUDA this machine lacks."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a device name; expected cpu, cuda or cuda:N") from None
    if dev.type not in _DEVICE_TYPES:
        raise ValueError(f"device: {dev.type!r} is not supported; pagedmla runs on {' or '.join(_DEVICE_TYPES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: CUDA was asked for but is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {dev} does not exist; this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    return dev


def _check_loaded_model(model: DeepseekForCausalLM, device: Any, dtype: Any, seed: int | None) -> None:
    """A model passed in already has its device, dtype and weights: arguments asking for others (which
    only apply to a model LLM loads) are errors rather than silently ignored."""
    weight = model.model.embed_tokens.weight
    if device is not None:
        dev = parse_device(device)
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


def _kv_cache_dtype(value: Any) -> Any:
    """LLM's ``kv_cache_dtype``: None for "auto" / None (the model's dtype), else what MLAConfig's
    ``kv_cache_dtype`` takes (a float dtype or its name, or an FP8 format: fp8_e4m3 / fp8 / fp8_ds_mla)."""
    if value is None or value == "auto":
        return None
    if kv_format.fp8_storage(value) is not None:
        return value
    return resolve_dtype(value, "kv_cache_dtype")


def _page_bytes(model: DeepseekForCausalLM, page_size: int, cache_dtype: Any, draft_layers: int = 0) -> int:
    """Bytes of one cache page on one rank: ``page_size`` latent rows in every layer, and in the
    ``draft_layers`` of an MTP draft model's cache (which uses the same page ids); a row is kv_dim values of
    ``cache_dtype`` or, for an FP8 format, its row (576 bytes for fp8_e4m3, 656 for fp8_ds_mla)."""
    cfg = model.config
    layers = cfg.num_hidden_layers + draft_layers
    kv_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    fp8 = kv_format.fp8_storage(cache_dtype)
    row = kv_dim * cache_dtype.itemsize if fp8 is None else kv_format.row_bytes(fp8[1], kv_dim)
    return page_size * row * layers


def _default_num_pages(model: DeepseekForCausalLM, page_size: int, dtype: Any, budget_bytes: int,
                       max_batch_size: int, max_context_len: int, tokens_per_page: int,
                       draft_layers: int = 0) -> int:
    """Pages of ``page_size`` rows per rank that ``budget_bytes`` holds, at most what ``max_batch_size``
    requests of ``max_context_len`` tokens use (a page holds ``tokens_per_page`` tokens of a request:
    more than its rows under decode context parallelism)."""
    enough = max_batch_size * (-(-max_context_len // tokens_per_page) + 1)
    return max(2, min(budget_bytes // _page_bytes(model, page_size, dtype, draft_layers), enough) + 1)


def _check_cache_fits(model: DeepseekForCausalLM, page_size: int, num_pages: int, max_batch_size: int,
                      context: int, pages_field: str, context_field: str, tokens_per_page: int,
                      cache_dtype: Any, draft_layers: int = 0) -> None:
    """ValueError naming the field at fault when the cache's pages (``pages_field``: num_pages or the
    cache_bytes that sized it; with ``draft_layers`` of a draft cache) and its two int32 page tables (the
    request table's and the backend's, rows of ``context`` tokens: ``context_field``) would not fit in the
    device's available memory."""
    weight = model.model.embed_tokens.weight
    pages = num_pages * _page_bytes(model, page_size, cache_dtype, draft_layers)
    tables = 2 * max_batch_size * -(-context // tokens_per_page) * 4
    field, value = (pages_field, num_pages) if pages >= tables else (context_field, context)
    where = " (from the model's config.json; set max_context_len)" if field == "max_position_embeddings" else ""
    check_fits(pages + tables, field, value, weight.device, "the KV cache and its page tables", where)


def _check_parallel_model(model: Any, device: Any, tensor_parallel_size: int) -> str:
    """The device type of a tensor-parallel engine, after checking what can be checked before any rank
    starts: a model each rank can load its slices of ('tiny' or a checkpoint directory) whose heads and
    features ``tensor_parallel_size`` splits, and a device without an index (rank r uses cuda:r)."""
    if isinstance(model, DeepseekForCausalLM):
        raise ValueError("model: with tensor_parallel_size > 1 each rank loads its own slices of the model; pass "
                         "'tiny' or a checkpoint directory, not a loaded model")
    if isinstance(model, str) and model == TINY:
        config = tiny_config()
    elif isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        config = DeepseekConfig.from_file(model)
    else:
        raise ValueError(f"model: {model!r} is neither 'tiny' nor a checkpoint directory")
    config.check_tensor_parallel(tensor_parallel_size)
    dev = parse_device(device)
    if dev.index is not None:
        raise ValueError(f"device: {dev} names one device, but a tensor-parallel engine puts rank r on cuda:r "
                         "(its LOCAL_RANK); pass 'cuda' or leave device unset")
    if dev.type == "cuda" and "WORLD_SIZE" not in os.environ and tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} ranks need as many CUDA devices, this "
                         f"machine has {torch.cuda.device_count()}")
    return dev.type


def _isolated(rows: list[int], run: Callable[[list[int]], list[Any]], what: str,
              errors: dict[int, str]) -> list[Any]:
    """``run(rows)``: one result per batch row, all rows at once. Should that raise, each row is run
    alone so that only the rows that raise again fail: their result None and ``errors[row]`` saying
    that ``what`` raised (one request's failure must not take the step's others with it)."""
    try:
        return run(rows)
    except Exception:
        pass
    out: list[Any] = []
    for i in rows:
        try:
            out += run([i])
        except Exception as exc:
            out.append(None)
            errors[i] = f"{what} raised {type(exc).__name__}: {exc}"
    return out


def _speculative_method(speculative: Any, k: Any, draft_model: Any, draft_graph: Any) -> str | None:
    """The drafter of ``LLM(speculative=..., num_speculative_tokens=k)`` ("ngram", "mtp" or None for none),
    its arguments checked (ValueError / TypeError naming the argument)."""
    if speculative is not None and speculative not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative: expected one of {SPECULATIVE_METHODS} or None, got {speculative!r}")
    if speculative is not None and not k:
        raise ValueError(f"num_speculative_tokens: speculative={speculative!r} needs draft tokens (k >= 1)")
    method = (speculative or "ngram") if k else None
    if method == "mtp" and not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"num_speculative_tokens: MTP drafts 1..{MAX_DRAFT_TOKENS} tokens, got {k}")
    if draft_model is not None:
        if method != "mtp":
            raise ValueError("draft_model: an MTP draft model needs speculative='mtp'")
        if not isinstance(draft_model, DeepseekMTP):
            raise TypeError(f"draft_model: expected a DeepseekMTP, got {type(draft_model).__name__}")
    if draft_graph not in DRAFT_GRAPH_MODES:
        raise ValueError(f"draft_graph: expected one of {DRAFT_GRAPH_MODES}, got {draft_graph!r}")
    return method


def _decode_error(exc: Exception) -> str:
    """The error of a sample whose tokenizer could not decode its tokens."""
    return f"tokenizer: decoding the output raised {type(exc).__name__}: {exc}"


def _cache_size(model: DeepseekForCausalLM, page_size: int, num_pages: int | None, cache_bytes: int,
                max_batch_size: int, max_context_len: int | None, k: int, dcp_size: int,
                draft_layers: int, cache_dtype: Any) -> tuple[int, int]:
    """(tokens per request at most, cache pages) of an engine: ``max_context_len`` or the model's max
    positions; ``num_pages`` or as many as ``cache_bytes`` holds (``_default_num_pages``), checked to hold
    ``max_batch_size`` requests of that many tokens plus k draft tokens (pages of page_size tokens on each
    of ``dcp_size`` decode-context-parallel ranks; ``draft_layers`` more cache layers for an MTP drafter;
    rows of ``cache_dtype``, ``_kv_cache_dtype``'s value: None for the model's dtype)."""
    context = model.config.max_position_embeddings if max_context_len is None else max_context_len
    pages_field = "num_pages" if num_pages is not None else "cache_bytes"
    per_page = page_size * dcp_size
    row_dtype = model.model.embed_tokens.weight.dtype if cache_dtype is None else cache_dtype
    if num_pages is None:
        num_pages = _default_num_pages(model, page_size, row_dtype, cache_bytes, max_batch_size, context, per_page,
                                       draft_layers)
    _check_cache_fits(model, page_size, num_pages, max_batch_size, context + k, pages_field,
                      "max_context_len" if max_context_len is not None else "max_position_embeddings", per_page,
                      row_dtype, draft_layers)
    return context, num_pages


def _checked_settings(*, enable_prefix_caching: Any, mixed_batching: Any, enable_cuda_graph: Any,
                      num_speculative_tokens: Any, max_context_len: Any, cache_bytes: Any, ngram_max_n: Any,
                      speculative: Any, draft_model: Any, draft_graph: Any, page_size: Any, max_batch_size: Any,
                      num_pages: Any, tensor_parallel_size: Any, decode_context_parallel_size: Any,
                      kv_cache_dtype: Any, **others: Any) -> tuple[str | None, Any]:
    """Check ``LLM``'s scalar arguments (all of them by name: ``others`` are checked where they are used),
    a ValueError / TypeError naming the first bad one; returns the drafter ``_speculative_method`` names and
    the cache dtype ``_kv_cache_dtype`` makes of ``kv_cache_dtype``."""
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
    method = _speculative_method(speculative, num_speculative_tokens, draft_model, draft_graph)
    cache_dtype = _kv_cache_dtype(kv_cache_dtype)
    _check_positive_int("page_size", page_size)  # the default num_pages divides by it
    _check_positive_int("max_batch_size", max_batch_size)
    if num_pages is not None:
        _check_positive_int("num_pages", num_pages)
    _check_positive_int("tensor_parallel_size", tensor_parallel_size)
    _check_positive_int("decode_context_parallel_size", decode_context_parallel_size)
    if tensor_parallel_size % decode_context_parallel_size:
        raise ValueError(f"decode_context_parallel_size: {decode_context_parallel_size} does not divide "
                         f"tensor_parallel_size={tensor_parallel_size} (the DCP ranks are ranks of the "
                         "tensor-parallel group)")
    return method, cache_dtype


class LLM:
    """Generate with a DeepSeek-V2/V3 model on pagedmla.

    model: "tiny", a checkpoint directory, or an already loaded DeepseekForCausalLM. device: default CUDA when
    available. dtype: default the checkpoint's (tiny: bf16 on CUDA, fp32 on CPU). page_size: tokens per cache page.
    num_pages: cache size (default: fits ``cache_bytes``); pages are allocated as tokens arrive, and when they run
    out the youngest requests are preempted and recomputed later. provider: attention provider ("torch", "triton",
    ...; default the best for the device). max_batch_size: running requests at most. max_num_batched_tokens: tokens
    per step at most (longer prompts are prefilled in chunks over several steps). extend_prefix_mode: the backend's
    form for prefills over a cached prefix. mixed_batching: run prefill chunks together with running decodes in
    MIXED steps. enable_prefix_caching: share the full pages of common prompt prefixes between requests.
    num_speculative_tokens: k > 0 drafts up to k tokens per request and verifies them in one step, drafted as
    ``speculative`` says: "ngram" (the default) by prompt lookup (n-gram matches of up to ``ngram_max_n`` tokens),
    "mtp" (k 1..4) by the model's multi-token-prediction layer, ``draft_model`` (None: loaded with the model; "tiny"
    has random MTP weights from ``seed``), whose draft decodes replay one CUDA graph (``draft_graph`` "fused") or
    one per step ("per_step"). enable_cuda_graph: replay CUDA graphs for decode / verify steps (None: on for CUDA
    devices) of ``cuda_graph_batch_sizes`` (default 1, 2, 4, 8, 16, ... up to max_batch_size). profile_attention:
    count and time the model's attention calls (adds device synchronisation; such steps run eagerly). seed: the
    random weights of ``tiny`` (default 0; a checkpoint's weights ignore it). device, dtype and seed apply to a
    model LLM loads: with a loaded model they must be unset or agree with it (ValueError otherwise).
    max_context_len: tokens per request at most, prompt included (None: the model's max positions). cache_bytes:
    cache size in bytes that the default num_pages fills (an FP8 ``kv_cache_dtype`` holds about twice the pages of a
    bf16 cache in it). kv_cache_dtype: "auto" (the model's dtype), "bf16" / "fp16" / "fp32", or an FP8 cache format
    (``pagedmla.kv_format``): "fp8_e4m3" (scale 1.0 per layer unless ``backend_options`` sets ``kv_cache_scale``) or
    "fp8_ds_mla" (FlashMLA's 656-byte rows). tokenizer: "auto" (the checkpoint directory's tokenizer.json, or its
    transformers-only tokenizer files when transformers is installed), a path to a tokenizer.json or a directory
    holding one, None, or an object with ``encode(text)`` / ``decode(ids, skip_special_tokens=...)`` (a transformers
    tokenizer); checked here, before the model loads. backend_options: further MLAConfig fields for the backend.

    ``generate`` returns its own requests' outputs; requests queued with ``add_request`` that finish
    during a ``generate`` call are kept for ``pop_finished``.
    """

    def __init__(self, model: str | os.PathLike | DeepseekForCausalLM = TINY, *,
                 device: str | torch.device | None = None, dtype: Any = None, page_size: int = 64,
                 num_pages: int | None = None, provider: str | None = None,
                 max_batch_size: int = 32, max_num_batched_tokens: int = 8192, max_context_len: int | None = None,
                 extend_prefix_mode: str = "auto", mixed_batching: bool = False, cache_bytes: int = 1 << 28,
                 enable_prefix_caching: bool = False, num_speculative_tokens: int = 0, ngram_max_n: int = 4,
                 speculative: str | None = None, draft_model: DeepseekMTP | None = None, draft_graph: str = "fused",
                 enable_cuda_graph: bool | None = None, cuda_graph_batch_sizes: list[int] | None = None,
                 profile_attention: bool = False, seed: int | None = None, tokenizer: Any = "auto",
                 backend_options: dict | None = None, tensor_parallel_size: int = 1,
                 decode_context_parallel_size: int = 1, kv_cache_dtype: Any = "auto"):
        # The arguments as given: the other ranks of a tensor-parallel engine build theirs from them.
        settings = {name: value for name, value in locals().items() if name != "self"}
        # Arguments are checked before any model is loaded or cache allocated.
        method, cache_dtype = _checked_settings(**settings)
        self.tokenizer = resolve_tokenizer(tokenizer, model)
        self._tokenizer_hint = missing_tokenizer_hint(model) if self.tokenizer is None else ""
        self._parallel: distributed.Parallel | None = None
        tp, dcp = SINGLE, SINGLE
        if tensor_parallel_size > 1:
            if method == "mtp":
                raise ValueError("speculative: 'mtp' runs on one device; it is not available with "
                                 f"tensor_parallel_size={tensor_parallel_size} yet")
            device_type = _check_parallel_model(model, device, tensor_parallel_size)
            self._parallel = distributed.start(tensor_parallel_size, decode_context_parallel_size, device_type,
                                               settings, _build_rank)
            device, tp, dcp = self._parallel.device, self._parallel.tp, self._parallel.dcp
        # Building is collective in a tensor-parallel engine: every rank fails if one does.
        with distributed.building(self._parallel):
            if isinstance(model, DeepseekForCausalLM):
                _check_loaded_model(model, device, dtype, seed)
                self.model = model
            else:
                self.model = load_model(model, device=parse_device(device), dtype=dtype,
                                        seed=0 if seed is None else seed, tp=tp)
            if method == "mtp" and draft_model is None:
                if isinstance(model, DeepseekForCausalLM):
                    raise ValueError("draft_model: speculative='mtp' with a loaded model needs its MTP layers; "
                                     "pass draft_model=pagedmla.model.load_mtp(model, PATH)")
                draft_model = load_mtp(self.model, model, seed=0 if seed is None else seed)
            cfg = self.model.config
            context, num_pages = _cache_size(self.model, page_size, num_pages, cache_bytes, max_batch_size,
                                             max_context_len, num_speculative_tokens, dcp.size,
                                             DRAFT_CACHE_LAYERS if method == "mtp" else 0, cache_dtype)
            options = dict(backend_options or {})
            if cache_dtype is not None:
                options["kv_cache_dtype"] = cache_dtype
            self.runner = ModelRunner(self.model, page_size=page_size, num_pages=num_pages,
                                      max_batch_size=max_batch_size, max_context_len=context, provider=provider,
                                      extend_prefix_mode=extend_prefix_mode, backend_options=options,
                                      num_speculative_tokens=num_speculative_tokens, dcp=dcp)
            table = self.runner.table
            prefix_cache = PrefixCache(table.allocator, table.page_size) if enable_prefix_caching else None
            self.pages = KVPages(table, prefix_cache, recompute_last_cached_page=method == "mtp")
            self.scheduler = Scheduler(self.pages, max_batch_size=max_batch_size,
                                       max_num_batched_tokens=max_num_batched_tokens, max_context_len=context,
                                       eos_token_ids=cfg.eos_token_id, mixed=mixed_batching,
                                       num_speculative_tokens=num_speculative_tokens)
            self.drafter: NgramDrafter | MTPDrafter | None = None
            if method == "ngram":
                self.drafter = NgramDrafter(num_speculative_tokens, max_n=ngram_max_n)
            elif method == "mtp":
                self.drafter = MTPDrafter(self.runner, draft_model, num_speculative_tokens)
            if enable_cuda_graph is None:
                enable_cuda_graph = self.runner.device.type == "cuda"
            if enable_cuda_graph:
                graphs = self.runner.capture_cuda_graphs(cuda_graph_batch_sizes)
                if isinstance(self.drafter, MTPDrafter):
                    self.drafter.capture_graphs(graphs.batch_sizes, mode=draft_graph)
        self.profiler = AttentionProfiler(self.runner.backend) if profile_attention else None
        self.stats = EngineStats()
        # Unfinished requests by request id, and the engine's state of each of their samples by seq_id.
        self._requests: dict[int, _Request] = {}
        self._samples: dict[int, _Sample] = {}
        # Outputs of add_request'ed requests that finished inside a generate call, for pop_finished.
        self._finished: dict[int, RequestOutput] = {}
        # Held by every public method that reads or changes the requests (the module's thread contract).
        self._lock = threading.RLock()
        if self._parallel is not None:
            self._join_ranks()

    def _join_ranks(self) -> None:
        """Tensor parallelism, once every rank has built its engine: rank 0 sends each step to the others,
        which serve them here until rank 0 shuts down."""
        channel = distributed.StepChannel(self._parallel, self.runner.table)
        self._parallel.channel = channel
        if not self._parallel.is_driver:
            distributed.serve(self.runner, channel)
            self._parallel.close()
            return
        self.runner.step_hook = channel.send
        # Rank 0's exit sends the other ranks home too.
        weakref.finalize(self, self._parallel.shutdown)

    @property
    def is_driver(self) -> bool:
        """False on ranks 1..N-1 of a tensor-parallel engine: they only ran rank 0's steps, and their
        ``LLM(...)`` returned when rank 0 shut down."""
        return self._parallel is None or self._parallel.is_driver

    def shutdown(self) -> None:
        """Send the other ranks of a tensor-parallel engine home and leave its process groups (also done
        when this engine is collected or the interpreter exits); the engine cannot step afterwards. Nothing
        to do for a single-process engine."""
        if self._parallel is not None:
            self._parallel.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """A prompt as token ids: a list of ids as is, text through the tokenizer; either way checked
        against the model's vocabulary."""
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer and this model has none"
                                 f"{self._tokenizer_hint}; pass tokenizer=PATH (a tokenizer.json) or token id lists")
            # Under the lock: steps decode with the same tokenizer, which need not be safe to enter from two
            # threads at once (transformers' fast tokenizers can raise "Already borrowed").
            with self._lock:
                ids = list(self.tokenizer.encode(prompt))
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"tokenizer: it encodes the prompt to id {bad[0]}, outside the model's vocabulary "
                                 f"(0..{vocab - 1}): the tokenizer does not belong to this model")
            return ids
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = list(prompt)
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompts: expected a non-empty list of token ids in 0..{vocab - 1}, got {prompt!r}")
        return ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it joins the running batch at the next step. Returns its request id."""
        with self._lock:
            request = self._new_request(prompt, params)
            self._enqueue(request)
        return request.request_id

    def _new_request(self, prompt: str | Seq[int], params: SamplingParams | None,
                     stream: bool = False) -> _Request:
        """A request checked to be runnable (ValueError / TypeError naming the argument otherwise), not
        queued: one Sequence per sample, sample i seeded with seed + i. ``stream``: its text is built as
        it grows (``LLM.stream``)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer and this model has none; "
                             "use stop_token_ids")
        ids = self.encode(prompt)
        now = time.perf_counter()
        per_sample = [params if params.n == 1 else dataclasses.replace(
            params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]
        seqs = [Sequence(ids, p, self.device, arrival_time=now) for p in per_sample]
        self.scheduler.check(seqs[0])
        request = _Request(seqs[0].seq_id, prompt if isinstance(prompt, str) else None, ids, seqs)
        for i, seq in enumerate(seqs):
            text = self.tokenizer is not None and (bool(params.stop) or stream)
            self._samples[seq.seq_id] = _Sample(request, i, Detokenizer(self.tokenizer, ids) if text else None,
                                                [] if params.logprobs is not None else None)
        return request

    def _enqueue(self, request: _Request) -> None:
        """Queue a checked request's samples and track it until they finish or it is aborted."""
        for seq in request.seqs:
            self.scheduler.add(seq)
        self._requests[request.request_id] = request

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
        """Stop an unfinished request now (its waiting or running samples), freeing its pages; returns its
        output so far, finish_reason "abort" on the samples it stopped."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise ValueError(f"request_id: {request_id!r} is not an unfinished request of this engine")
            output = None
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    output = self._finish_sample(seq)
            return output

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the requests that finished in it (those that failed in it
        included, with finish_reason "error")."""
        with self._lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if not self.is_driver:
            raise RuntimeError(f"LLM: rank {self._parallel.tp.rank} of a tensor-parallel engine only runs rank 0's "
                               "steps; generate on rank 0 (guard the call with `if llm.is_driver`)")
        if self._parallel is not None and self._parallel.closed:
            raise RuntimeError("LLM: this tensor-parallel engine was shut down")
        before = self._page_counts()
        batch = self.scheduler.schedule()
        if batch is None:
            # Scheduling may still have preempted requests.
            self._record_page_counts(before)
            return []
        calls, secs = (self.profiler.calls, self.profiler.seconds) if self.profiler else (0, 0.0)
        start = time.perf_counter()
        mode, tokens, drafts, proposed, on_device = batch.mode, None, None, [], None
        mtp = isinstance(self.drafter, MTPDrafter)
        if batch.speculative and mtp:
            # The drafts stay on the device: they take their places in the verify step's tokens there.
            drafts = on_device = self.drafter.propose(batch.seqs)
            proposed = [self.drafter.k] * len(batch.seqs)
            mode = ForwardMode.TARGET_VERIFY
            tokens = [[seq.token_ids[-1]] + [0] * self.drafter.k for seq in batch.seqs]
        elif batch.speculative:
            drafts, proposed = self._draft(batch)
            if drafts is not None:
                mode = ForwardMode.TARGET_VERIFY
                tokens = [[seq.token_ids[-1]] + d for seq, d in zip(batch.seqs, drafts)]
        elif batch.num_extends:
            tokens = [seq.token_ids[seq.num_cached_tokens: seq.num_cached_tokens + n]
                      for seq, n in zip(batch.seqs, batch.num_tokens)]
        logits = self.runner.run(batch.seqs, mode, batch.num_extends, tokens=tokens, all_logits=drafts is not None,
                                 backend=self.profiler, draft_tokens=on_device, return_hidden=mtp)
        if mtp:
            logits, hidden = logits
        new_tokens, errors = self._sample(batch, logits, drafts)
        if mtp:
            # Before postprocess: a finishing request's pages still hold its rows, and the step's full pages
            # are committed to the prefix cache only once the draft's rows in them are its accepted tokens'.
            self.drafter.after_step(batch, mode, hidden, new_tokens)
        logprobs = self._logprobs(batch, logits, new_tokens, drafts is not None, errors)
        now = time.perf_counter()  # the tokens were read back, so the device is done
        if self.profiler:
            kind = mode.value
            self.stats.attention_calls[kind] = self.stats.attention_calls.get(kind, 0) + self.profiler.calls - calls
            self.stats.attention_seconds[kind] = self.stats.attention_seconds.get(kind, 0.0) + \
                self.profiler.seconds - secs
        lengths = [len(seq) for seq in batch.seqs]
        finished = self.scheduler.postprocess(batch, new_tokens, verified=drafts is not None, now=now,
                                              errors=errors)
        finished += self._advance_text(batch, lengths)
        # Stop tokens, stop strings and max_tokens may cut a request's new tokens short: count what it kept.
        kept = [len(seq) - n for seq, n in zip(batch.seqs, lengths)]
        for seq, n, rows in zip(batch.seqs, kept, logprobs):
            if rows is not None:
                self._samples[seq.seq_id].logprobs += rows[:n]
        self._record(batch, mode, new_tokens, kept, proposed, now - start)
        self._record_page_counts(before)
        return [out for out in map(self._finish_sample, finished) if out is not None]

    def _logprobs(self, batch: ScheduledBatch, logits: torch.Tensor, new_tokens: list[list[int]],
                  verified: bool, errors: dict[int, str]) -> list[list[dict[int, float]] | None]:
        """Per request of the step, the log-probability dicts of its new tokens when it asked for them (None
        otherwise). A verify step's row j of a request is the distribution its j-th new token came from; other
        steps have one row per request. A request whose log-probabilities raise (alone, as ``_isolated``
        finds out) fails: an entry in ``errors`` for its batch row, and its ``new_tokens`` emptied."""
        wanted = [i for i, seq in enumerate(batch.seqs) if seq.params.logprobs is not None and new_tokens[i]]
        out: list[list[dict[int, float]] | None] = [None] * len(batch.seqs)
        if not wanted:
            return out
        per_request = logits.shape[0] // len(batch.seqs) if verified else 1

        def compute(idx: list[int]) -> list[list[dict[int, float]]]:
            rows = [i * per_request + j for i in idx for j in range(len(new_tokens[i]))]
            tokens = [t for i in idx for t in new_tokens[i]]
            top = [batch.seqs[i].params.logprobs for i in idx for _ in new_tokens[i]]
            entries = iter(token_logprobs(logits[rows], tokens, top))
            return [[next(entries) for _ in new_tokens[i]] for i in idx]

        for i, entries in zip(wanted, _isolated(wanted, compute, "log-probabilities", errors)):
            if entries is None:
                new_tokens[i] = []
            else:
                out[i] = entries
        return out

    def _advance_text(self, batch: ScheduledBatch, lengths: list[int]) -> list[Sequence]:
        """Feed each step's new tokens (those past ``lengths``) to the samples that build their text as it
        grows (``_push_text``); a sample whose tokenizer raises fails alone. Returns the samples this
        finished (the scheduler had not already)."""
        finished = []
        for seq, start in zip(batch.seqs, lengths):
            state = self._samples.get(seq.seq_id)
            if state is None or state.detokenizer is None:
                continue
            was_finished = seq.is_finished
            try:
                self._push_text(seq, start, state)
            except Exception as exc:  # one sample's tokenizer failure must not take the step's others with it
                self.scheduler.fail(seq, _decode_error(exc))
            if seq.is_finished and not was_finished:
                finished.append(seq)
        return finished

    def _push_text(self, seq: Sequence, start: int, state: _Sample) -> None:
        """Push ``seq``'s tokens from ``start`` on to its detokenizer; once its text holds one of its stop
        strings it loses the tokens after the one completing it and finishes with reason "stop"."""
        text = state.detokenizer
        for pos in range(start, len(seq)):
            searched = len(text.text)
            text.push(seq.token_ids[pos])
            # A sample that failed keeps "error" (its text still grows to what its tokens say).
            hit = find_stop(text.text, seq.params.stop, searched) if seq.params.stop and seq.error is None else None
            if hit is None:
                continue
            state.stop_at, state.stop_reason = hit
            self.scheduler.finish(seq, "stop")
            del seq.token_ids[pos + 1:]
            del seq.token_times[seq.num_output_tokens:]
            return

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor,
                drafts: list[list[int]] | torch.Tensor | None) -> tuple[list[list[int]], dict[int, str]]:
        """Each request's new tokens this step (none for a prompt chunk that is not its last), and a
        message for each batch row that could not be sampled (its tokens are then []).

        The batch is sampled at once; rows reported non-finite (None) fail alone. Any other exception
        samples the requests one at a time (``_isolated``), so that only those that raise again fail."""
        seqs = batch.seqs
        if drafts is not None:
            rows = list(range(len(seqs)))
            width = logits.shape[0] // len(seqs)

            def draw(idx: list[int]) -> list[list[int] | None]:
                # All rows, or one (``_isolated``); drafts are host lists or a device tensor.
                whole = len(idx) == len(seqs)
                part = logits if whole else logits[idx[0] * width:(idx[0] + 1) * width]
                try:
                    return verify(part, drafts if whole else drafts[idx[0]:idx[0] + 1], [seqs[i].params for i in idx],
                                  [seqs[i].generator for i in idx])
                except NonFiniteLogitsError as exc:
                    return exc.tokens
        else:
            # Only a step that reaches a request's last token samples (not the earlier prompt chunks).
            rows = [i for i in range(len(seqs)) if batch.samples(i)]

            def draw(idx: list[int]) -> list[list[int] | None]:
                try:
                    tokens = sample(logits[idx], [seqs[i].params for i in idx], [seqs[i].generator for i in idx])
                except NonFiniteLogitsError as exc:
                    tokens = exc.tokens
                return [None if t is None else [t] for t in tokens]
        new_tokens: list[list[int]] = [[] for _ in seqs]
        errors: dict[int, str] = {}
        if not rows:
            return new_tokens, errors
        for i, tokens in zip(rows, _isolated(rows, draw, "sampling", errors)):
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
                s.verified_requests += len(batch.seqs)
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

    def _finish_sample(self, seq: Sequence) -> RequestOutput | None:
        """Record a finished sample (failed, finish_reason "error", if its text cannot be decoded); its
        request's RequestOutput once every sample of it is done (else None)."""
        state = self._samples.pop(seq.seq_id)
        request = state.request
        ids = seq.output_token_ids
        if state.stop_reason is None and seq.finish_reason == "stop" and ids and ids[-1] in seq.params.stop_token_ids:
            state.stop_reason = ids[-1]
        cumulative = None
        if state.logprobs is not None:
            cumulative = sum(entry[t] for entry, t in zip(state.logprobs, ids))
        try:
            text = self._text(state, seq)
        except Exception as exc:  # a tokenizer that cannot decode the tokens fails the sample, not the step
            text = None
            if seq.error is None:  # else it failed already, and that is the error to report
                self.scheduler.fail(seq, _decode_error(exc))
        request.done[state.index] = CompletionOutput(
            index=state.index, text=text, token_ids=ids, finish_reason=seq.finish_reason,
            stop_reason=state.stop_reason, logprobs=state.logprobs, cumulative_logprob=cumulative,
            token_times=list(seq.token_times), error=seq.error)
        if len(request.done) < len(request.seqs):
            return None
        del self._requests[request.request_id]
        return RequestOutput(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                             outputs=[request.done[i] for i in range(len(request.seqs))], prompt=request.prompt,
                             arrival_time=seq.arrival_time)

    def _text(self, state: _Sample, seq: Sequence) -> str | None:
        """A finished sample's text: what its detokenizer built (cut before the stop string), or the same
        incremental decoding run over its tokens now; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = state.detokenizer
        if text is None:
            text = Detokenizer(self.tokenizer, seq.prompt_token_ids)
            for token in seq.output_token_ids:
                text.push(token)
        if state.stop_at is not None:
            return text.text[:state.stop_at]
        return text.text + text.flush()

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = False) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt, or a list of token-id lists / strings) to completion; outputs in
        prompt order. ``params``: one SamplingParams for all, or one per prompt. ``use_tqdm``: a progress
        bar over the generated tokens on stderr (None: only when stderr is a terminal), shown once the
        run has taken a second.

        Every prompt and its params are checked before any is queued, so an error queues nothing.
        Requests queued earlier with ``add_request`` run alongside: those finishing during the call are
        kept for ``pop_finished``, and those still unfinished when this call's requests are done stay
        queued (``step`` or a later ``generate`` runs them). Concurrent calls run one after the other."""
        with self._lock:
            return self._generate(prompts, params, use_tqdm)

    def _generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                  params: SamplingParams | Seq[SamplingParams] | None,
                  use_tqdm: bool | None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of prompts")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: expected {len(prompts)} SamplingParams (one per prompt), got {len(params)}")
        requests: list[_Request] = []
        try:
            for p, sp in zip(prompts, params):
                requests.append(self._new_request(p, sp))
        except (ValueError, TypeError):
            self._forget(requests)
            raise
        for request in requests:
            self._enqueue(request)
        wanted = {r.request_id for r in requests}
        done: dict[int, RequestOutput] = {}
        seqs = [seq for r in requests for seq in r.seqs]
        bar = tqdm(total=self._token_budget(seqs), desc="generate", unit="tok", delay=1.0,
                   disable=None if use_tqdm is None else not use_tqdm)
        while len(done) < len(requests) and self.scheduler.has_unfinished():
            for out in self._step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                else:
                    # A request queued earlier through add_request: not this call's, but not to be lost.
                    self._finished[out.request_id] = out
            if not bar.disable:
                bar.total = self._token_budget(seqs)
                bar.n = sum(seq.num_output_tokens for seq in seqs)
                bar.set_postfix_str(f"{len(done)}/{len(requests)} requests", refresh=True)
        bar.close()
        return [done[r.request_id] for r in requests]

    def _token_budget(self, seqs: list[Sequence]) -> int:
        """Output tokens ``seqs`` produce at most: max_tokens within the context, or what a finished one made."""
        context = self.scheduler.max_context_len
        return sum(seq.num_output_tokens if seq.is_finished else
                   min(seq.params.max_tokens, context - seq.num_prompt_tokens) for seq in seqs)

    def _forget(self, requests: list[_Request]) -> None:
        """Drop the sample states of requests that were checked but never queued."""
        for request in requests:
            for seq in request.seqs:
                self._samples.pop(seq.seq_id, None)

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Run one prompt (one sample: ``params.n`` 1) to completion, yielding after every step that added
        to it a StreamDelta with its new ids and text; the last delta carries the RequestOutput. The text
        deltas add up to ``output.text`` (for a request that failed, finish_reason "error", to the text it
        had before; its ``output.text`` is None if decoding failed). Other queued requests run alongside,
        as in ``generate``.

        Like ``generate``, a stream holds the engine's lock from its first delta until it ends or is
        closed, so other threads' calls wait meanwhile; iterate it (and close it, if abandoned) in the
        thread that started it."""
        with self._lock:
            yield from self._stream(prompt, params)

    def _stream(self, prompt: str | Seq[int], params: SamplingParams | None) -> Iterator[StreamDelta]:
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"params: stream runs one sample, got n={params.n}")
        request = self._new_request(prompt, params, stream=True)
        self._enqueue(request)
        seq = request.seqs[0]
        state = self._samples[seq.seq_id]
        # Text that a longer stop string could still start within is held back until it cannot.
        hold = max((len(s) for s in params.stop), default=1) - 1
        sent_ids, sent_text = 0, 0
        while True:
            output = None
            for out in self._step():
                if out.request_id == request.request_id:
                    output = out
                else:
                    self._finished[out.request_id] = out
            ids = output.token_ids if output is not None else seq.output_token_ids
            text = None
            if self.tokenizer is not None:
                full = state.detokenizer.text if output is None or output.text is None else output.text
                end = len(full) if output is not None else max(sent_text, len(full) - hold)
                text, sent_text = full[sent_text:end], end
            if output is not None or len(ids) > sent_ids or text:
                yield StreamDelta(ids[sent_ids:], text, output)
                sent_ids = len(ids)
            if output is not None:
                return


def _build_rank(settings: dict[str, Any]) -> LLM:
    """A spawned tensor-parallel rank's engine (``distributed.start`` calls it in the new process)."""
    return LLM(**settings)
