"""FlashInfer's MLA paged wrapper and ragged prefill wrapper on pagedmla's kernels.

Follows flashinfer-ai/flashinfer's ``flashinfer/mla/_core.py`` (``BatchMLAPagedAttentionWrapper``) and
``flashinfer/prefill.py`` (``BatchPrefillWithRaggedKVCacheWrapper``) as of commit fb28d7242 (2026-08):
constructor, ``plan`` and ``run`` argument names and order, FlashInfer's plan/run split (``plan`` does all
host work and builds every device index once; ``run`` only launches, so a planned batch can be run for
every layer and replayed in a CUDA graph), and FlashInfer's LSE convention: ``[total_q, num_heads]``
float32 in **base 2** unless ``run(..., return_lse_base_on_e=True)`` (MLA wrapper) asks for the natural
log. pagedmla's native ops return natural-log LSE; the wrappers convert. A row that sees no key returns
output 0 and LSE -inf.

``backend`` may be ``"auto"``, ``"fa2"`` or ``"fa3"``: they name FlashInfer's kernels, all run pagedmla's
(provider chosen as for every pagedmla op). FlashInfer features pagedmla lacks raise ``ValueError``
naming the argument: FP8 caches and scales, custom masks, sliding windows, logit soft-capping, RoPE
inside the kernel, the cutlass backend's ``kv_len`` / ``page_table`` inputs, the profiler buffer.

Latent cache: pagedmla keeps one ``[num_pages, page_size, 1, 576]`` row per token. When ``ckv_cache``
``[num_pages, page_size, 512]`` and ``kpe_cache`` ``[num_pages, page_size, 64]`` are the two column blocks
of one such buffer (``buf[..., :512]`` and ``buf[..., 512:]``: same strides, kpe starting right after
ckv), ``run`` passes that buffer to the kernels without copying; so for ``q_nope`` / ``q_pe``. Separate
buffers work too, at the cost of concatenating them (a copy of the whole cache) on every ``run``.
"""

from __future__ import annotations

import math

import torch

from pagedmla.ops import attention, schedule

LOG2_E = math.log2(math.e)
_BACKENDS = ("auto", "fa2", "fa3")


def _check_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: {backend!r} is not available in pagedmla.flashinfer (expected one of {_BACKENDS})")
    return backend


def _unsupported(name: str, value, ok: bool) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} is not supported by pagedmla.flashinfer (pass the default)")


