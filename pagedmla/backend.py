"""MLABackend: plans and runs MLA attention for every kind of batch an inference engine sends.

Per step the engine calls ``init_forward_metadata(batch)`` once (host-side planning from values the
engine already holds on the host, plus device tensors built without synchronisation), then the model
calls ``forward(...)`` (or ``forward_decode`` / ``forward_extend``) once per layer. The backend owns
``seq_lens`` and the block-table rows from planning on: kernels never take them from the model.

No step path synchronises with the host: planning reads only the host values the engine passes
(``*_cpu`` fields), host-built index arrays reach the device through pinned staging memory with
non-blocking copies, and device values (request slots, lengths, page ids, cache slots) are guarded by the
kernels (``pagedmla.errors``): a request whose slot, length or pages are bad gets NaN rows, the others are
unaffected, and the device error word says what was wrong (the MHA forms attend over the lengths planned on
the host: there a device length other than ``seq_lens_cpu``'s is bad too). ``PAGEDMLA_VALIDATE=all`` checks
those values on the host instead, raising the ``ValueError`` that names them (a synchronisation per step and
layer).

Attention forms (``attention_form`` after planning):
  "mha"      EXTEND without any cached prefix: ragged MHA over the new tokens (q/k 192, v 128); with
             ``MLAConfig.disable_ragged`` these steps run "absorbed" too.
  "chunked"  EXTEND with a prefix, MHA form: causal over the new tokens, then each prefix chunk
             (gathered latent rows decompressed by the model's ``kv_decompress``), merged by LSE.
  "absorbed" everything else: DECODE, TARGET_VERIFY, DRAFT_EXTEND, MIXED, and EXTEND with a prefix
             when the absorbed form is cheaper: q [T, H, 576] over the paged latent cache.

Decode context parallelism (``MLAConfig.dcp_size`` > 1, ``dcp_group``): the cache holds this rank's
interleaved tokens only and ``forward`` returns the attention over the whole context, so the model does
not change (``pagedmla.context_parallel`` has the layout and what each form does there).

Absorbed steps run one of two kernels. Uniform steps (``ForwardMetadata.uniform``: DECODE, a TARGET_VERIFY
of ``num_draft_tokens`` per request, and every captured CUDA graph) run the split-KV decode kernel over
q_len tokens per request, the last q_len positions of each request's KV (bottom-right causal). Ragged
steps (DRAFT_EXTEND, MIXED, EXTEND, a TARGET_VERIFY given per-request token counts) run the varlen
kernel over ``qo_indptr``, except a MIXED step's decodes where ``MLAConfig.mixed_decode_kernel`` sends
them to the decode kernel under their own schedule. A graph of DRAFT_EXTEND runs ``num_draft_tokens`` rows
per request with the real tokens last: the rows ahead of them are padding (their latent rows go to the
reserved slot 0, their attention reads only earlier rows of the request, or none), so the real rows see
exactly what the ragged step would. An IDLE graph runs ``bs`` padding rows (an engine with a fixed-shape
step, such as a rank with no requests under data-parallel attention, still launches its kernels); eager IDLE
steps run no tokens.
"""

from __future__ import annotations

import contextlib
import enum
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedmla import checks, errors
from pagedmla.cache import MLAKVCache
from pagedmla.config import MLAConfig
from pagedmla.context_parallel import ContextParallel, DCPAttention
from pagedmla.device import sm90_available, sm_count, to_device
from pagedmla.ops import library
from pagedmla.ops.attention import merge_state
from pagedmla.ops.providers import available_providers, resolve
from pagedmla.ops.schedule import get_mla_metadata, num_sm_parts_for, schedule_into
from pagedmla.parallel import Group
from pagedmla.rows import poison_bad_lengths, select_requests

# ``MLAConfig.mixed_decode_kernel="auto"``: the varlen kernel's work tile is 64 query rows x 64 keys, one SM's
# unit; a MIXED step's decodes run the decode kernel where the longest decode's key tiles are at least
# MIXED_SPLIT_TAIL times the step's tiles per SM (the one varlen launch would end on that decode alone). Set from
# nine cells measured eager on an H100 (BENCHMARKS.md, "MIXED steps"): the split won 1.24x at a ratio of 2.75,
# 3.1x at 5.5 and 4.2x at 11, lost at 0.69 (0.70x) and below; the split's own host and launch cost is what a low
# ratio does not pay back.
VARLEN_TILE = 64
MIXED_SPLIT_TAIL = 2
# Over an FP8 cache on sm_90 the one varlen launch dequantises every page of the step first
# (``paged_varlen.dequantize_first``), the decodes' included, which the decode kernel reads as FP8: decodes of
# at most MIXED_DEQUANT_ROWS query rows (memory bound) split off from MIXED_DEQUANT_TOKENS cached tokens across
# them. Measured (H100, eager, fp8_e4m3): 1.32-1.45x at 131072 tokens of 16-row decodes, 0.43x at 8192; 128-row
# decodes lost at 8192-131072 (0.72-0.92x) unless they are the tail.
MIXED_DEQUANT_ROWS = 32
MIXED_DEQUANT_TOKENS = 65536


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"

    def is_decode_like(self) -> bool:
        """Uniform q_len per request through the split-KV decode kernel."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


@dataclass
class ForwardBatch:
    """What the engine tells the backend about one step.

    req_pool_indices: int [bs] rows of ``block_table`` (request slots) on the device;
    seq_lens: int32 [bs] on the device, KV length of each request including this step's tokens;
    seq_lens_cpu: the same on the host (required for EXTEND / MIXED / DRAFT_EXTEND and ragged
    TARGET_VERIFY planning);
    extend_seq_lens_cpu / extend_prefix_lens_cpu: new and cached tokens of each extending request
    (EXTEND: all bs; MIXED: the first ``num_extends``, the others decode one token each;
    DRAFT_EXTEND: new tokens of each request; TARGET_VERIFY: tokens verified per request, 1 ..
    num_draft_tokens: a ragged verify unless all are num_draft_tokens, the uniform verify that None or
    empty also mean);
    block_table: int32 [max_requests, max_pages] (the engine's req_to_page).
    """

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    seq_lens_cpu: Sequence[int] | None = None
    extend_seq_lens_cpu: Sequence[int] | None = None
    extend_prefix_lens_cpu: Sequence[int] | None = None
    num_extends: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])


@dataclass
class PrefixChunk:
    """One loop of chunked-prefix prefill: per request the prefix piece [start, start + len)."""

    slots: torch.Tensor  # int64 [total] cache slots of the gathered rows, request-major
    cu_seqlens: torch.Tensor  # int32 [num_extends + 1] over the gathered rows
    max_len: int
    # Decode context parallelism: ``slots`` are this rank's rows only; this indexes the group's gathered rows.
    gather_index: torch.Tensor | None = None


@dataclass
class ForwardMetadata:
    mode: ForwardMode
    bs: int
    form: str
    seq_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    q_len: int = 1
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None
    qo_indptr: torch.Tensor | None = None
    max_q_len: int = 0
    num_tokens: int = 0
    prefix_chunks: list[PrefixChunk] = field(default_factory=list)
    # An absorbed step over an FP8 cache: pages each request's host length spans (int32 [bs + 1]), and their sum.
    kv_page_indptr: torch.Tensor | None = None
    num_kv_pages: int | None = None
    # The MHA forms: seq_lens_cpu on the device (int32 [bs]), the lengths their work was planned for; a request
    # whose device length differs gets NaN rows (``poison_bad_lengths``).
    planned_lens: torch.Tensor | None = None
    dcp: DCPAttention | None = None  # decode context parallelism: the absorbed attention's per-row plan
    # A MIXED step whose decodes run the decode kernel (``MLAConfig.mixed_decode_kernel``): its last
    # ``split_decodes`` requests (one token each), the others in the varlen kernel over ``qo_indptr`` (which
    # then covers those only). ``decode_plan``: their block-table rows and lengths, copied (the rows from
    # request n_ext on need not start at a 16-byte address, and the decode kernel's bound launch, its short
    # host path, needs one), and ``get_mla_metadata``'s pair over those lengths.
    split_decodes: int = 0
    decode_plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def uniform(self) -> bool:
        """Planned as ``q_len`` tokens per request (see the module docstring): for the split-KV decode kernel,
        or under decode context parallelism a per-row plan without ``qo_indptr``."""
        return self.tile_scheduler_metadata is not None or (self.dcp is not None and self.qo_indptr is None)


@dataclass
class _GraphState:
    max_bs: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor
    captured: dict = field(default_factory=dict)


def decode_tail(ext: Sequence[int], seq_lens: Sequence[int], n_ext: int, heads: int, sms: int) -> bool:
    """Whether one varlen launch of a MIXED step (request b: ``ext[b]`` query tokens over ``seq_lens[b]`` keys;
    the requests from ``n_ext`` on decode) would end on its longest decode: that decode's key tiles (one SM
    streams them all) are at least ``MIXED_SPLIT_TAIL`` times the step's tiles (64-row tiles x key tiles, every
    request) per SM."""
    tiles = sum(-(-e * heads // VARLEN_TILE) * -(-s // VARLEN_TILE) for e, s in zip(ext, seq_lens))
    longest = -(-max(seq_lens[n_ext:], default=0) // VARLEN_TILE)
    return longest * sms >= MIXED_SPLIT_TAIL * tiles > 0


def dequant_split(seq_lens: Sequence[int], n_ext: int, heads: int) -> bool:
    """Whether a MIXED step over an FP8 cache whose extends dequantise their pages first should run its decodes
    (the requests from ``n_ext`` on, ``heads`` query rows each) in the decode kernel, which reads them as FP8:
    memory-bound decodes (at most ``MIXED_DEQUANT_ROWS`` rows) over at least ``MIXED_DEQUANT_TOKENS`` cached
    tokens in all, whose dequantisation outweighs the split's own cost."""
    return heads <= MIXED_DEQUANT_ROWS and sum(seq_lens[n_ext:]) >= MIXED_DEQUANT_TOKENS


