"""Model runner: owns the latent cache, page tables and backend; turns a scheduled batch into one forward.

For each request the step runs a list of tokens starting at ``num_cached_tokens`` (by default all of
``token_ids[num_cached_tokens:]``; a prompt chunk; or the last token and its drafts in a verify step):
positions continue from the cached prefix, new latent rows go to the slots of the request's pages
(position p: ``pages[p // page_size] * page_size + p % page_size``, as ``RequestTable.token_slots``), and
``seq_lens`` count every token of the request including this step's. The step's index tensors are built on
the host and reach the device in one copy. The backend is planned once per step, before the model's
layers call it. Decode and verify steps of captured batch sizes replay the CUDA graphs of the runner's
own GraphRunner once ``capture_cuda_graphs`` has made it (``graphs``).

A step is first described on the host (``plan``: a ``StepPlan``), then run (``execute``). In a
tensor-parallel engine rank 0 plans, ``step_hook`` hands the plan to the other ranks
(``pagedmla.engine.distributed``), and every rank executes it. Under decode context parallelism
(``dcp``) the request table's pages hold ``page_size * dcp.size`` tokens, position p lives on DCP rank
``p % dcp.size`` at slot ``pages[p // (page_size * D)] * page_size + p % (page_size * D) // D`` of that
rank's cache (D = dcp.size, ``pagedmla.context_parallel``), and the other ranks write that token's row to
slot 0 (the reserved page).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend, create_backend
from pagedmla.cache import MLAKVCache, PageAllocator, RequestTable
from pagedmla.device import to_device
from pagedmla.engine.cuda_graph import Graph, GraphRunner
from pagedmla.engine.sequence import Sequence
from pagedmla.model.context import StepContext
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.moe import grouped_mm_supported
from pagedmla.parallel import SINGLE, Group


@dataclass
class StepPlan:
    """One step on the host, all a rank needs to run it: per request its table slot, its first new
    position and the tokens it runs; ``all_logits``: logits of every token; ``eager``: no graph replay."""

    mode: ForwardMode
    num_extends: int
    slots: list[int]
    starts: list[int]
    tokens: list[list[int]]
    all_logits: bool = False
    eager: bool = False


@dataclass
class StepInputs:
    """Device tensors of one step plus the batch description the backend plans from."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]
    last_token_index: torch.Tensor  # int64 [bs]: row of each request's last new token
    batch: ForwardBatch