def _host_int32(t: torch.Tensor, name: str, size: int | None = None, at_least: bool = False) -> torch.Tensor:
    """Host copy of an int32 1-D index tensor; ``size`` entries, or at least ``size`` with ``at_least``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
        raise ValueError(f"{name}: expected an int32 1-D tensor, got {getattr(t, 'dtype', type(t).__name__)} "
                         f"{tuple(getattr(t, 'shape', ()))}")
    if size is not None and (t.shape[0] < size if at_least else t.shape[0] != size):
        raise ValueError(f"{name}: expected {'at least ' if at_least else ''}{size} entries, got {t.shape[0]}")
    return t.to("cpu")


def _joined(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> torch.Tensor:
    """The tensor whose last dim holds a's then b's columns: the base a and b are views of when they are
    its two column blocks (same shape but the last dim, same strides, b right after a), else a copy."""
    for name, t in ((name_a, a), (name_b, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"{name_b}: leading dims {tuple(b.shape[:-1])} differ from {name_a}'s {tuple(a.shape[:-1])}")
    if b.shape[-1] == 0:
        return a
    width = a.shape[-1] + b.shape[-1]
    views = (a.stride() == b.stride() and a.stride(-1) == 1 and a.dtype == b.dtype and a.device == b.device
             and b.data_ptr() == a.data_ptr() + a.shape[-1] * a.element_size()
             and all(s >= width or n == 1 for s, n in zip(a.stride()[:-1], a.shape[:-1])))
    if views:
        return a.as_strided((*a.shape[:-1], width), a.stride())
    return torch.cat([a, b], dim=-1)


class BatchMLAPagedAttentionWrapper:
    """FlashInfer's MLA paged attention (decode, and prefill / verify over a paged latent cache).

    ``plan`` turns FlashInfer's page lists (``kv_indptr`` / ``kv_indices``) into pagedmla's block table and,
    when every request has the same number of queries, a split-KV decode schedule; other batches run the
    variable-length paged kernel. With ``use_cuda_graph=True`` every planned tensor lives in buffers
    allocated by the first ``plan`` and overwritten by later ones (batch size and the block table width of
    the first plan are kept: a later plan that needs more raises ValueError), so captured runs stay valid.
    The constructor's ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``kv_len_arr`` buffers are accepted
    for FlashInfer compatibility; pagedmla keeps its own.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer: expected a torch.Tensor (its device is the wrapper's)")
        self.device = float_workspace_buffer.device
        self._backend = _check_backend(backend)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._planned = False
        self._graph_buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself, or (CUDA-graph mode) copied into the buffer first planned under ``name``."""
        if not self._use_cuda_graph:
            return value
        buf = self._graph_buffers.get(name)
        if buf is None:
            self._graph_buffers[name] = value
            return value
        if buf.dim() != value.dim() or any(v > s for v, s in zip(value.shape, buf.shape)) \
                or (buf.dim() == 1 and value.shape != buf.shape):
            raise ValueError(f"plan: with use_cuda_graph the {name} of the first plan {tuple(buf.shape)} is kept; "
                             f"this plan needs {tuple(value.shape)}")
        if buf.dim() == 2:
            buf[:, value.shape[1]:].zero_()
            buf[:, : value.shape[1]].copy_(value)
        else:
            buf.copy_(value)
        return buf

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        """Plan one batch. qo_indptr: int32 [b + 1] (queries of each request); kv_indptr: int32 [>= b + 1]
        (pages of each request in ``kv_indices``; as in FlashInfer only the first b + 1 entries are read);
        kv_indices: int32 page ids (request b's at kv_indptr[b]:kv_indptr[b+1]); kv_len_arr: int32 [b] KV
        lengths. Host copies of the indptrs and lengths are read here (FlashInfer does the
        same); nothing is read back in ``run``."""
        for name, dt in (("q_data_type", q_data_type), ("kv_data_type", kv_data_type)):
            if dt not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(f"{name}: {dt} is not supported by pagedmla.flashinfer (float16, bfloat16, "
                                 "float32; FP8 caches are not available yet)")
        _unsupported("use_profiler", use_profiler, not use_profiler)
        for name, value in (("num_heads", num_heads), ("head_dim_ckv", head_dim_ckv), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if isinstance(head_dim_kpe, bool) or not isinstance(head_dim_kpe, int) or head_dim_kpe < 0:
            raise ValueError(f"head_dim_kpe: expected an int >= 0, got {head_dim_kpe!r}")
        qo = _host_int32(qo_indptr, "qo_indptr")
        b = qo.shape[0] - 1
        if b < 0:
            raise ValueError("qo_indptr: expected batch + 1 >= 1 entries, got 0")
        # FlashInfer reads the first b + 1 entries of kv_indptr (its own tests pass longer ones).
        kv = _host_int32(kv_indptr, "kv_indptr", b + 1, at_least=True)[: b + 1]
        kv_indptr = kv_indptr[: b + 1]
        lens = _host_int32(kv_len_arr, "kv_len_arr", b)
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 1 or kv_indices.dtype != torch.int32:
            raise ValueError("kv_indices: expected an int32 1-D tensor of page ids")
        q_lens = (qo[1:] - qo[:-1]).tolist()
        pages = (kv[1:] - kv[:-1]).tolist()
        for i, (n_pages, length) in enumerate(zip(pages, lens.tolist())):
            if length < 0 or n_pages < -(-length // page_size):
                raise ValueError(f"kv_len_arr: request {i} has {length} tokens but {n_pages} pages of {page_size}")
        if int(kv[-1]) > kv_indices.shape[0] or min(q_lens, default=0) < 0:
            raise ValueError("kv_indptr/qo_indptr: must be non-decreasing, kv_indptr[-1] <= len(kv_indices)")
        dev = self.device
        width = max(1, max(pages, default=0))
        # Block table row b = request b's page list, padded with page 0 (never read: lengths bound the reads).
        kv_dev = kv_indptr.to(dev, torch.int64, non_blocking=True)
        col = torch.arange(width, device=dev, dtype=torch.int64)
        pos = kv_dev[:-1, None] + col
        valid = pos < kv_dev[1:, None]
        indices = kv_indices.to(dev, non_blocking=True)
        safe = torch.where(valid, pos, torch.zeros_like(pos)).clamp(max=max(0, indices.shape[0] - 1))
        table = indices[safe] if indices.shape[0] else torch.zeros(b, width, dtype=torch.int32, device=dev)
        table = torch.where(valid, table, torch.zeros_like(table))
        self._block_table = self._buffer("block_table", table.to(torch.int32))
        self._seq_lens = self._buffer("seq_lens", kv_len_arr.to(dev, non_blocking=True))
        self._num_tokens = int(qo[-1])
        self._heads, self._dv = num_heads, head_dim_ckv
        self._d = head_dim_ckv + head_dim_kpe
        self._page_size, self._causal, self._scale = page_size, bool(causal), float(sm_scale)
        self._q_dtype, self._kv_dtype = q_data_type, kv_data_type
        self._uniform_q = b > 0 and len(set(q_lens)) == 1 and q_lens[0] > 0
        if self._uniform_q:
            self._q_len = q_lens[0]
            rows = self._q_len * num_heads
            if self._use_cuda_graph:
                parts = schedule.num_sm_parts_for(dev, rows, 1)
                md = self._graph_buffers.get("tile_scheduler_metadata")
                if md is None:
                    md = torch.zeros(parts, schedule.METADATA_WIDTH, dtype=torch.int32, device=dev)
                    self._graph_buffers["tile_scheduler_metadata"] = md
                    self._graph_buffers["num_splits"] = torch.zeros(b + 1, dtype=torch.int32, device=dev)
                ns = self._graph_buffers["num_splits"]
                if md.shape[0] != parts or ns.shape[0] != b + 1:
                    raise ValueError("plan: with use_cuda_graph the batch size and query length of the first "
                                     "plan are kept")
                schedule.schedule_into(self._seq_lens, md, ns, rows, default_plan=True)
                self._metadata, self._num_splits = md, ns
            else:
                self._metadata, self._num_splits = schedule.get_mla_metadata(self._seq_lens, rows, 1)
        else:
            self._qo_indptr = self._buffer("qo_indptr", qo_indptr.to(dev, non_blocking=True))
            self._max_q_len = max(q_lens, default=0)
        self._planned = True

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False,
            o_scale: float | None = None, *, ckv_scale: float | None = None,
            ckv_scale_arr: torch.Tensor | None = None, kpe_scale: float | None = None):
        """Attention of the planned batch. q_nope [T, H, 512], q_pe [T, H, 64] (views of one [T, H, 576]
        tensor are used in place); ckv_cache [num_pages, page_size, 512], kpe_cache [num_pages, page_size,
        64] (likewise). ``out`` [T, H, 512] / ``lse`` [T, H] float32 receive the results when given (a copy
        into them). Returns out, or (out, lse) with ``return_lse``: base-2 LSE unless
        ``return_lse_base_on_e``."""
        if not self._planned:
            raise RuntimeError("run: call plan(...) first")
        for name, value in (("profiler_buffer", profiler_buffer), ("kv_len", kv_len), ("page_table", page_table),
                            ("o_scale", o_scale), ("ckv_scale", ckv_scale), ("ckv_scale_arr", ckv_scale_arr),
                            ("kpe_scale", kpe_scale)):
            _unsupported(name, value, value is None)
        for name, t, dt in (("q_nope", q_nope, self._q_dtype), ("q_pe", q_pe, self._q_dtype),
                            ("ckv_cache", ckv_cache, self._kv_dtype), ("kpe_cache", kpe_cache, self._kv_dtype)):
            if not isinstance(t, torch.Tensor) or t.dtype != dt:
                raise ValueError(f"{name}: dtype {getattr(t, 'dtype', None)} does not match the planned {dt}")
        expected_q = (self._num_tokens, self._heads, self._dv)
        if tuple(q_nope.shape) != expected_q:
            raise ValueError(f"q_nope: expected shape {expected_q} (planned tokens, heads, head_dim_ckv), "
                             f"got {tuple(q_nope.shape)}")
        q = _joined(q_nope, q_pe, "q_nope", "q_pe")
        kv = _joined(ckv_cache, kpe_cache, "ckv_cache", "kpe_cache")
        if q.shape[-1] != self._d or kv.shape[-1] != self._d or kv.shape[1] != self._page_size:
            raise ValueError(f"ckv_cache/kpe_cache: expected [num_pages, {self._page_size}, width] blocks adding up "
                             f"to the planned {self._d} columns, got {tuple(ckv_cache.shape)} and "
                             f"{tuple(kpe_cache.shape)}")
        k_cache = kv.unsqueeze(2)
        if self._uniform_q:
            b = self._seq_lens.shape[0]
            o, s = attention.flash_mla_with_kvcache(q.reshape(b, self._q_len, self._heads, self._d), k_cache,
                                                    self._block_table, self._seq_lens, self._dv, self._metadata,
                                                    self._num_splits, self._scale, self._causal)
            o = o.reshape(self._num_tokens, self._heads, self._dv)
            s = s.transpose(1, 2).reshape(self._num_tokens, self._heads)
        else:
            o, s = attention.flash_mla_varlen_with_kvcache(q, k_cache, self._block_table, self._seq_lens,
                                                           self._qo_indptr, self._dv, self._scale, self._causal,
                                                           max_q_len=self._max_q_len)
        return _finish(o, s, out, lse, return_lse, return_lse_base_on_e)


def _finish(o, s, out, lse, return_lse: bool, natural: bool):
    """Write (out, lse) FlashInfer's way: into the given buffers, LSE in base 2 unless ``natural``."""
    if out is not None:
        if out.shape != o.shape or out.dtype != o.dtype:
            raise ValueError(f"out: expected {o.dtype} {tuple(o.shape)}, got {out.dtype} {tuple(out.shape)}")
        out.copy_(o)
        o = out
    if not return_lse and lse is None:
        return o
    if lse is not None:
        if lse.shape != s.shape or lse.dtype != torch.float32:
            raise ValueError(f"lse: expected float32 {tuple(s.shape)}, got {lse.dtype} {tuple(lse.shape)}")
        if natural:
            lse.copy_(s)
        else:
            torch.mul(s, LOG2_E, out=lse)
        s = lse
    elif not natural:
        s = s * LOG2_E
    return (o, s) if return_lse else o


class BatchPrefillWithRaggedKVCacheWrapper:
    """FlashInfer's ragged (packed, non-paged) batch prefill: the MHA form of MLA prefill (q/k 192, v 128),
    or any MHA / GQA attention over packed sequences. LSE in base 2, FlashInfer's convention."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, kv_indptr_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer: expected a torch.Tensor (its device is the wrapper's)")
        _unsupported("kv_layout", kv_layout, kv_layout == "NHD")
        for name, value in (("custom_mask_buf", custom_mask_buf), ("mask_indptr_buf", mask_indptr_buf),
                            ("jit_args", jit_args), ("jit_kwargs", jit_kwargs)):
            _unsupported(name, value, value is None)
        self.device = float_workspace_buffer.device
        self._backend = _check_backend(backend)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._qo_buf, self._kv_buf = qo_indptr_buf, kv_indptr_buf
        self._planned = False

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking: bool = True,
             prefix_len_ptr: torch.Tensor | None = None, token_pos_in_items_ptr: torch.Tensor | None = None,
             token_pos_in_items_len: int = 0, max_item_len_ptr: torch.Tensor | None = None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False,
             seq_lens: torch.Tensor | None = None, seq_lens_q: torch.Tensor | None = None,
             max_token_per_sequence: int | None = None, max_sequence_kv: int | None = None,
             v_indptr: torch.Tensor | None = None, o_indptr: torch.Tensor | None = None) -> None:
        """Plan one batch: qo_indptr / kv_indptr int32 [b + 1] over the packed q and k/v rows. Host copies
        of both are read here for the longest lengths; ``run`` reads nothing back. ``use_fp16_qk_reduction``,
        ``fixed_split_size``, ``disable_split_kv`` and ``non_blocking`` are performance hints (accepted)."""
        for name, value in (("custom_mask", custom_mask), ("packed_custom_mask", packed_custom_mask),
                            ("prefix_len_ptr", prefix_len_ptr), ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                            ("max_item_len_ptr", max_item_len_ptr), ("seq_lens", seq_lens),
                            ("seq_lens_q", seq_lens_q), ("max_token_per_sequence", max_token_per_sequence),
                            ("max_sequence_kv", max_sequence_kv), ("v_indptr", v_indptr), ("o_indptr", o_indptr)):
            _unsupported(name, value, value is None)
        _unsupported("pos_encoding_mode", pos_encoding_mode, pos_encoding_mode == "NONE")
        _unsupported("window_left", window_left, window_left is None or window_left < 0)
        _unsupported("logits_soft_cap", logits_soft_cap, not logits_soft_cap)
        _unsupported("token_pos_in_items_len", token_pos_in_items_len, not token_pos_in_items_len)
        for name, dt in (("q_data_type", q_data_type), ("kv_data_type", kv_data_type), ("o_data_type", o_data_type)):
            if isinstance(dt, torch.dtype) and dt not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(f"{name}: {dt} is not supported by pagedmla.flashinfer (FP8 is not available)")
        qo = _host_int32(qo_indptr, "qo_indptr")
        kv = _host_int32(kv_indptr, "kv_indptr", qo.shape[0])
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim_qk", head_dim_qk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        dev = self.device
        self._qo_indptr = qo_indptr.to(dev, non_blocking=True)
        self._kv_indptr = kv_indptr.to(dev, non_blocking=True)
        if self._use_cuda_graph and self._qo_buf is not None and self._kv_buf is not None:
            self._qo_buf.copy_(self._qo_indptr)
            self._kv_buf.copy_(self._kv_indptr)
            self._qo_indptr, self._kv_indptr = self._qo_buf, self._kv_buf
        self._max_q = int((qo[1:] - qo[:-1]).max()) if qo.shape[0] > 1 else 0
        self._max_k = int((kv[1:] - kv[:-1]).max()) if kv.shape[0] > 1 else 0
        self._heads = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo or head_dim_qk)
        self._causal, self._scale = bool(causal), sm_scale
        self._planned = True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, o_scale: float | None = None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, kv_cache_sf=None):
        """q [qo_indptr[-1], num_qo_heads, head_dim_qk], k [kv_indptr[-1], num_kv_heads, head_dim_qk],
        v [kv_indptr[-1], num_kv_heads, head_dim_vo]. Returns out, or (out, lse [total_q, H] base 2)."""
        if not self._planned:
            raise RuntimeError("run: call plan(...) first")
        _unsupported("args", args, not args)
        for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale), ("o_scale", o_scale),
                            ("kv_cache_sf", kv_cache_sf)):
            _unsupported(name, value, value is None)
        h, hk, dqk, dvo = self._heads
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1:] != (h, dqk):
            raise ValueError(f"q: expected [total_q, {h}, {dqk}], got {getattr(q, 'shape', type(q).__name__)}")
        o, s_ht, _ = attention.flash_attn_varlen_func(q, k, v, self._qo_indptr, self._kv_indptr, self._max_q,
                                                      self._max_k, self._scale, self._causal, True, out=out)
        return _finish(o, s_ht.T, None, lse, return_lse, False)

    def run_return_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs):
        """``run(..., return_lse=True)``, FlashInfer's shorthand."""
        return self.run(q, k, v, *args, return_lse=True, **kwargs)