def auto_sms(device: torch.device) -> int:
    """The SMs ``decode_tail`` counts for "auto": the CUDA device's; 0 elsewhere, where a CPU runs one varlen
    call (its providers have no SMs to leave idle)."""
    return sm_count(device) if device.type == "cuda" else 0


def _layer_id(layer) -> int:
    lid = layer if isinstance(layer, int) else getattr(layer, "layer_id", None)
    if isinstance(lid, bool) or not isinstance(lid, int):
        raise TypeError(f"layer: expected a layer index or an object with .layer_id, got {type(layer).__name__}")
    return lid


def _host_lens(values, name: str, count: int) -> list[int]:
    if values is None:
        raise ValueError(f"{name}: required on the host for this forward mode")
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            # Reading a device tensor back would synchronise the step with the host.
            raise ValueError(f"{name}: expected host values (a list or a CPU tensor), got a tensor on {values.device}")
        if values.dim() != 1 or values.is_floating_point() or values.is_complex():
            raise ValueError(f"{name}: expected a 1-D integer tensor, got {values.dtype} of shape "
                             f"{tuple(values.shape)}")
        values = values.tolist()
    else:
        try:
            values = [operator.index(v) for v in values]
        except TypeError:
            raise ValueError(f"{name}: expected a sequence of ints, got {values!r}") from None
    if len(values) != count:
        raise ValueError(f"{name}: expected {count} entries, got {len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{name}: lengths must be >= 0, got {values}")
    return values