class ModelRunner:
    """model: a loaded DeepseekForCausalLM; the cache gets ``num_pages`` pages of ``page_size`` tokens in the model's
    dtype (or the ``kv_cache_dtype`` / ``kv_cache_scale`` of ``backend_options``: FP8 caches); the RequestTable
    holds ``max_batch_size`` request slots. ``backend_options`` are further MLAConfig fields
    (chunked_prefix_capacity, chunked_prefix_min_extend, ...). ``num_speculative_tokens`` k > 0 sizes the backend
    for verify steps of k + 1 tokens per request (and widens its context by k: a request at the context limit
    still verifies k draft slots). A model built for tensor parallelism sizes the backend for its heads; ``dcp``
    is this rank's decode-context-parallel group (of ranks of that tensor-parallel group)."""

    def __init__(self, model: DeepseekForCausalLM, *, page_size: int, num_pages: int, max_batch_size: int,
                 max_context_len: int, provider: str | None = None, extend_prefix_mode: str = "auto",
                 backend_name: str = "pagedmla", backend_options: dict | None = None,
                 num_speculative_tokens: int = 0, dcp: Group = SINGLE):
        cfg = model.config
        self.model = model
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        if cfg.n_routed_experts:
            # The experts' one-time grouped-GEMM probe synchronises (it captures a tiny graph): here, not in
            # the first step's forward.
            grouped_mm_supported(self.device, self.dtype)
        options = dict(backend_options or {})
        if num_speculative_tokens:
            options["num_draft_tokens"] = num_speculative_tokens + 1
        if dcp.size > 1:
            options.update(dcp_size=dcp.size, dcp_rank=dcp.rank)
        self.dcp = dcp
        self.mla_config = cfg.mla_config(page_size=page_size, dtype=self.dtype, max_batch_size=max_batch_size,
                                         max_context_len=max_context_len + num_speculative_tokens,
                                         extend_prefix_mode=extend_prefix_mode, attn_tp_size=model.tp.size,
                                         **options)
        extra = {"dcp_group": dcp.group} if dcp.size > 1 else {}
        self.backend: MLABackend = create_backend(backend_name, self.mla_config, device=self.device,
                                                  provider=provider, **extra)
        self.cache = MLAKVCache(cfg.num_hidden_layers, num_pages, page_size, self.mla_config.kv_dim,
                                dtype=self.mla_config.kv_cache_dtype, device=self.device,
                                k_scale=self.mla_config.kv_cache_scale)
        self.table = RequestTable(PageAllocator(num_pages), self.mla_config.tokens_per_page, max_batch_size,
                                  self.mla_config.max_pages_per_request, device=self.device)
        self._graphs: GraphRunner | None = None
        # Rank 0 of a tensor-parallel engine: hands each step's plan to the other ranks before running it.
        self.step_hook: Callable[[StepPlan], None] | None = None

    @property
    def graphs(self) -> GraphRunner | None:
        """The runner's CUDA graphs (None until ``capture_cuda_graphs``)."""
        return self._graphs

    def capture_cuda_graphs(self, batch_sizes: list[int] | None = None,
                            graph_factory: Callable[[], Graph] | None = None) -> GraphRunner:
        """Capture the decode (and verify) steps of ``batch_sizes`` (None: ``default_batch_sizes``) as graphs
        from ``graph_factory`` (None: CUDA graphs; a CPU stand-in in tests); later steps of those batch sizes
        replay them. Returns the GraphRunner (``graphs``)."""
        self._graphs = GraphRunner(self.model, self.cache, self.backend, batch_sizes, graph_factory)
        return self._graphs

    def q_len(self, mode: ForwardMode) -> int:
        """Tokens per request of a decode-like step (``MLABackend.q_len``)."""
        return self.backend.q_len(mode)

    def plan(self, seqs: list[Sequence], mode: ForwardMode, num_extends: int,
             tokens: list[list[int]] | None = None, *, all_logits: bool = False, eager: bool = False) -> StepPlan:
        """Describe the step; every request's pages must already cover its tokens.

        tokens: the ids each request runs from ``num_cached_tokens`` on (default: all uncached ones)."""
        if tokens is not None and len(tokens) != len(seqs):
            raise ValueError(f"tokens: expected one token list per request ({len(seqs)}), got {len(tokens)}")
        decode_len = self.q_len(mode)
        per_page = self.table.page_size
        steps = []
        for i, seq in enumerate(seqs):
            step = seq.token_ids[seq.num_cached_tokens:] if tokens is None else list(tokens[i])
            end = seq.num_cached_tokens + len(step)
            if i >= num_extends and len(step) != decode_len:
                raise ValueError(f"seqs: decode request {seq.seq_id} has {len(step)} new tokens, "
                                 f"expected {decode_len}")
            if not step:
                raise ValueError(f"tokens: request {seq.seq_id} has nothing to run")
            held = len(self.table.pages[seq.slot]) * per_page
            if end > held:
                raise ValueError(f"seqs: request {seq.seq_id} writes positions up to {end - 1} but its pages "
                                 f"hold {held} tokens")
            steps.append(step)
        return StepPlan(mode, num_extends, [s.slot for s in seqs], [s.num_cached_tokens for s in seqs], steps,
                        all_logits, eager)

    def prepare(self, seqs: list[Sequence], mode: ForwardMode, num_extends: int,
                tokens: list[list[int]] | None = None) -> StepInputs:
        """``inputs(plan(...))``: the step's tensors."""
        return self.inputs(self.plan(seqs, mode, num_extends, tokens))

    def inputs(self, plan: StepPlan) -> StepInputs:
        """The step's device tensors, with this rank's cache slots (the module docstring's layout)."""
        per_page = self.table.page_size
        d, rank = self.dcp.size, self.dcp.rank
        ps = per_page // d
        ids, positions, slots, lens, ext, pre, last = [], [], [], [], [], [], []
        for slot, start, step in zip(plan.slots, plan.starts, plan.tokens):
            end = start + len(step)
            pages = self.table.pages[slot]
            ids.extend(step)
            positions.extend(range(start, end))
            if d == 1:
                slots.extend(pages[p // ps] * ps + p % ps for p in range(start, end))
            else:
                slots.extend(pages[p // per_page] * ps + p % per_page // d if p % d == rank else 0
                             for p in range(start, end))
            lens.append(end)
            ext.append(end - start)
            pre.append(start)
            last.append(len(ids) - 1)
        # One host-to-device copy for all the step's int64 indices (plus seq_lens, cast on the device),
        # instead of one per tensor and per request; the fields are views into it.
        t, bs = len(ids), len(plan.slots)
        num_extends = plan.num_extends
        packed = to_device(ids + positions + slots + plan.slots + last + lens, torch.int64, self.device)
        input_ids, pos, loc, req, last_index, seq_lens = packed.split([t, t, t, bs, bs, bs])
        batch = ForwardBatch(
            forward_mode=plan.mode,
            req_pool_indices=req,
            seq_lens=seq_lens.to(torch.int32),
            block_table=self.table.block_table,
            seq_lens_cpu=lens,
            extend_seq_lens_cpu=ext[:num_extends],
            extend_prefix_lens_cpu=pre[:num_extends],
            num_extends=num_extends,
        )
        return StepInputs(input_ids=input_ids, positions=pos, out_cache_loc=loc, last_token_index=last_index,
                          batch=batch)

    def run(self, seqs: list[Sequence], mode: ForwardMode, num_extends: int, *, tokens: list[list[int]] | None = None,
            all_logits: bool = False, backend: MLABackend | None = None, draft_tokens: torch.Tensor | None = None,
            return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward step. Returns float32 logits [bs, vocab] of each request's last new token, or of
        every new token ([T, vocab], request-major) with ``all_logits``. ``backend`` substitutes a
        wrapper of ``self.backend`` (such as the attention profiler; such steps run eagerly).
        ``draft_tokens``: int64 [bs, k] on the device, the drafts of a verify step, which take the places
        after each request's first token in ``tokens`` (a draft model's tokens need not come to the host;
        so they cannot be handed to other ranks: a draft model runs on a single-rank engine).
        ``return_hidden``: also return the final hidden states of every new token [T, hidden] (after the
        last norm; what an MTP draft model reads)."""
        plan = self.plan(seqs, mode, num_extends, tokens, all_logits=all_logits, eager=backend is not None)
        if self.step_hook is not None:
            if draft_tokens is not None:
                raise ValueError("draft_tokens: device-side drafts cannot be handed to the other tensor-parallel "
                                 "ranks (speculative decoding with a draft model runs on one rank)")
            self.step_hook(plan)
        return self.execute(plan, backend, draft_tokens=draft_tokens, return_hidden=return_hidden)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, backend: MLABackend | None = None, *, draft_tokens: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run a planned step (``run``'s result); ``backend``, ``draft_tokens`` and ``return_hidden`` as in
        ``run``."""
        inputs = self.inputs(plan)
        mode, bs = plan.mode, len(plan.slots)
        if draft_tokens is not None:
            k = self.q_len(mode) - 1
            if mode != ForwardMode.TARGET_VERIFY or tuple(draft_tokens.shape) != (bs, k):
                raise ValueError(f"draft_tokens: expected int64 [{bs}, {k}] drafts of a verify step, got "
                                 f"{tuple(draft_tokens.shape)} for a {mode.value} step")
            inputs.input_ids.view(bs, k + 1)[:, 1:] = draft_tokens
        if not plan.eager and self._graphs is not None and self._graphs.can_replay(mode, bs):
            logits, hidden = self._graphs.replay(inputs.batch, inputs.input_ids, inputs.positions,
                                                 inputs.out_cache_loc)
            # Decode-like steps run the same number of tokens per request; with one, every row is a last row.
            if not (plan.all_logits or self.q_len(mode) == 1):
                logits = logits.index_select(0, inputs.last_token_index)
            return (logits, hidden) if return_hidden else logits
        self.backend.init_forward_metadata(inputs.batch)
        ctx = StepContext(backend=backend or self.backend, cache=self.cache, out_cache_loc=inputs.out_cache_loc)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        last = hidden if plan.all_logits else hidden.index_select(0, inputs.last_token_index)
        logits = self.model.compute_logits(last)
        return (logits, hidden) if return_hidden else logits
