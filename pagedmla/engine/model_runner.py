"""Model runner: owns the latent cache, page tables and backend; turns a scheduled batch into one forward.

For each request the step runs ``token_ids[num_cached_tokens:]``: positions continue from the cached
prefix, new latent rows go to the slots ``RequestTable.token_slots`` gives, and ``seq_lens`` count
every token of the request including this step's. The backend is planned once per step, before the
model's layers call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend, create_backend
from pagedmla.cache import MLAKVCache, PageAllocator, RequestTable
from pagedmla.engine.sequence import Sequence
from pagedmla.model.context import StepContext
from pagedmla.model.deepseek import DeepseekForCausalLM


@dataclass
class StepInputs:
    """Device tensors of one step plus the batch description the backend plans from."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]
    last_token_index: torch.Tensor  # int64 [bs]: row of each request's last new token
    batch: ForwardBatch


class ModelRunner:
    """model: a loaded DeepseekForCausalLM; the cache gets ``num_pages`` pages of ``page_size`` tokens in
    the model's dtype; the RequestTable holds ``max_batch_size`` request slots. ``backend_options`` are
    further MLAConfig fields (chunked_prefix_capacity, chunked_prefix_min_extend, ...)."""

    def __init__(self, model: DeepseekForCausalLM, *, page_size: int, num_pages: int, max_batch_size: int,
                 max_context_len: int, provider: str | None = None, extend_prefix_mode: str = "auto",
                 backend_name: str = "pagedmla", backend_options: dict | None = None):
        cfg = model.config
        self.model = model
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        self.mla_config = cfg.mla_config(page_size=page_size, dtype=self.dtype, max_batch_size=max_batch_size,
                                         max_context_len=max_context_len, extend_prefix_mode=extend_prefix_mode,
                                         **(backend_options or {}))
        self.backend: MLABackend = create_backend(backend_name, self.mla_config, device=self.device,
                                                  provider=provider)
        self.cache = MLAKVCache(cfg.num_hidden_layers, num_pages, page_size, self.mla_config.kv_dim,
                                dtype=self.dtype, device=self.device)
        self.table = RequestTable(PageAllocator(num_pages), page_size, max_batch_size,
                                  self.mla_config.max_pages_per_request, device=self.device)

    def prepare(self, seqs: list[Sequence], mode: ForwardMode, num_extends: int) -> StepInputs:
        """Build the step's tensors; every request's pages must already cover its tokens."""
        ids, positions, slots, lens, ext, pre = [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            start, end = seq.num_cached_tokens, len(seq)
            if i >= num_extends and end - start != 1:
                raise ValueError(f"seqs: decode request {seq.seq_id} has {end - start} new tokens, expected 1")
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.append(self.table.token_slots(seq.slot, start, end))
            lens.append(end)
            ext.append(end - start)
            pre.append(start)
        dev = self.device
        batch = ForwardBatch(
            forward_mode=mode,
            req_pool_indices=torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_table=self.table.block_table,
            seq_lens_cpu=lens,
            extend_seq_lens_cpu=ext[:num_extends],
            extend_prefix_lens_cpu=pre[:num_extends],
            num_extends=num_extends,
        )
        last = torch.tensor(ext, dtype=torch.int64).cumsum(0) - 1
        return StepInputs(input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
                          positions=torch.tensor(positions, dtype=torch.int64, device=dev),
                          out_cache_loc=torch.cat(slots), last_token_index=last.to(dev), batch=batch)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], mode: ForwardMode, num_extends: int, *, all_logits: bool = False,
            backend: MLABackend | None = None) -> torch.Tensor:
        """One forward step. Returns float32 logits [bs, vocab] of each request's last new token, or of
        every new token ([T, vocab], request-major) with ``all_logits``. ``backend`` substitutes a
        wrapper of ``self.backend`` (such as the attention profiler)."""
        inputs = self.prepare(seqs, mode, num_extends)
        self.backend.init_forward_metadata(inputs.batch)
        ctx = StepContext(backend=backend or self.backend, cache=self.cache, out_cache_loc=inputs.out_cache_loc)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not all_logits:
            hidden = hidden.index_select(0, inputs.last_token_index)
        return self.model.compute_logits(hidden)
