"""SGLang's ``AttentionBackend`` interface over ``MLABackend``: ``SGLangMLABackend(backend, req_to_token)``.

Follows sgl-project/sglang's ``python/sglang/srt/layers/attention/base_attn_backend.py`` and its MLA backends
(``flashmla_backend.py``, ``flashinfer_mla_backend.py``) as stored in 2026: the method set and argument names
``init_forward_metadata(forward_batch)``, ``forward(q, k, v, layer, forward_batch, save_kv_cache=True,
**kwargs)``, ``forward_extend`` / ``forward_decode(q, k, v, layer, forward_batch, save_kv_cache=True,
q_rope=None, k_rope=None)``, ``init_cuda_graph_state(max_bs, max_num_tokens)``, the capture / replay planning
calls with ``encoder_lens`` and ``spec_info``, ``get_cuda_graph_seq_len_fill_value()``.

What the adapter reads from SGLang's objects (duck-typed, nothing is imported from SGLang):
  forward_batch: ``forward_mode`` (SGLang's ForwardMode methods ``is_idle``, ``is_decode``,
  ``is_target_verify``, ``is_draft_extend``, ``is_mixed``, ``is_extend``), ``batch_size``, ``req_pool_indices``,
  ``seq_lens`` (int32 device), ``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu``,
  ``out_cache_loc``, ``token_to_kv_pool`` (``get_key_buffer(layer_id)`` -> ``[num_slots, 1, 576]``,
  ``set_kv_buffer(layer, loc, cache_k, cache_v)``, ``set_mla_kv_buffer(layer, loc, k_nope, k_rope)``);
  layer (RadixAttention): ``layer_id``.
  req_to_token: SGLang's ``req_to_token_pool.req_to_token``, int32 ``[max_requests, max_context_len]`` token
  slots; with pages of ``page_size`` tokens, page ids are ``req_to_token[:, ::page_size] // page_size``.

Semantics taken from SGLang: decode and extend ``seq_lens`` include this step's tokens; TARGET_VERIFY
``seq_lens`` do not include the ``num_draft_tokens`` drafts (the adapter adds them). Extends without a
cached prefix run the MHA form (SGLang's DeepSeek writes the latent rows itself and calls with q/k 192,
v 128, ``save_kv_cache=False``); extends with a prefix, MIXED, decode and verify run the absorbed form (q
576, or ``q`` 512 + ``q_rope`` 64, concatenated: one copy). The backend's config must therefore say
``extend_prefix_mode="absorbed"`` (the chunked form needs a decompression callback SGLang does not pass).
A MIXED batch's trailing one-token requests (SGLang's running decodes) are declared decodes (``mixed_extends``).
KV rows are written through the pool's own ``set_kv_buffer`` / ``set_mla_kv_buffer``, as SGLang's MLA
backends do. Returns ``[tokens, heads * 512]`` (absorbed) or ``[tokens, heads * 128]`` (MHA).
"""

from __future__ import annotations

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend


def mixed_extends(extend_seq_lens) -> int:
    """The extending requests of an SGLang MIXED batch: those before its trailing run of one-token requests
    (SGLang's running decodes; a one-token extend attends exactly as a decode does)."""
    n = len(extend_seq_lens)
    while n and int(extend_seq_lens[n - 1]) == 1:
        n -= 1
    return n


class _PoolCache:
    """The cache view MLABackend reads (``layer`` / ``paged_view``) over SGLang's token_to_kv_pool, whose rows are
    the model's values (``kv_format`` None: SGLang's FP8 pools are not adapted)."""

    kv_format = None

    def __init__(self, pool, page_size: int, kv_dim: int):
        self.pool, self.page_size, self.kv_dim = pool, page_size, kv_dim

    def layer(self, layer_id: int) -> torch.Tensor:
        return self.pool.get_key_buffer(layer_id)

    def k_scale(self, layer_id: int) -> None:
        """No scale: the pool's rows are values (``MLAKVCache.k_scale``)."""
        return None

    def paged_view(self, layer_id: int) -> torch.Tensor:
        buf = self.layer(layer_id)
        if buf.shape[-1] != self.kv_dim or buf.numel() % (self.page_size * self.kv_dim):
            raise ValueError(f"token_to_kv_pool: layer {layer_id}'s buffer {tuple(buf.shape)} is not whole pages of "
                             f"{self.page_size} rows of {self.kv_dim}")
        return buf.view(-1, self.page_size, 1, self.kv_dim)