class MLABackend:
    """Attention backend for MLA models over a paged latent cache (see the module docstring).

    provider: "torch", "triton", ... or None for the best available on ``device``. dcp_group: with
    ``config.dcp_size`` > 1, the ``torch.distributed`` process group of the DCP ranks (None: the default
    group), in which this process must be rank ``config.dcp_rank`` of ``config.dcp_size``.
    """

    def __init__(self, config: MLAConfig, device: torch.device | str = "cpu", provider: str | None = None, *,
                 dcp_group=None):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config: expected an MLAConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.heads = config.num_local_heads
        self.kv_dim = config.kv_dim
        self.v_dim = config.kv_lora_rank
        self.scale = float(config.softmax_scale)
        self.provider, self._decode_impl = resolve("paged_decode", self.device, provider)
        # A provider that only has a decode kernel (flashmla) runs the other ops on the default one.
        paged_varlen_provider, self._varlen_paged_impl = self._resolve_or_default("paged_varlen", provider)
        self._varlen_impl = self._resolve_or_default("varlen", provider)[1]
        self._merge_impl = self._resolve_or_default("merge", provider)[1]
        # Where the triton provider's absorbed steps over an FP8 cache run the Hopper kernel over pages dequantised
        # first (paged_varlen.dequantize_first: sm_90, 16-bit queries, 512 + 64 columns, pages a multiple of the
        # 64-key tile); ``dequant_split`` applies only there.
        self._dequantises_first = (config.kv_format is not None and paged_varlen_provider == "triton"
                                   and sm90_available(self.device) and config.dtype in (torch.bfloat16, torch.float16)
                                   and (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
                                   and config.page_size % VARLEN_TILE == 0)
        if self.provider != "torch" and config.kv_cache_dtype == torch.float32:
            raise ValueError(f"kv_cache_dtype: the {self.provider!r} provider runs bfloat16/float16 caches; "
                             "float32 caches need provider='torch'")
        self._dcp = self._context_parallel(dcp_group) if config.dcp_size > 1 else None
        self.metadata: ForwardMetadata | None = None
        self._host_checks = False  # PAGEDMLA_VALIDATE=all, read at each planning
        self._checked_cache: weakref.ref | None = None  # the last cache a forward found to match the config
        self._cache_dtype: torch.dtype | None = None
        self._graph: _GraphState | None = None
        self._num_extends_override: int | None = None

    def _context_parallel(self, dcp_group) -> ContextParallel:
        cfg = self.config
        if not dist.is_initialized():
            raise ValueError(f"dcp_group: dcp_size={cfg.dcp_size} needs torch.distributed initialised "
                             "(init_process_group) and the DCP ranks' process group")
        group = Group.of(dcp_group)
        if (group.size, group.rank) != (cfg.dcp_size, cfg.dcp_rank):
            raise ValueError(f"dcp_group: this process is rank {group.rank} of {group.size} in it, the config says "
                             f"dcp_rank={cfg.dcp_rank} of dcp_size={cfg.dcp_size}")
        return ContextParallel(cfg, group, self.device, self._decode_impl, self._merge_impl)

    def _resolve_or_default(self, op: str, provider: str | None) -> tuple[str, Callable]:
        if provider is not None and provider not in available_providers(op):
            provider = None
        return resolve(op, self.device, provider)

    # ------------------------------------------------------------------ planning
    @property
    def attention_form(self) -> str:
        if self.metadata is None:
            raise RuntimeError("attention_form: call init_forward_metadata(batch) first")
        return self.metadata.form

    @property
    def prefix_chunks(self) -> list[PrefixChunk]:
        return self.metadata.prefix_chunks if self.metadata is not None else []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan one step: block-table rows, split schedule, indptrs, prefix chunks."""
        mode = batch.forward_mode
        if not isinstance(mode, ForwardMode):
            raise TypeError(f"batch.forward_mode: expected a ForwardMode, got {mode!r}")
        if mode != ForwardMode.IDLE:
            self._check_step_tensors(batch.req_pool_indices, batch.seq_lens, batch.block_table, None, "batch.")
        bs = 0 if mode == ForwardMode.IDLE else batch.batch_size
        if bs > self.config.max_batch_size:
            raise ValueError(f"batch: {bs} requests exceed max_batch_size={self.config.max_batch_size}")
        if bs == 0:
            self.metadata = ForwardMetadata(mode=mode, bs=0, form="absorbed")
            return
        seq_cpu = None if batch.seq_lens_cpu is None else _host_lens(batch.seq_lens_cpu, "seq_lens_cpu", bs)
        form = None
        if mode == ForwardMode.EXTEND and seq_cpu is not None:
            ext = _host_lens(batch.extend_seq_lens_cpu, "extend_seq_lens_cpu", bs)
            pre = _host_lens(batch.extend_prefix_lens_cpu, "extend_prefix_lens_cpu", bs)
            self._check_extend(seq_cpu, ext, pre)
            form = self._extend_form(ext, pre)
        block_table, seq_lens = self._step_rows(batch, seq_cpu, planned=form in ("mha", "chunked"))
        verify_lens = None
        if mode == ForwardMode.TARGET_VERIFY and batch.extend_seq_lens_cpu is not None \
                and len(batch.extend_seq_lens_cpu):
            verify_lens = _host_lens(batch.extend_seq_lens_cpu, "extend_seq_lens_cpu", bs)
        # Counts of num_draft_tokens each are the uniform verify: the decode kernel runs it.
        ragged_verify = verify_lens is not None and any(e != self.config.num_draft_tokens for e in verify_lens)
        if mode.is_decode_like() and not ragged_verify:
            self.metadata = self._uniform_metadata(mode, seq_lens, block_table)
            return
        if seq_cpu is None:
            raise ValueError(f"seq_lens_cpu: required on the host for {mode.value} steps")
        if mode == ForwardMode.EXTEND:
            meta = ForwardMetadata(mode=mode, bs=bs, form=form, seq_lens=seq_lens, block_table=block_table)
            self._plan_varlen(meta, ext, seq_cpu)
            if form == "chunked":
                meta.prefix_chunks = self._plan_prefix_chunks(block_table, pre)
            elif form == "absorbed":
                self._plan_dcp_ragged(meta)
            self.metadata = meta
            return
        ext = self._ragged_query_lens(batch, seq_cpu, verify_lens if ragged_verify else None)
        meta = ForwardMetadata(mode=mode, bs=bs, form="absorbed", seq_lens=seq_lens, block_table=block_table)
        if mode == ForwardMode.MIXED:
            meta.split_decodes = self._split_decodes(ext, seq_cpu, self._mixed_extends(batch))
        n_ext = bs - meta.split_decodes
        self._plan_varlen(meta, ext[:n_ext], seq_cpu[:n_ext])
        if meta.split_decodes:
            meta.num_tokens += meta.split_decodes
            table, lens = block_table[n_ext:].clone(), seq_lens[n_ext:].clone()
            meta.decode_plan = (table, lens, *get_mla_metadata(lens, self.heads, 1, kv_format=self.config.kv_format))
        self._plan_dcp_ragged(meta)
        self.metadata = meta

    def _step_rows(self, batch: ForwardBatch, seq_cpu: list[int] | None,
                   planned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table [bs, width] int32, lengths [bs] int32) of the step's requests, gathered by request slot
        into tensors the backend owns (the engine may update its own before the layers run); width is the
        table's, or with host lengths the pages the longest request reads. ``planned``: the step attends over
        the host lengths themselves (the MHA forms), which the device's must then equal."""
        bs = batch.batch_size
        width = batch.block_table.shape[1]
        if seq_cpu is not None:
            # Host lengths bound the pages any request reads: narrower rows, less work for providers
            # whose cost follows the table width (the reference pads every row to it). A device length
            # beyond them reads as beyond the table: that request's rows are NaN.
            self._check_capacity(seq_cpu, width)
            width = max(1, -(-max(seq_cpu) // self.config.tokens_per_page))
        # The backend reads device values back only when asked to (PAGEDMLA_VALIDATE=all), on every device:
        # a step never synchronises otherwise, the kernels guard the values.
        self._host_checks = errors.validate_mode() == "all"
        if self._host_checks:
            self._host_check(lambda: self._check_batch_values(batch, width, seq_cpu, planned))
        block_table = torch.empty(bs, width, dtype=torch.int32, device=self.device)
        seq_lens = torch.empty(bs, dtype=torch.int32, device=self.device)
        select_requests(batch.block_table, batch.req_pool_indices, batch.seq_lens, block_table, seq_lens,
                        self.config.tokens_per_page)
        return block_table, seq_lens

    def _uniform_metadata(self, mode: ForwardMode, seq_lens: torch.Tensor,
                          block_table: torch.Tensor) -> ForwardMetadata:
        """The plan of a step whose requests all run q_len(mode) query tokens (decode, uniform verify, draft
        decode): the split schedule, or the decode-context-parallel plan."""
        bs = seq_lens.shape[0]
        q_len = self.q_len(mode)
        if self._dcp is not None:
            return ForwardMetadata(mode=mode, bs=bs, form="absorbed", seq_lens=seq_lens, block_table=block_table,
                                   q_len=q_len, num_tokens=bs * q_len, max_q_len=q_len,
                                   dcp=self._dcp.plan_uniform(seq_lens, block_table, q_len))
        md, ns = get_mla_metadata(seq_lens, q_len * self.heads, 1, kv_format=self.config.kv_format)
        return ForwardMetadata(mode=mode, bs=bs, form="absorbed", seq_lens=seq_lens, block_table=block_table,
                               q_len=q_len, tile_scheduler_metadata=md, num_splits=ns, num_tokens=bs * q_len,
                               max_q_len=q_len)

    def _ragged_query_lens(self, batch: ForwardBatch, seq_cpu: list[int],
                           verify_lens: list[int] | None) -> list[int]:
        """Query tokens per request of an absorbed step with per-request counts (checked against the host
        lengths): a mixed batch's extends then decodes, a ragged verify's ``verify_lens``, a draft extend."""
        mode = batch.forward_mode
        bs = batch.batch_size
        if mode == ForwardMode.MIXED:
            n_ext = self._mixed_extends(batch)
            ext = _host_lens(batch.extend_seq_lens_cpu, "extend_seq_lens_cpu", n_ext) + [1] * (bs - n_ext)
            pre = _host_lens(batch.extend_prefix_lens_cpu, "extend_prefix_lens_cpu", n_ext) + \
                [s - 1 for s in seq_cpu[n_ext:]]
            self._check_extend(seq_cpu, ext, pre)
        elif verify_lens is not None:
            limit = self.q_len(mode)
            ext = verify_lens
            if not all(1 <= e <= limit for e in ext):
                raise ValueError(f"extend_seq_lens_cpu: a ragged verify runs 1..{limit} tokens per request "
                                 f"(num_draft_tokens), got {ext}")
            self._check_extend(seq_cpu, ext, [s - e for s, e in zip(seq_cpu, ext)])
        elif mode == ForwardMode.DRAFT_EXTEND:
            if not self.config.is_draft:
                raise ValueError("forward_mode: DRAFT_EXTEND needs a draft backend (MLAConfig.is_draft=True)")
            ext = _host_lens(batch.extend_seq_lens_cpu, "extend_seq_lens_cpu", bs)
            self._check_extend(seq_cpu, ext, [s - e for s, e in zip(seq_cpu, ext)])
        else:
            raise ValueError(f"forward_mode: unsupported mode {mode!r}")
        return ext

    def _mixed_extends(self, batch: ForwardBatch) -> int:
        """The extending requests of a MIXED batch (its first ones; the rest decode one token each)."""
        bs = batch.batch_size
        n_ext = self._num_extends_override if self._num_extends_override is not None else batch.num_extends
        if not 0 <= n_ext <= bs:
            raise ValueError(f"num_extends: expected 0..{bs}, got {n_ext}")
        return n_ext

    def _split_decodes(self, ext: list[int], seq_cpu: list[int], n_ext: int) -> int:
        """How many of a MIXED step's decodes (its last ``len(ext) - n_ext`` requests) run the decode kernel:
        all or none, by ``MLAConfig.mixed_decode_kernel`` ("auto": where ``decode_tail`` holds over
        ``auto_sms``, or where ``dequant_split`` does over an FP8 cache whose extends dequantise their pages first);
        none under decode context parallelism, whose plan covers the whole step."""
        n_dec = len(ext) - n_ext
        kernel = self.config.mixed_decode_kernel
        if not n_dec or kernel == "varlen" or self._dcp is not None:
            return 0
        if kernel == "decode":
            return n_dec
        if self._dequantises_first and dequant_split(seq_cpu, n_ext, self.heads):
            return n_dec
        return n_dec if decode_tail(ext, seq_cpu, n_ext, self.heads, auto_sms(self.device)) else 0

    def _plan_dcp_ragged(self, meta: ForwardMetadata) -> None:
        """Decode context parallelism: the per-row plan of an absorbed step with per-request query counts."""
        if self._dcp is not None:
            meta.dcp = self._dcp.plan_ragged(meta.seq_lens, meta.block_table, meta.qo_indptr, meta.num_tokens)

    def q_len(self, mode: ForwardMode) -> int:
        """Query tokens per request of a ``mode`` step that runs the same count for every request: the
        draft tokens of a uniform TARGET_VERIFY (``config.decode_q_len``), else 1. The engine's model and
        graph runners ask here (one definition). ValueError for a verify on a backend without drafts."""
        if mode == ForwardMode.TARGET_VERIFY:
            if self.config.decode_q_len < 2:
                raise ValueError("forward_mode: TARGET_VERIFY needs a target backend with num_draft_tokens >= 2 "
                                 f"(config has num_draft_tokens={self.config.num_draft_tokens}, "
                                 f"is_draft={self.config.is_draft})")
            return self.config.decode_q_len
        return 1

    def _check_step_tensors(self, req_pool_indices, seq_lens, block_table, rows: int | None, prefix: str) -> None:
        """A step's device tensors on the host (never their values): tensors of the right dtype, device and
        dimensions; ``rows`` real requests read from req_pool_indices and seq_lens (None: every entry of
        req_pool_indices, and seq_lens exactly as many); a block table with a row to read."""
        for name, t, dtypes, ndim in (("req_pool_indices", req_pool_indices, (torch.int32, torch.int64), 1),
                                      ("seq_lens", seq_lens, (torch.int32,), 1),
                                      ("block_table", block_table, (torch.int32,), 2)):
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
                raise ValueError(f"{prefix}{name}: expected a tensor of dtype {dtypes}, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.device != self.device:
                raise ValueError(f"{prefix}{name}: expected a tensor on {self.device}, got {t.device}")
            if t.dim() != ndim:
                raise ValueError(f"{prefix}{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
        n = req_pool_indices.shape[0] if rows is None else rows
        if req_pool_indices.shape[0] < n:
            raise ValueError(f"{prefix}req_pool_indices: expected at least {n} entries, got "
                             f"{req_pool_indices.shape[0]}")
        if seq_lens.shape[0] < n or (rows is None and seq_lens.shape[0] != n):
            raise ValueError(f"{prefix}seq_lens: expected {'at least ' if rows is not None else ''}{n} entries (one "
                             f"per request), got {seq_lens.shape[0]}")
        if n and block_table.shape[0] == 0:
            raise ValueError(f"{prefix}block_table: no rows for {n} requests to read")

    def _check_batch_values(self, batch: ForwardBatch, width: int, seq_cpu: list[int] | None, planned: bool) -> None:
        """``PAGEDMLA_VALIDATE=all``: the device values of the batch, read back (one synchronisation); with
        ``planned`` each device length must equal its host one in ``seq_cpu``."""
        idx = batch.req_pool_indices.to(torch.int64)
        lo, hi = (int(v) for v in torch.stack([idx.min(), idx.max()]).tolist())
        if lo < 0 or hi >= batch.block_table.shape[0]:
            raise ValueError(f"batch.req_pool_indices: request slots must lie in 0..{batch.block_table.shape[0] - 1}, "
                             f"got range {lo}..{hi}")
        lens = batch.seq_lens.to(torch.int64)
        lo, hi = (int(v) for v in torch.stack([lens.min(), lens.max()]).tolist())
        per_page = self.config.tokens_per_page
        if lo < 0 or hi > width * per_page:
            raise ValueError(f"batch.seq_lens: lengths must lie in 0..{width * per_page} "
                             f"({width} pages x {per_page}), got range {lo}..{hi}")
        if seq_cpu is not None:
            # The host lengths size the plan (the pages an FP8 workspace holds among them): a device length past
            # its host length would read beyond it. The MHA forms attend over the host lengths themselves: there
            # a shorter device length is as wrong.
            host = torch.as_tensor(seq_cpu, dtype=torch.int64, device=lens.device)
            wrong = lens != host if planned else lens > host
            if bool(wrong.any()):
                i = int(wrong.nonzero()[0])
                n = int(lens[i])
                raise ValueError(f"batch.seq_lens: request {i} has {n} tokens on the device, "
                                 f"{'more' if n > seq_cpu[i] else 'fewer'} than seq_lens_cpu's {seq_cpu[i]}")

    def _check_capacity(self, seq_cpu: list[int], max_pages: int) -> None:
        per_page = self.config.tokens_per_page
        capacity = max_pages * per_page
        for i, s in enumerate(seq_cpu):
            if s > capacity:
                raise ValueError(f"seq_lens_cpu: request {i} has {s} tokens, more than the block table's "
                                 f"{max_pages} pages x {per_page} = {capacity}")
            if s > self.config.max_context_len:
                raise ValueError(f"seq_lens_cpu: request {i} has {s} tokens > "
                                 f"max_context_len={self.config.max_context_len}")

    @staticmethod
    def _check_extend(seq_cpu: list[int], ext: list[int], pre: list[int]) -> None:
        for i, (s, e, p) in enumerate(zip(seq_cpu, ext, pre)):
            if p < 0:
                raise ValueError(f"extend_seq_lens_cpu: request {i} has {e} new tokens but seq_lens_cpu says only {s}")
            if e + p != s:
                raise ValueError(f"extend_seq_lens_cpu/extend_prefix_lens_cpu: request {i} has {p} cached + {e} new "
                                 f"tokens but seq_lens_cpu says {s}")

    def _extend_form(self, ext: list[int], pre: list[int]) -> str:
        if not any(pre):
            return "absorbed" if self.config.disable_ragged else "mha"
        mode = self.config.extend_prefix_mode
        if mode != "auto":
            return mode
        extending = [e for e in ext if e > 0] or [0]
        return "chunked" if sum(extending) / len(extending) >= self.config.chunked_prefix_min_extend else "absorbed"

    def _plan_varlen(self, meta: ForwardMetadata, ext: list[int], seq_cpu: list[int]) -> None:
        """qo_indptr of the step's query counts; in the same host-to-device copy, for the MHA forms the host
        lengths (``planned_lens``), for an absorbed step over an FP8 cache the pages each request's host length
        spans (``kv_page_indptr``: the dequantised workspace then holds those pages, not batch x the longest
        request's)."""
        indptr = [0]
        for e in ext:
            indptr.append(indptr[-1] + e)
        meta.max_q_len = max(ext) if ext else 0
        meta.num_tokens = indptr[-1]
        if meta.form != "absorbed":
            packed = to_device(indptr + seq_cpu, torch.int32, self.device)
            meta.qo_indptr, meta.planned_lens = packed[: len(indptr)], packed[len(indptr):]
            return
        if self.config.kv_format is None or self._dcp is not None:
            meta.qo_indptr = to_device(indptr, torch.int32, self.device)
            return
        pages = [0]
        for s in seq_cpu:
            pages.append(pages[-1] + -(-s // self.config.page_size))
        packed = to_device(indptr + pages, torch.int32, self.device)
        meta.qo_indptr, meta.kv_page_indptr = packed[: len(indptr)], packed[len(indptr):]
        meta.num_kv_pages = pages[-1]

    def _plan_prefix_chunks(self, block_table: torch.Tensor, pre: list[int]) -> list[PrefixChunk]:
        """Chunk lists of the cached prefixes: ``capacity // num_extends`` tokens per request per loop."""
        n = len(pre)
        chunk_len = max(1, self.config.chunked_prefix_capacity // max(1, n))
        loops = -(-max(pre) // chunk_len)
        ps = self.config.page_size
        rows = torch.arange(n, device=self.device)
        chunks = []
        for i in range(loops):
            starts = [min(p, i * chunk_len) for p in pre]
            lens = [min(p, (i + 1) * chunk_len) - s for p, s in zip(pre, starts)]
            total = sum(lens)
            cu = [0]
            for length in lens:
                cu.append(cu[-1] + length)
            if self._dcp is not None:
                slots, index = self._dcp.prefix_chunk(block_table, starts, lens)
                chunks.append(PrefixChunk(slots=slots, cu_seqlens=to_device(cu, torch.int32, self.device),
                                          max_len=max(lens), gather_index=index))
                continue
            # One host-to-device copy per loop: [cu (n + 1) | lens (n) | starts (n)].
            packed = to_device(cu + lens + starts, torch.int64, self.device)
            cu_dev, lens_dev, starts_dev = packed[: n + 1], packed[n + 1: 2 * n + 1], packed[2 * n + 1:]
            req = torch.repeat_interleave(rows, lens_dev, output_size=total)
            pos = torch.arange(total, device=self.device) - cu_dev[:-1][req] + starts_dev[req]
            pages = block_table[req, pos // ps].to(torch.int64)
            chunks.append(PrefixChunk(slots=pages * ps + pos % ps, cu_seqlens=cu_dev.to(torch.int32),
                                      max_len=max(lens)))
        return chunks

    @contextlib.contextmanager
    def override_num_extends(self, n: int) -> Iterator[None]:
        """Within the block, MIXED planning treats the first ``n`` requests as extends (used by a drafter
        that re-plans the same batch between its steps with a different split)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        previous = self._num_extends_override
        self._num_extends_override = n
        try:
            yield
        finally:
            self._num_extends_override = previous

    # ------------------------------------------------------------------ running
    def _meta(self) -> ForwardMetadata:
        if self.metadata is None:
            raise RuntimeError("call init_forward_metadata(batch) before forward")
        return self.metadata

    def _check_q(self, q: torch.Tensor, tokens: int, width: int, name: str = "q",
                 dtype: torch.dtype | None = None, source: str = "q's") -> None:
        """q (or k, v) [tokens, local heads, width] of a floating dtype; ``dtype`` if given, ``source``'s (the
        kernels take their operands in one dtype)."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(q).__name__}")
        expected = (tokens, self.heads, width)
        if tuple(q.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} (tokens, local heads, head dim), got {tuple(q.shape)}")
        if q.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"{name}: expected a floating dtype, got {q.dtype}")
        if dtype is not None and q.dtype != dtype:
            raise ValueError(f"{name}: dtype {q.dtype} differs from {source} {dtype}")

    def _check_cache(self, cache: MLAKVCache, layer) -> None:
        """The cache a forward reads and writes (an ``MLAKVCache`` or a view with its ``page_size``, ``kv_dim``,
        ``layer`` and ``paged_view``, as the SGLang adapter's) against the config, through the forward's own
        ``layer`` (a pipeline stage's cache holds only its layers): checked once per cache object (its geometry
        cannot change), remembered weakly (the backend must not keep a dropped cache's memory)."""
        if self._checked_cache is not None and self._checked_cache() is cache:
            return
        page_size, kv_dim = getattr(cache, "page_size", None), getattr(cache, "kv_dim", None)
        if page_size is None or kv_dim is None or not callable(getattr(cache, "paged_view", None)):
            raise TypeError(f"cache: expected an MLAKVCache (or a view with page_size, kv_dim, layer and paged_view), "
                            f"got {type(cache).__name__}")
        buffer = cache.layer(_layer_id(layer))
        want = (self.config.page_size, self.kv_dim, self.device)
        got = (page_size, kv_dim, buffer.device)
        if got != want:
            raise ValueError(f"cache: (page_size, kv_dim, device) {got} differ from the backend's {want}")
        self._checked_cache = weakref.ref(cache)
        # The dtype absorbed queries must have: a 16-bit (or float) cache's; any over FP8 rows, which the kernels
        # convert to the queries' dtype.
        self._cache_dtype = None if cache.kv_format is not None else buffer.dtype

    def save_kv(self, latent: torch.Tensor, layer, out_cache_loc: torch.Tensor, cache: MLAKVCache) -> None:
        """Write this step's latent rows ([T, 576] or [T, 1, 576]) at ``out_cache_loc`` (a slot outside the
        cache is dropped and reported, ``pagedmla.errors``)."""
        if self._host_checks:
            self._host_check(lambda: cache.write(_layer_id(layer), out_cache_loc, latent, validate=True))
            return
        # The checks of MLAKVCache.write that the step's shapes do not already settle, then its unchecked store.
        if not isinstance(latent, torch.Tensor) or not latent.is_floating_point() or latent.dim() not in (2, 3) \
                or latent.shape[-1] != self.kv_dim or (latent.dim() == 3 and latent.shape[1] != 1):
            raise ValueError(f"latent: expected [T, {self.kv_dim}] or [T, 1, {self.kv_dim}] rows, got "
                             f"{getattr(latent, 'shape', type(latent).__name__)}")
        if not isinstance(out_cache_loc, torch.Tensor) or out_cache_loc.dtype != torch.int64 \
                or out_cache_loc.shape != latent.shape[:1] or out_cache_loc.device != cache.device:
            raise ValueError(f"out_cache_loc: expected int64 [{latent.shape[0]}] slots on {cache.device}, got "
                             f"{getattr(out_cache_loc, 'dtype', type(out_cache_loc).__name__)} "
                             f"{tuple(getattr(out_cache_loc, 'shape', ()))}")
        cache.store(_layer_id(layer), out_cache_loc, latent.reshape(latent.shape[0], self.kv_dim))

    def _check_pages(self, meta: ForwardMetadata, cache: MLAKVCache) -> None:
        """``PAGEDMLA_VALIDATE=all``: the step's page ids against this cache, read back (under decode context
        parallelism the rank's own rows where the step has a per-rank plan, else the step's rows, whose pages
        hold ``tokens_per_page`` tokens)."""
        if self._host_checks and errors.host_value_checks(self.device):  # never inside a graph capture
            if meta.dcp is not None:
                table, lens, per_page = meta.dcp.block_table, meta.dcp.seq_lens, cache.page_size
            else:
                table, lens, per_page = meta.block_table, meta.seq_lens, self.config.tokens_per_page
            self._host_check(lambda: checks.paged_values(table, lens, cache.num_pages, per_page))

    def _host_check(self, check: Callable[[], None]) -> None:
        """Run one ``PAGEDMLA_VALIDATE=all`` check. Under decode context parallelism every rank of the group
        learns whether any rank's failed (one all-reduce; this mode synchronises anyway) and raises too, so
        that none waits in the attention's collectives for a rank that raised (a rank's own slots and pages
        can be bad where the others' are not)."""
        if self._dcp is None:
            check()
            return
        if not errors.host_value_checks(self.device):  # inside a graph capture, on every rank alike: no read-back
            return
        error = None
        try:
            check()
        except Exception as e:  # noqa: BLE001 - any rank's failure must reach the others before it propagates
            error = e
        failed = self._dcp.group.all_reduce_(torch.tensor([error is not None], dtype=torch.int32, device=self.device))
        if error is not None:
            raise error
        if int(failed.item()):
            raise ValueError("dcp_group: a PAGEDMLA_VALIDATE=all check failed on another rank of the group for this "
                             "step (that rank's ValueError names the argument)")

    def forward(self, q, k, v, layer, out_cache_loc, cache: MLAKVCache, *, save_kv_cache: bool = True, **kwargs):
        """Route to forward_decode or forward_extend by the planned mode."""
        meta = self._meta()
        if self._decode_step(meta):
            return self.forward_decode(q, k, v, layer, out_cache_loc, cache, meta.bs, save_kv_cache=save_kv_cache)
        return self.forward_extend(q, k, v, layer, out_cache_loc, cache, save_kv_cache=save_kv_cache, **kwargs)

    @staticmethod
    def _decode_step(meta: ForwardMetadata) -> bool:
        """Whether ``forward_decode`` runs the planned step: a uniform one, or a ragged verify / draft extend."""
        return meta.uniform or meta.mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    def forward_decode(self, q, k, v, layer, out_cache_loc, cache: MLAKVCache, bs: int, *,
                       save_kv_cache: bool = True):
        """Absorbed attention of a decode-like step: q_len tokens per request (1; the draft tokens when
        verifying; a captured graph's rows), or per-request token counts (a ragged verify, DRAFT_EXTEND).

        q: [T, H, 576]; k: the new latent rows [T, 1, 576] (or [T, 576]); v: unused (pass None: values
        are the latent rows' first 512 columns). Returns [T, H * 512].
        """
        self._check_cache(cache, layer)
        if torch.compiler.is_dynamo_compiling():
            return self._traced_decode(q, k, v, layer, out_cache_loc, cache, bs, save_kv_cache)
        meta = self._meta()
        if meta.bs == 0:
            return q.new_empty(0, self.heads * self.v_dim)
        if not self._decode_step(meta):
            raise RuntimeError(f"forward_decode: the planned step is {meta.mode.value}, not a decode step")
        if bs != meta.bs:
            raise ValueError(f"bs: the planned batch has {meta.bs} requests, got {bs}")
        if not meta.uniform:
            return self.forward_extend(q, k, v, layer, out_cache_loc, cache, save_kv_cache=save_kv_cache)
        self._check_q(q, meta.num_tokens, self.kv_dim, dtype=self._cache_dtype, source="the cache's")
        lid = _layer_id(layer)
        if save_kv_cache:
            self.save_kv(k, lid, out_cache_loc, cache)
        self._check_pages(meta, cache)
        if meta.dcp is not None:
            return self._dcp.attend(q, cache.paged_view(lid), meta.dcp, cache.kv_format, cache.k_scale(lid))
        out, _ = self._decode_impl(q.view(bs, meta.q_len, self.heads, self.kv_dim), cache.paged_view(lid),
                                   meta.block_table, meta.seq_lens, self.v_dim, meta.tile_scheduler_metadata,
                                   meta.num_splits, self.scale, True, kv_format=cache.kv_format,
                                   k_scale=cache.k_scale(lid))
        return out.reshape(meta.num_tokens, self.heads * self.v_dim)

    def forward_extend(self, q, k, v, layer, out_cache_loc, cache: MLAKVCache, *, save_kv_cache: bool = True,
                       latent: torch.Tensor | None = None,
                       kv_decompress: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Prefill (and MIXED / DRAFT_EXTEND) attention in the planned form.

        "absorbed": q [T, H, 576], k = new latent rows [T, 1, 576]; returns [T, H * 512].
        "mha" / "chunked": q [T, H, 192], k [T, H, 192], v [T, H, 128] (MHA form of the new tokens),
        ``latent`` [T, 576] the rows to store; "chunked" also needs ``kv_decompress(rows [n, 576]) ->
        (k [n, H, 192], v [n, H, 128])`` for the prefix chunks. Returns [T, H * 128].
        """
        self._check_cache(cache, layer)
        if torch.compiler.is_dynamo_compiling():
            return self._traced_extend(q, k, v, layer, out_cache_loc, cache, save_kv_cache, latent, kv_decompress)
        meta = self._meta()
        if meta.bs == 0:
            # IDLE and empty batches are planned in the absorbed form: no tokens, no cache writes.
            return q.new_empty(0, self.heads * self.v_dim)
        if meta.uniform:
            raise RuntimeError(f"forward_extend: the planned step is a uniform {meta.mode.value} step, not an "
                               "extend step")
        lid = _layer_id(layer)
        if meta.form == "absorbed":
            self._check_q(q, meta.num_tokens, self.kv_dim, dtype=self._cache_dtype, source="the cache's")
            if save_kv_cache:
                self.save_kv(k, lid, out_cache_loc, cache)
            self._check_pages(meta, cache)
            if meta.dcp is not None:
                return self._dcp.attend(q, cache.paged_view(lid), meta.dcp, cache.kv_format, cache.k_scale(lid))
            view, fmt, scale = cache.paged_view(lid), cache.kv_format, cache.k_scale(lid)

            def varlen(q_ext, block_table, seq_lens):
                return self._varlen_paged_impl(q_ext, view, block_table, seq_lens, meta.qo_indptr, self.v_dim,
                                               self.scale, True, meta.max_q_len, kv_format=fmt, k_scale=scale,
                                               kv_page_indptr=meta.kv_page_indptr, num_kv_pages=meta.num_kv_pages)[0]

            def decode(q_dec, block_table, seq_lens, schedule):
                return self._decode_impl(q_dec, view, block_table, seq_lens, self.v_dim, *schedule, self.scale,
                                         True, kv_format=fmt, k_scale=scale)[0]

            return self._absorbed_ragged(q, meta, varlen, decode)
        self._check_q(q, meta.num_tokens, self.config.qk_head_dim)
        self._check_q(k, meta.num_tokens, self.config.qk_head_dim, "k", q.dtype)
        self._check_q(v, meta.num_tokens, self.config.v_head_dim, "v", q.dtype)
        if save_kv_cache:
            if latent is None:
                raise ValueError("latent: the MHA forms need the latent rows to store")
            self.save_kv(latent, lid, out_cache_loc, cache)
        out, lse = self.forward_extend_chunked(q, k, v, self.scale, cum_seq_lens_q=meta.qo_indptr,
                                               cum_seq_lens_kv=meta.qo_indptr, max_q_len=meta.max_q_len,
                                               max_kv_len=meta.max_q_len, causal=True)
        if meta.form == "chunked":
            if kv_decompress is None:
                raise ValueError("kv_decompress: the chunked-prefix form needs it to expand prefix rows")
            self._check_pages(meta, cache)
            for chunk in meta.prefix_chunks:
                # A bad page id gives a slot outside the cache: NaN rows, so the request's output is NaN. FP8 rows
                # are dequantised to the queries' dtype as gathered (only the chunk's).
                rows = cache.gather(lid, chunk.slots, validate=False, dtype=q.dtype)
                if chunk.gather_index is not None:
                    rows = self._dcp.gather_rows(rows, chunk.gather_index)
                kc, vc = kv_decompress(rows)
                self._check_q(kc, rows.shape[0], self.config.qk_head_dim, "kv_decompress(rows)[0]", q.dtype)
                self._check_q(vc, rows.shape[0], self.config.v_head_dim, "kv_decompress(rows)[1]", q.dtype)
                o2, l2 = self.forward_extend_chunked(q, kc, vc, self.scale, cum_seq_lens_q=meta.qo_indptr,
                                                     cum_seq_lens_kv=chunk.cu_seqlens, max_q_len=meta.max_q_len,
                                                     max_kv_len=chunk.max_len, causal=False)
                out, lse = self._merge_impl(out, lse, o2, l2, out, lse)
        out = out.reshape(meta.num_tokens, -1)
        # The MHA forms attend over the host's lengths: a device length that is negative, beyond the table or
        # other than the host's gets its request NaN rows here. A launch of its own: the ragged kernel is the
        # public flash_attn_varlen_func (portable and Hopper kernels), which knows sequences by cu_seqlens
        # alone, the store runs before the attention, and the "mha" form merges nothing. Its programs of good
        # requests leave after two loads.
        poison_bad_lengths(out, *self._length_guard_args(meta))
        return out

    def _length_guard_args(self, meta: ForwardMetadata) -> tuple:
        """``poison_bad_lengths``' arguments after the output, eager and traced alike: the step's query
        indptr, device and planned lengths, the block table's capacity in tokens and the longest query."""
        return (meta.qo_indptr, meta.seq_lens, meta.planned_lens,
                meta.block_table.shape[1] * self.config.tokens_per_page, meta.max_q_len)

    def _absorbed_ragged(self, q: torch.Tensor, meta: ForwardMetadata, varlen: Callable,
                         decode: Callable) -> torch.Tensor:
        """Absorbed attention of a ragged step, [T, H * 512]: ``varlen(q, block_table, seq_lens)`` (the varlen
        kernel over ``meta.qo_indptr``) over the requests it covers and, for a MIXED step's split decodes,
        ``decode(q [n, 1, H, 576], block_table, seq_lens, schedule)`` over the last ``meta.split_decodes``."""
        n_dec = meta.split_decodes
        if not n_dec:
            return varlen(q, meta.block_table, meta.seq_lens).reshape(meta.num_tokens, self.heads * self.v_dim)
        n_ext, t_ext = meta.bs - n_dec, meta.num_tokens - n_dec
        table, lens, *schedule = meta.decode_plan
        out = decode(q[t_ext:].reshape(n_dec, 1, self.heads, self.kv_dim), table, lens,
                     schedule).reshape(n_dec, self.heads * self.v_dim)
        if not n_ext:
            return out
        ext = varlen(q[:t_ext], meta.block_table[:n_ext], meta.seq_lens[:n_ext])
        return torch.cat((ext.reshape(t_ext, self.heads * self.v_dim), out))

    def forward_extend_chunked(self, q, k, v, scaling: float, *, cum_seq_lens_q: torch.Tensor,
                               cum_seq_lens_kv: torch.Tensor, max_q_len: int, max_kv_len: int, causal: bool,
                               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MHA piece of a long-prefix prefill: ragged attention of q over (k, v).

        q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128]; cum_seq_lens_q/kv int32 [n + 1]. Returns
        (out [Tq, H, 128], lse [Tq, H] float32, natural log) for folding with merge_state.
        """
        return self._varlen_impl(q, k, v, cum_seq_lens_q, cum_seq_lens_kv, max_q_len, max_kv_len, scaling,
                                 causal, out)

    # ------------------------------------------------------------------ traced forms (torch.compile)
    # One planned step expressed with the pagedmla:: custom ops (ops/library.py), for Dynamo: the eager paths
    # above call the kernels through the memoised entry points, which Dynamo cannot trace.
    def _traced_meta(self, cache: MLAKVCache) -> ForwardMetadata:
        """The planned step, for a traced forward over ``cache`` (NotImplementedError for what tracing lacks)."""
        meta = self._meta()
        if meta.dcp is not None:
            raise NotImplementedError("torch.compile: decode context parallelism (MLAConfig.dcp_size > 1) runs "
                                      "eagerly or as CUDA graphs, not traced")
        if cache.kv_format is not None:
            raise NotImplementedError(f"torch.compile: FP8 caches ({cache.kv_format}) run eagerly or as CUDA graphs, "
                                      "not traced")
        return meta

    def _traced_provider(self, op: str) -> str | None:
        return self.provider if self.provider in available_providers(op) else None

    def _traced_save(self, rows: torch.Tensor, layer, out_cache_loc, cache: MLAKVCache, save_kv_cache: bool) -> None:
        # The backend's own slots, unchecked as in MLAKVCache.write(validate=False).
        if save_kv_cache:
            library.cache_write(cache.layer(_layer_id(layer)), out_cache_loc, rows.reshape(rows.shape[0], -1))

    def _traced_decode(self, q, k, v, layer, out_cache_loc, cache: MLAKVCache, bs: int, save_kv_cache: bool):
        """``forward_decode`` while Dynamo traces (DECODE / TARGET_VERIFY; DRAFT_EXTEND and a ragged verify go
        through ``_traced_extend``, the varlen kernel)."""
        meta = self._traced_meta(cache)
        if meta.bs == 0:
            return q.new_empty(0, self.heads * self.v_dim)
        if meta.mode == ForwardMode.DRAFT_EXTEND or not meta.uniform:
            return self._traced_extend(q, k, v, layer, out_cache_loc, cache, save_kv_cache, None, None)
        self._traced_save(k, layer, out_cache_loc, cache, save_kv_cache)
        out, _ = library.flash_mla_with_kvcache(q.view(bs, meta.q_len, self.heads, self.kv_dim),
                                                cache.paged_view(_layer_id(layer)), meta.block_table, meta.seq_lens,
                                                self.v_dim, meta.tile_scheduler_metadata, meta.num_splits, self.scale,
                                                True, self.provider)
        return out.reshape(meta.num_tokens, self.heads * self.v_dim)

    def _traced_extend(self, q, k, v, layer, out_cache_loc, cache: MLAKVCache, save_kv_cache: bool,
                       latent: torch.Tensor | None, kv_decompress):
        """``forward_extend`` while Dynamo traces (absorbed, MHA and chunked-prefix forms)."""
        meta = self._traced_meta(cache)
        if meta.bs == 0:
            return q.new_empty(0, self.heads * self.v_dim)
        lid = _layer_id(layer)
        if meta.form == "absorbed":
            self._traced_save(k, layer, out_cache_loc, cache, save_kv_cache)
            view = cache.paged_view(lid)

            def varlen(q_ext, block_table, seq_lens):
                return library.flash_mla_varlen_with_kvcache(q_ext, view, block_table, seq_lens, meta.qo_indptr,
                                                             self.v_dim, self.scale, True, meta.max_q_len,
                                                             self._traced_provider("paged_varlen"))[0]

            def decode(q_dec, block_table, seq_lens, schedule):
                return library.flash_mla_with_kvcache(q_dec, view, block_table, seq_lens, self.v_dim, *schedule,
                                                      self.scale, True, self.provider)[0]

            return self._absorbed_ragged(q, meta, varlen, decode)
        if save_kv_cache and latent is None:
            raise ValueError("latent: the MHA forms need the latent rows to store")
        self._traced_save(latent, layer, out_cache_loc, cache, save_kv_cache)
        varlen_provider = self._traced_provider("varlen")
        out, lse_ht = library.varlen_attention(q, k, v, meta.qo_indptr, meta.qo_indptr, meta.max_q_len,
                                               meta.max_q_len, self.scale, True, varlen_provider)
        lse = lse_ht.transpose(0, 1)
        if meta.form == "chunked":
            if kv_decompress is None:
                raise ValueError("kv_decompress: the chunked-prefix form needs it to expand prefix rows")
            merge_provider = self._traced_provider("merge")
            for chunk in meta.prefix_chunks:
                kc, vc = kv_decompress(library.cache_gather(cache.layer(lid), chunk.slots))
                o2, l2 = library.varlen_attention(q, kc, vc, meta.qo_indptr, chunk.cu_seqlens, meta.max_q_len,
                                                  chunk.max_len, self.scale, False, varlen_provider)
                out, lse = merge_state(out, lse, o2, l2.transpose(0, 1), provider=merge_provider)
        out = out.reshape(meta.num_tokens, -1)
        library.poison_bad_lengths(out, *self._length_guard_args(meta))
        return out

    # ------------------------------------------------------------------ CUDA graphs
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len of padded rows in a captured batch (their block-table rows point at page 0)."""
        return 1

    def init_cuda_graph_state(self, max_bs: int, *, max_pages_per_request: int | None = None) -> None:
        """Allocate, once, every buffer decode / verify graphs read; replays only copy into them.

        ``max_pages_per_request`` is keyword-only: SGLang's ``init_cuda_graph_state(max_bs, max_num_tokens)``
        passed positionally would otherwise be read as a page count (``pagedmla.sglang`` adapts that call)."""
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or not 0 < max_bs <= self.config.max_batch_size:
            raise ValueError(f"max_bs: expected an int in 1..{self.config.max_batch_size}, got {max_bs!r}")
        if max_pages_per_request is not None and (isinstance(max_pages_per_request, bool)
                                                  or not isinstance(max_pages_per_request, int)
                                                  or max_pages_per_request < 1):
            raise ValueError(f"max_pages_per_request: expected None or a positive int, got {max_pages_per_request!r}")
        pages = max_pages_per_request or self.config.max_pages_per_request
        parts = max(num_sm_parts_for(self.device, q * self.heads, 1, self.config.kv_format)
                    for q in self._graph_q_lens())
        errors.error_word(self.device)  # before any capture: created inside one, its zeroing would be captured
        self._graph = _GraphState(
            max_bs=max_bs,
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(max_bs, pages, dtype=torch.int32, device=self.device),
            tile_scheduler_metadata=torch.zeros(parts, 8, dtype=torch.int32, device=self.device),
            num_splits=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
        )
        if self._dcp is not None:
            self._dcp.init_graph_state(max_bs * max(self._graph_q_lens()), pages)

    def _graph_q_lens(self) -> set[int]:
        """The rows per request of the graphs this backend can capture."""
        lens = {1, self.config.decode_q_len}
        if self.config.is_draft:
            lens.add(self.config.num_draft_tokens)
        return lens

    def _graph_q_len(self, mode: ForwardMode) -> int:
        """Rows per request of a captured ``mode`` step (ValueError for a mode graphs do not capture)."""
        if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
            return 1
        if mode == ForwardMode.TARGET_VERIFY:
            return self.q_len(mode)
        if mode == ForwardMode.DRAFT_EXTEND:
            if not self.config.is_draft:
                raise ValueError("forward_mode: DRAFT_EXTEND needs a draft backend (MLAConfig.is_draft=True)")
            return self.config.num_draft_tokens
        raise ValueError(f"forward_mode: CUDA graphs capture DECODE, TARGET_VERIFY, DRAFT_EXTEND and IDLE steps, "
                         f"got {mode}")

    def _graph_state(self) -> _GraphState:
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        return self._graph

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, forward_mode: ForwardMode) -> None:
        """Plan a step of ``bs`` requests over the graph buffers (called before capture): DECODE, TARGET_VERIFY
        (num_draft_tokens rows per request), DRAFT_EXTEND on a draft backend (num_draft_tokens rows per
        request, the real tokens last) or IDLE (``bs`` padding rows); see the module docstring."""
        g = self._graph_state()
        q_len = self._graph_q_len(forward_mode)
        if not 0 < bs <= g.max_bs:
            raise ValueError(f"bs: expected 1..{g.max_bs} (the graph state's max_bs), got {bs}")
        g.seq_lens[:bs].copy_(seq_lens[:bs])
        if self._dcp is not None:
            g.captured[(bs, forward_mode)] = 0
            self.metadata = self._graph_dcp_metadata(g, bs, forward_mode, q_len)
            return
        parts = num_sm_parts_for(self.device, q_len * self.heads, 1, self.config.kv_format)
        md = g.tile_scheduler_metadata[:parts]
        schedule_into(g.seq_lens[:bs], md, g.num_splits[: bs + 1], q_len * self.heads, default_plan=True)
        g.captured[(bs, forward_mode)] = parts
        self.metadata = ForwardMetadata(mode=forward_mode, bs=bs, form="absorbed", seq_lens=g.seq_lens[:bs],
                                        block_table=g.block_table[:bs], q_len=q_len, tile_scheduler_metadata=md,
                                        num_splits=g.num_splits[: bs + 1], num_tokens=bs * q_len, max_q_len=q_len)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, forward_mode: ForwardMode, *,
                                                block_table: torch.Tensor, raw_bs: int | None = None) -> None:
        """Refill the graph buffers for a replay of the ``bs``-row graph: no host synchronisation and no new
        buffers (on CUDA the schedule kernel writes straight into them).
        The first ``raw_bs`` rows are real (``seq_lens`` / ``req_pool_indices`` may
        hold just those); the rest are padding (seq_len 1, block-table row of page 0). An IDLE step has no
        real rows (``raw_bs`` None or 0)."""
        g = self._graph_state()
        key = (bs, forward_mode)
        if key not in g.captured:
            raise ValueError(f"bs/forward_mode: no graph was captured for {key}")
        if forward_mode == ForwardMode.IDLE:
            if raw_bs not in (None, 0):
                raise ValueError(f"raw_bs: an IDLE step has no real requests, got {raw_bs}")
            raw_bs = 0
        raw = bs if raw_bs is None else raw_bs
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= bs:
            raise ValueError(f"raw_bs: expected an int in 0..{bs}, got {raw_bs!r}")
        self._check_step_tensors(req_pool_indices, seq_lens, block_table, raw, "")
        if block_table.shape[1] > g.block_table.shape[1]:
            # Lengths are not read back during a replay, so a wider table could not be checked to fit.
            raise ValueError(f"block_table: {block_table.shape[1]} columns exceed the graph buffers' "
                             f"{g.block_table.shape[1]} (init_cuda_graph_state's max_pages_per_request)")
        if raw:
            # The buffers' columns past the engine's table are page 0: a length beyond the engine's row becomes
            # one beyond the buffers' (NaN rows and LENGTH_BEYOND_TABLE, as eagerly), not one over page 0.
            select_requests(block_table, req_pool_indices[:raw], seq_lens[:raw], g.block_table[:raw],
                            g.seq_lens[:raw], self.config.tokens_per_page)
        g.block_table[raw:bs].zero_()
        g.seq_lens[raw:bs].fill_(self.get_cuda_graph_seq_len_fill_value())
        q_len = self._graph_q_len(forward_mode)
        if self._dcp is not None:
            self.metadata = self._graph_dcp_metadata(g, bs, forward_mode, q_len)
            return
        schedule_into(g.seq_lens[:bs], g.tile_scheduler_metadata[: g.captured[key]], g.num_splits[: bs + 1],
                      q_len * self.heads, default_plan=True)
        self.metadata = ForwardMetadata(mode=forward_mode, bs=bs, form="absorbed", seq_lens=g.seq_lens[:bs],
                                        block_table=g.block_table[:bs], q_len=q_len,
                                        tile_scheduler_metadata=g.tile_scheduler_metadata[: g.captured[key]],
                                        num_splits=g.num_splits[: bs + 1], num_tokens=bs * q_len, max_q_len=q_len)

    def _graph_dcp_metadata(self, g: _GraphState, bs: int, mode: ForwardMode, q_len: int) -> ForwardMetadata:
        """Decode context parallelism: the graph step's per-row plan, written into the DCP graph buffers."""
        return ForwardMetadata(mode=mode, bs=bs, form="absorbed", seq_lens=g.seq_lens[:bs],
                               block_table=g.block_table[:bs], q_len=q_len, num_tokens=bs * q_len, max_q_len=q_len,
                               dcp=self._dcp.plan_uniform_into_graph(g.seq_lens[:bs], g.block_table[:bs], q_len))


_BACKENDS: dict[str, type[MLABackend]] = {"pagedmla": MLABackend}


def register_backend(name: str, cls: type[MLABackend]) -> None:
    """Make ``cls`` creatable by ``create_backend(name, ...)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, MLABackend)):
        raise TypeError(f"cls: expected an MLABackend subclass, got {cls!r}")
    _BACKENDS[name] = cls


def create_backend(name: str, config: MLAConfig, **kwargs) -> MLABackend:
    """Instantiate the backend registered as ``name`` (see ``available_backends()``)."""
    if name not in _BACKENDS:
        raise ValueError(f"name: unknown backend {name!r}; available: {available_backends()}")
    return _BACKENDS[name](config, **kwargs)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)
