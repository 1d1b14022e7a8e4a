"""MLADraftBackend: the attention side of a draft model (DeepSeek's MTP layers, EAGLE-style drafting).

A draft model keeps its own latent rows, one cache layer per draft attention layer, in pages with the target's
page ids: position p of a request lives at the same slot in both caches, so the draft reads the target's
block table and writes the slots the target wrote for the same positions. Per speculative step it runs

* one extend over the tokens the target has just accepted (EXTEND after a prefill chunk, in the form the
  backend picks; DRAFT_EXTEND after a verify, at most ``num_draft_tokens`` tokens per request), on
  ``extend``; its last row per request gives the first draft token;
* ``num_steps`` single-token draft decodes, step j at ``seq_lens + j``, each on its own backend in
  ``steps`` with its own CUDA-graph buffers: every step's plan is made before the first runs, so one CUDA
  graph can hold all of them (or one graph each).

Each step writes its rows before it reads, and reads only a request's first ``seq_len`` rows: rows left by
rejected drafts lie past the accepted length and are rewritten before any later step reads them.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend, create_backend
from pagedmla.cache import MLAKVCache
from pagedmla.config import MLAConfig


class MLADraftBackend:
    """config: the draft model's MLAConfig (``is_draft`` True, ``num_layers`` its attention layers,
    ``num_draft_tokens`` the most tokens per request of a DRAFT_EXTEND step); num_pages: pages of the
    target's cache (the draft cache has the same geometry); num_steps: draft decode steps per speculative
    step (the draft tokens after the first). ``provider`` / ``backend_name`` as in ``create_backend``."""

    def __init__(self, config: MLAConfig, num_pages: int, *, num_steps: int, device: torch.device | str = "cpu",
                 provider: str | None = None, backend_name: str = "pagedmla"):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config: expected an MLAConfig, got {type(config).__name__}")
        if not config.is_draft:
            raise ValueError("config: a draft backend needs MLAConfig.is_draft=True")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps: expected an int >= 0, got {num_steps!r}")
        self.config = config
        self.cache = MLAKVCache(config.num_layers, num_pages, config.page_size, config.kv_dim,
                                dtype=config.kv_cache_dtype, device=device, k_scale=config.kv_cache_scale)
        self.extend = create_backend(backend_name, config, device=device, provider=provider)
        self.steps: list[MLABackend] = [create_backend(backend_name, config, device=device, provider=provider)
                                        for _ in range(num_steps)]
        self.device = self.extend.device
        # Step j's lengths for a graph replay, written in place (the steps' graph buffers copy from them).
        self._step_lens: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def init_forward_metadata_steps(self, batch: ForwardBatch) -> None:
        """Plan every draft decode step from the first one's DECODE batch: step j runs one token per request
        at ``seq_lens + j`` (device and host lengths both)."""
        if batch.forward_mode != ForwardMode.DECODE:
            raise ValueError(f"batch.forward_mode: draft steps decode, got {batch.forward_mode}")
        for j, backend in enumerate(self.steps):
            lens_cpu = None if batch.seq_lens_cpu is None else [int(s) + j for s in batch.seq_lens_cpu]
            backend.init_forward_metadata(dataclasses.replace(batch, seq_lens=batch.seq_lens + j,
                                                              seq_lens_cpu=lens_cpu))

    def init_cuda_graph_state(self, max_bs: int, *, max_pages_per_request: int | None = None) -> None:
        """Graph buffers of the extend backend and of every step, allocated once."""
        for backend in (self.extend, *self.steps):
            backend.init_cuda_graph_state(max_bs, max_pages_per_request=max_pages_per_request)
        self._step_lens = torch.ones(max(1, self.num_steps), max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, forward_mode: ForwardMode) -> None:
        """Plan a captured step of ``bs`` requests: DRAFT_EXTEND or IDLE on ``extend``, DECODE on every step
        (step j at ``seq_lens + j``)."""
        if forward_mode == ForwardMode.DECODE:
            for j, backend in enumerate(self.steps):
                backend.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens + j, forward_mode)
        else:
            self.extend.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens, forward_mode)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, forward_mode: ForwardMode, *,
                                                block_table: torch.Tensor, raw_bs: int | None = None) -> None:
        """Refill the graph buffers for a replay, as ``MLABackend.init_forward_metadata_replay_cuda_graph``; for
        DECODE every step's at once (no host synchronisation, no new buffers)."""
        if forward_mode != ForwardMode.DECODE:
            self.extend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, forward_mode,
                                                                block_table=block_table, raw_bs=raw_bs)
            return
        if self._step_lens is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        raw = bs if raw_bs is None else raw_bs
        if not 0 <= raw <= min(bs, seq_lens.shape[0]):
            raise ValueError(f"raw_bs: expected 0..{bs} real requests with their seq_lens, got {raw_bs}")
        for j, backend in enumerate(self.steps):
            lens = self._step_lens[j, :raw]
            torch.add(seq_lens[:raw], j, out=lens)
            backend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, lens, forward_mode,
                                                            block_table=block_table, raw_bs=raw)