def pagedmla_mode(forward_mode) -> ForwardMode:
    """pagedmla's ForwardMode for SGLang's (checked in SGLang's order: its is_extend() is also true for
    MIXED, DRAFT_EXTEND and TARGET_VERIFY)."""
    if isinstance(forward_mode, ForwardMode):
        return forward_mode
    for method, mode in (("is_idle", ForwardMode.IDLE), ("is_decode", ForwardMode.DECODE),
                         ("is_target_verify", ForwardMode.TARGET_VERIFY), ("is_draft_extend", ForwardMode.DRAFT_EXTEND),
                         ("is_mixed", ForwardMode.MIXED), ("is_extend", ForwardMode.EXTEND)):
        check = getattr(forward_mode, method, None)
        if check is not None and check():
            return mode
    raise ValueError(f"forward_mode: {forward_mode!r} is none of SGLang's idle/decode/verify/extend modes")


class SGLangMLABackend:
    """SGLang's AttentionBackend method set over an ``MLABackend`` (module docstring)."""

    def __init__(self, backend: MLABackend, req_to_token: torch.Tensor):
        if not isinstance(backend, MLABackend):
            raise TypeError(f"backend: expected an MLABackend, got {type(backend).__name__}")
        if backend.config.extend_prefix_mode != "absorbed":
            raise ValueError("backend: its config needs extend_prefix_mode='absorbed' (SGLang passes no "
                             f"decompression callback for the chunked form), got {backend.config.extend_prefix_mode!r}")
        if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
            raise ValueError("req_to_token: expected SGLang's int32 [max_requests, max_context_len] token slots")
        self.backend = backend
        self.req_to_token = req_to_token
        self.page_size = backend.config.page_size
        self._draft = backend.config.num_draft_tokens
        self._rows: torch.Tensor | None = None

    # ------------------------------------------------------------------ planning
    def _block_table(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Page ids of the batch's requests, row i for request i: [bs, pages] int32 (one gather)."""
        rows = self.req_to_token.index_select(0, req_pool_indices.to(torch.int64))
        return rows if self.page_size == 1 else rows[:, :: self.page_size] // self.page_size

    def _step_lens(self, mode: ForwardMode, seq_lens: torch.Tensor, seq_lens_cpu):
        if mode != ForwardMode.TARGET_VERIFY:
            return seq_lens.to(torch.int32), seq_lens_cpu
        cpu = None if seq_lens_cpu is None else [int(x) + self._draft for x in seq_lens_cpu]
        return (seq_lens + self._draft).to(torch.int32), cpu

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan one step from SGLang's ForwardBatch."""
        mode = pagedmla_mode(forward_batch.forward_mode)
        bs = int(forward_batch.batch_size)
        rpi = forward_batch.req_pool_indices[:bs]
        seq_lens, seq_cpu = self._step_lens(mode, forward_batch.seq_lens[:bs], forward_batch.seq_lens_cpu)
        ext = getattr(forward_batch, "extend_seq_lens_cpu", None)
        pre = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        num_extends = 0
        if mode == ForwardMode.MIXED and ext is not None and pre is not None:
            # SGLang appends the running decodes (one new token each) after the prefill chunks: declared as
            # decodes, the backend may run them in the decode kernel (MLAConfig.mixed_decode_kernel).
            num_extends = mixed_extends(ext)
            ext, pre = ext[:num_extends], pre[:num_extends]
        elif mode == ForwardMode.MIXED:
            num_extends = bs  # the backend names what is missing
        self.backend.init_forward_metadata(ForwardBatch(
            forward_mode=mode, req_pool_indices=torch.arange(bs, device=rpi.device), seq_lens=seq_lens,
            block_table=self._block_table(rpi), seq_lens_cpu=seq_cpu, extend_seq_lens_cpu=ext,
            extend_prefix_lens_cpu=pre, num_extends=num_extends))

    # ------------------------------------------------------------------ running
    def _cache(self, forward_batch) -> _PoolCache:
        return _PoolCache(forward_batch.token_to_kv_pool, self.page_size, self.backend.kv_dim)

    def _save_absorbed(self, k, v, layer, forward_batch, save_kv_cache: bool, k_rope) -> None:
        if not save_kv_cache or k is None:
            return
        pool, loc = forward_batch.token_to_kv_pool, forward_batch.out_cache_loc
        if k_rope is not None:
            pool.set_mla_kv_buffer(layer, loc, k, k_rope)
        else:
            pool.set_kv_buffer(layer, loc, k, v)

    @staticmethod
    def _full_q(q: torch.Tensor, q_rope: torch.Tensor | None) -> torch.Tensor:
        return q if q_rope is None else torch.cat([q, q_rope], dim=-1)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """SGLang's dispatch: decode modes to forward_decode, the others to forward_extend."""
        if pagedmla_mode(forward_batch.forward_mode) in (ForwardMode.DECODE, ForwardMode.IDLE):
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None):
        """Absorbed decode / verify: q [T, H, 576] (or q_nope + q_rope), k the new latent rows (or k_nope +
        k_rope), v as SGLang passes it (the first 512 columns of k, or None). Returns [T, H * 512]."""
        self._save_absorbed(k, v, layer, forward_batch, save_kv_cache, k_rope)
        return self.backend.forward_decode(self._full_q(q, q_rope), None, None, layer, forward_batch.out_cache_loc,
                                           self._cache(forward_batch), int(forward_batch.batch_size),
                                           save_kv_cache=False)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None):
        """Extend / verify / mixed in the planned form (module docstring): MHA (q/k 192, v 128, rows already
        written by the model: ``save_kv_cache`` must be False) or absorbed (as in forward_decode)."""
        cache = self._cache(forward_batch)
        loc = forward_batch.out_cache_loc
        if self.backend.attention_form == "mha":
            if save_kv_cache:
                raise ValueError("save_kv_cache: the MHA form gets no latent rows to store; SGLang's DeepSeek "
                                 "writes them with set_kv_buffer and calls with save_kv_cache=False")
            if q_rope is not None or k_rope is not None:
                raise ValueError("q_rope/k_rope: the MHA form takes whole q/k heads of 192")
            return self.backend.forward_extend(q, k, v, layer, loc, cache, save_kv_cache=False)
        self._save_absorbed(k, v, layer, forward_batch, save_kv_cache, k_rope)
        meta = self.backend.metadata
        if meta.mode == ForwardMode.TARGET_VERIFY:
            return self.backend.forward_decode(self._full_q(q, q_rope), None, None, layer, loc, cache, meta.bs,
                                               save_kv_cache=False)
        return self.backend.forward_extend(self._full_q(q, q_rope), None, None, layer, loc, cache,
                                           save_kv_cache=False)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """SGLang's call: buffers for graphs of up to ``max_bs`` requests (``max_num_tokens`` is implied by
        max_bs and the verify draft count); block-table width from ``req_to_token``'s context length."""
        pages = -(-self.req_to_token.shape[1] // self.page_size)
        self.backend.init_cuda_graph_state(max_bs, max_pages_per_request=pages)
        self._rows = torch.arange(max_bs, device=self.req_to_token.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, encoder_lens, forward_mode, spec_info):
        """Plan the ``bs``-request graph before its capture (decode or verify)."""
        if encoder_lens is not None:
            raise ValueError("encoder_lens: encoder-decoder attention is not supported")
        mode = pagedmla_mode(forward_mode)
        lens, _ = self._step_lens(mode, seq_lens[:bs], None)
        self.backend.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices[:bs], lens, mode)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        """Refill the graph buffers for a replay (no host synchronisation; SGLang pads the batch itself)."""
        if self._rows is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs, max_num_tokens) first")
        if encoder_lens is not None:
            raise ValueError("encoder_lens: encoder-decoder attention is not supported")
        mode = pagedmla_mode(forward_mode)
        lens, _ = self._step_lens(mode, seq_lens[:bs], None)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, self._rows[:bs], lens, mode,
                                                             block_table=self._block_table(req_pool_indices[:bs]))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.backend.get_cuda_graph_seq_len_fill_value()
