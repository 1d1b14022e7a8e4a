"""MTP speculative decoding: DeepSeek's multi-token-prediction layer drafts k tokens per request, the
target verifies them in one step (``pagedmla.engine.speculative``).

The draft model (``pagedmla.model.mtp``) keeps its own latent cache (``MLADraftBackend``) in the target's
pages: the draft row at position i pairs the target's hidden state at i with token i + 1. Per request and
engine step, with t_m its newest token (position m, no target row yet):

* ``propose``: the first draft d_1 was made by the last draft extend (kept per request slot, with the
  draft's hidden state there); k - 1 draft decodes at positions m .. m + k - 2 chain d_1 .. d_k, each
  feeding its output hidden state and token to the next. Every step's lengths and slots come from the
  host before the first runs; the tokens stay on the device until the verify reads them back with the
  target's.
* the target verifies [t_m, d_1 .. d_k] (TARGET_VERIFY, k + 1 rows per request) and accepts a of the
  drafts plus its own token;
* ``after_step``: a draft extend over the a + 1 accepted positions m .. m + a (DRAFT_EXTEND) with the
  target's hidden states of those rows, rewriting the draft rows the chain wrote there from drafts;
  its last row gives the next d_1. After a prefill chunk the same runs as an EXTEND over the chunk
  (tokens shifted by one: the last row takes the next prompt token, or the token just sampled).

Rows a chain wrote past the accepted length are never read: every later step writes a position before it
reads it, and reads only up to its own length. The extend runs before the scheduler commits the step's
pages to the prefix cache (and before it frees a finishing request's), so a cached page's draft rows are
those of its accepted tokens; a request that reuses cached pages recomputes the last one
(``KVPages.recompute_last_cached_page``), whose last draft row depends on the token after the page.

CUDA graphs (``capture_graphs``): the DRAFT_EXTEND after a verify replays a graph of k + 1 rows per
request (the accepted tokens last, padding ahead of them); the k - 1 draft decodes replay one graph for
all steps ("fused") or one graph per step ("per_step"). Prefill extends run eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from pagedmla.backend import ForwardBatch, ForwardMode
from pagedmla.device import to_device
from pagedmla.draft_backend import MLADraftBackend
from pagedmla.engine.cuda_graph import Graph, cuda_graph_factory
from pagedmla.engine.model_runner import ModelRunner
from pagedmla.engine.scheduler import ScheduledBatch
from pagedmla.engine.sequence import Sequence as Seq
from pagedmla.model.context import StepContext
from pagedmla.model.mtp import DeepseekMTP

# DeepSeek-V3 trains one MTP depth; chained further, one layer's drafts are accepted too rarely to pay for
# the steps (and these are the counts the tests cover).
MAX_DRAFT_TOKENS = 4
DRAFT_GRAPH_MODES = ("fused", "per_step")
# The drafter runs the checkpoint's first MTP layer only (DeepSeek-V3 has one): one draft cache layer.
DRAFT_CACHE_LAYERS = 1


class MTPDrafter:
    """Drafts ``k`` (1 .. MAX_DRAFT_TOKENS) tokens per request with the first layer of ``mtp`` for the
    target of ``runner`` (whose backend is sized for k + 1 verify tokens per request)."""

    def __init__(self, runner: ModelRunner, mtp: DeepseekMTP, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_speculative_tokens: MTP drafts 1..{MAX_DRAFT_TOKENS} tokens, got {k!r}")
        if not isinstance(mtp, DeepseekMTP):
            raise TypeError(f"draft_model: expected a DeepseekMTP, got {type(mtp).__name__}")
        if runner.model.tp.size > 1 or runner.dcp.size > 1:
            raise ValueError(f"draft_model: MTP drafts on one rank; the model runner is tensor-parallel over "
                             f"{runner.model.tp.size} and context-parallel over {runner.dcp.size}")
        target = runner.model.config
        if (mtp.config.hidden_size, mtp.config.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(f"draft_model: its hidden size / vocabulary {mtp.config.hidden_size} / "
                             f"{mtp.config.vocab_size} are not the target's {target.hidden_size} / {target.vocab_size}")
        weight = mtp.layers[0].eh_proj.weight
        if (weight.device, weight.dtype) != (runner.device, runner.dtype):
            raise ValueError(f"draft_model: it is {weight.dtype} on {weight.device}, the target "
                             f"{runner.dtype} on {runner.device}")
        if runner.mla_config.num_draft_tokens != k + 1:
            raise ValueError(f"num_speculative_tokens: the model runner verifies "
                             f"{runner.mla_config.num_draft_tokens} tokens per request, not {k + 1}")
        self.runner = runner
        self.mtp = mtp
        self.k = k
        config = dataclasses.replace(runner.mla_config, num_layers=DRAFT_CACHE_LAYERS, is_draft=True,
                                     num_draft_tokens=k + 1)
        self.backend = MLADraftBackend(config, runner.cache.num_pages, num_steps=k - 1, device=runner.device,
                                       provider=runner.backend.provider)
        slots = runner.table.block_table.shape[0]
        # Per request slot: the first draft token of its next step, and the draft's hidden state it came from.
        self.next_token = torch.zeros(slots, dtype=torch.int64, device=runner.device)
        self.next_hidden = torch.zeros(slots, target.hidden_size, dtype=runner.dtype, device=runner.device)
        self.graphs: DraftGraphRunner | None = None

    # ------------------------------------------------------------------ host-side descriptions
    def _slots(self, seq: Seq, start: int, count: int) -> list[int]:
        """Cache slots of positions start .. start + count - 1 of ``seq`` (the target's slots for them)."""
        ps = self.runner.table.page_size
        pages = self.runner.table.pages[seq.slot]
        return [pages[p // ps] * ps + p % ps for p in range(start, start + count)]

    def _upload(self, *lists: list[int]) -> list[torch.Tensor]:
        """Host int lists as int64 device tensors, in one pinned non-blocking copy."""
        packed = to_device([v for values in lists for v in values], torch.int64, self.runner.device)
        return list(packed.split([len(values) for values in lists]))

    def _keep(self, req: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store each request's next first draft (the argmax of its last row ``hidden``) by slot."""
        tokens = self.mtp.compute_logits(hidden).argmax(dim=-1)
        self.next_token.index_copy_(0, req, tokens)
        self.next_hidden.index_copy_(0, req, hidden)

    # ------------------------------------------------------------------ the draft extend
    @torch.inference_mode()
    def after_step(self, batch: ScheduledBatch, mode: ForwardMode, hidden: torch.Tensor,
                   new_tokens: list[list[int]]) -> None:
        """The draft extend after a target step, before the scheduler post-processes it: ``hidden`` the
        target's final hidden states of the step's tokens (request-major), ``new_tokens`` what each request
        produced (a request with none because it failed is left out)."""
        seqs, starts, counts, tokens, rows = [], [], [], [], []
        if mode == ForwardMode.EXTEND:
            offset = 0
            for i, seq in enumerate(batch.seqs):
                start, n = seq.num_cached_tokens, batch.num_tokens[i]
                end = start + n
                nxt = seq.token_ids[end] if end < len(seq) else (new_tokens[i][0] if new_tokens[i] else None)
                if nxt is not None:
                    seqs.append(seq)
                    starts.append(start)
                    counts.append(n)
                    tokens += seq.token_ids[start + 1:end] + [nxt]
                    rows += range(offset, offset + n)
                offset += n
            draft_mode = ForwardMode.EXTEND
        elif mode == ForwardMode.TARGET_VERIFY:
            width = self.k + 1
            for i, (seq, new) in enumerate(zip(batch.seqs, new_tokens)):
                if new:
                    seqs.append(seq)
                    starts.append(seq.num_cached_tokens)
                    counts.append(len(new))
                    tokens += new
                    rows += range(i * width, i * width + len(new))
            draft_mode = ForwardMode.DRAFT_EXTEND
        else:
            raise ValueError(f"mode: the MTP drafter follows EXTEND and TARGET_VERIFY steps, got {mode}")
        if not seqs:
            return
        slots = [s for seq, start, n in zip(seqs, starts, counts) for s in self._slots(seq, start, n)]
        if draft_mode == ForwardMode.DRAFT_EXTEND and self.graphs is not None and self.graphs.can_replay(len(seqs)):
            self.graphs.replay_extend(seqs, starts, counts, tokens, slots, hidden, rows)
            return
        positions = [p for start, n in zip(starts, counts) for p in range(start, start + n)]
        lens = [start + n for start, n in zip(starts, counts)]
        last = [sum(counts[: i + 1]) - 1 for i in range(len(counts))]
        ids, pos, loc, req, last_row, seq_lens, src = self._upload(
            tokens, positions, slots, [seq.slot for seq in seqs], last, lens, list(rows))
        backend = self.backend.extend
        backend.init_forward_metadata(ForwardBatch(draft_mode, req, seq_lens.to(torch.int32),
                                                   self.runner.table.block_table, seq_lens_cpu=lens,
                                                   extend_seq_lens_cpu=counts, extend_prefix_lens_cpu=starts))
        out = self.mtp(ids, pos, hidden.index_select(0, src), StepContext(backend, self.backend.cache, loc))
        self._keep(req, out.index_select(0, last_row))

    # ------------------------------------------------------------------ the draft decodes
    @torch.inference_mode()
    def propose(self, seqs: Sequence[Seq]) -> torch.Tensor:
        """int64 [bs, k] draft tokens on the device for a verify step of ``seqs`` (each past its prefill,
        with pages for k more tokens)."""
        if self.graphs is not None and self.graphs.can_replay(len(seqs)):
            return self.graphs.replay_chain(seqs)
        steps = self.k - 1
        starts = [len(seq) - 1 for seq in seqs]
        positions = [m + j for j in range(steps) for m in starts]
        slots = [s for j in range(steps) for seq, m in zip(seqs, starts) for s in self._slots(seq, m + j, 1)]
        lens = [m + 1 for m in starts]
        req, pos, loc, seq_lens = self._upload([seq.slot for seq in seqs], positions, slots, lens)
        token, hidden = self.next_token.index_select(0, req), self.next_hidden.index_select(0, req)
        drafts = [token]
        if steps:
            self.backend.init_forward_metadata_steps(ForwardBatch(
                ForwardMode.DECODE, req, seq_lens.to(torch.int32), self.runner.table.block_table, seq_lens_cpu=lens))
            bs = len(seqs)
            for j, backend in enumerate(self.backend.steps):
                ctx = StepContext(backend, self.backend.cache, loc[j * bs:(j + 1) * bs])
                hidden = self.mtp(token, pos[j * bs:(j + 1) * bs], hidden, ctx)
                token = self.mtp.compute_logits(hidden).argmax(dim=-1)
                drafts.append(token)
        return torch.stack(drafts, dim=1)

    def capture_graphs(self, batch_sizes: list[int], graph_factory: Callable[[], Graph] | None = None,
                       mode: str = "fused") -> None:
        """Capture the draft's graphs for ``batch_sizes`` (those of the target's GraphRunner); ``mode``
        "fused" (one graph for the k - 1 draft decodes) or "per_step" (one graph each)."""
        self.graphs = DraftGraphRunner(self, batch_sizes, graph_factory, mode)


class DraftGraphRunner:
    """The MTP drafter's CUDA graphs per batch size: its DRAFT_EXTEND (k + 1 rows per request) and its
    draft decodes (``mode`` "fused" or "per_step"), over static buffers allocated once. A step of ``raw``
    requests replays the graph of the smallest captured size >= raw; padded rows and requests read and
    write only the reserved page 0."""

    def __init__(self, drafter: MTPDrafter, batch_sizes: list[int], graph_factory: Callable[[], Graph] | None,
                 mode: str):
        if mode not in DRAFT_GRAPH_MODES:
            raise ValueError(f"draft_graph: expected one of {DRAFT_GRAPH_MODES}, got {mode!r}")
        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes: expected positive ints, got {batch_sizes!r}")
        runner = drafter.runner
        graph_factory = graph_factory or cuda_graph_factory(runner.device)
        self.drafter = drafter
        self.mode = mode
        self.batch_sizes = sorted(set(batch_sizes))
        k, dev, hidden = drafter.k, runner.device, runner.model.config.hidden_size
        max_bs, width = self.batch_sizes[-1], k + 1
        drafter.backend.init_cuda_graph_state(max_bs)
        self.ext_ids = torch.zeros(max_bs * width, dtype=torch.int64, device=dev)
        self.ext_positions = torch.zeros(max_bs * width, dtype=torch.int64, device=dev)
        self.ext_slots = torch.zeros(max_bs * width, dtype=torch.int64, device=dev)
        self.ext_hidden = torch.zeros(max_bs * width, hidden, dtype=runner.dtype, device=dev)
        self.token = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(max_bs, hidden, dtype=runner.dtype, device=dev)
        self.positions = torch.zeros(max(1, k - 1), max_bs, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(max(1, k - 1), max_bs, dtype=torch.int64, device=dev)
        self.extend_graphs: dict[int, tuple[Graph, tuple[torch.Tensor, torch.Tensor]]] = {}
        # Per batch size: the graphs of the draft decodes (one, or one per step) and the draft tokens out.
        self.chain_graphs: dict[int, tuple[list[Graph], list[torch.Tensor]]] = {}
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):
                self._capture_extend(bs, graph_factory())
                if k > 1:
                    self._capture_chain(bs, graph_factory)

    def can_replay(self, bs: int) -> bool:
        return bs <= self.batch_sizes[-1]

    def _padded(self, raw: int) -> int:
        return next(b for b in self.batch_sizes if b >= raw)

    def _capture_extend(self, bs: int, graph: Graph) -> None:
        d = self.drafter
        n, width = bs * (d.k + 1), d.k + 1
        fill = d.backend.extend.get_cuda_graph_seq_len_fill_value()
        d.backend.init_forward_metadata_capture_cuda_graph(
            bs, torch.zeros(bs, dtype=torch.int64, device=d.runner.device),
            torch.full((bs,), fill, dtype=torch.int32, device=d.runner.device), ForwardMode.DRAFT_EXTEND)
        ctx = StepContext(d.backend.extend, d.backend.cache, self.ext_slots[:n])

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            out = d.mtp(self.ext_ids[:n], self.ext_positions[:n], self.ext_hidden[:n], ctx)
            last = out.view(bs, width, -1)[:, -1]
            return d.mtp.compute_logits(last).argmax(dim=-1), last

        self.extend_graphs[bs] = (graph, graph.capture(step))

    def _capture_chain(self, bs: int, graph_factory: Callable[[], Graph]) -> None:
        d = self.drafter
        fill = d.backend.extend.get_cuda_graph_seq_len_fill_value()
        d.backend.init_forward_metadata_capture_cuda_graph(
            bs, torch.zeros(bs, dtype=torch.int64, device=d.runner.device),
            torch.full((bs,), fill, dtype=torch.int32, device=d.runner.device), ForwardMode.DECODE)
        ctxs = [StepContext(backend, d.backend.cache, self.slots[j, :bs]) for j, backend in enumerate(d.backend.steps)]

        def steps(first: int, last: int, token: torch.Tensor, hidden: torch.Tensor):
            tokens = []
            for j in range(first, last):
                hidden = d.mtp(token, self.positions[j, :bs], hidden, ctxs[j])
                token = d.mtp.compute_logits(hidden).argmax(dim=-1)
                tokens.append(token)
            return torch.stack(tokens, dim=1), hidden

        if self.mode == "fused":
            graph = graph_factory()
            tokens, _ = graph.capture(lambda: steps(0, len(ctxs), self.token[:bs], self.hidden[:bs]))
            self.chain_graphs[bs] = ([graph], [tokens])
            return
        graphs, outputs = [], []
        token, hidden = self.token[:bs], self.hidden[:bs]
        for j in range(len(ctxs)):
            graph = graph_factory()
            # Step j reads step j - 1's static outputs: the graphs chain without copies between them.
            tokens, hidden = graph.capture(lambda j=j, token=token, hidden=hidden: steps(j, j + 1, token, hidden))
            token = tokens[:, 0]
            graphs.append(graph)
            outputs.append(tokens)
        self.chain_graphs[bs] = (graphs, outputs)

    def replay_extend(self, seqs: Sequence[Seq], starts: list[int], counts: list[int], tokens: list[int],
                      slots: list[int], hidden: torch.Tensor, rows: Sequence[int]) -> None:
        """The DRAFT_EXTEND of ``seqs`` (counts[i] tokens from position starts[i]; ``tokens`` / ``slots``
        packed, ``rows`` the rows of ``hidden`` they take) from the graph of the next captured size."""
        d = self.drafter
        raw, width = len(seqs), d.k + 1
        bs = self._padded(raw)
        n = bs * width
        # Request b's tokens are the last counts[b] of its width rows.
        dst = [b * width + width - c + j for b, c in enumerate(counts) for j in range(c)]
        positions = [p for start, c in zip(starts, counts) for p in range(start, start + c)]
        lens = [start + c for start, c in zip(starts, counts)]
        dst_dev, ids, pos, loc, src, req, seq_lens = d._upload(dst, tokens, positions, slots, list(rows),
                                                               [seq.slot for seq in seqs], lens)
        for buf, values in ((self.ext_ids, ids), (self.ext_positions, pos), (self.ext_slots, loc)):
            buf[:n].zero_()
            buf.index_copy_(0, dst_dev, values)
        self.ext_hidden[:n].zero_()
        self.ext_hidden.index_copy_(0, dst_dev, hidden.index_select(0, src))
        d.backend.init_forward_metadata_replay_cuda_graph(bs, req, seq_lens.to(torch.int32), ForwardMode.DRAFT_EXTEND,
                                                          block_table=d.runner.table.block_table, raw_bs=raw)
        graph, (token, last) = self.extend_graphs[bs]
        graph.replay()
        d.next_token.index_copy_(0, req, token[:raw])
        d.next_hidden.index_copy_(0, req, last[:raw])

    def replay_chain(self, seqs: Sequence[Seq]) -> torch.Tensor:
        """``MTPDrafter.propose`` from the graphs of the next captured size."""
        d = self.drafter
        raw, steps = len(seqs), d.k - 1
        bs = self._padded(raw)
        starts = [len(seq) - 1 for seq in seqs]
        positions = [m + j for j in range(steps) for m in starts]
        slots = [s for j in range(steps) for seq, m in zip(seqs, starts) for s in d._slots(seq, m + j, 1)]
        req, pos, loc, seq_lens = d._upload([seq.slot for seq in seqs], positions, slots, [m + 1 for m in starts])
        torch.index_select(d.next_token, 0, req, out=self.token[:raw])
        torch.index_select(d.next_hidden, 0, req, out=self.hidden[:raw])
        first = self.token[:raw].clone()
        if not steps:
            return first[:, None]
        self.token[raw:bs].zero_()
        self.hidden[raw:bs].zero_()
        for buf, values in ((self.positions, pos), (self.slots, loc)):
            buf[:, :bs].zero_()
            buf[:, :raw].copy_(values.view(steps, raw))
        d.backend.init_forward_metadata_replay_cuda_graph(bs, req, seq_lens.to(torch.int32), ForwardMode.DECODE,
                                                          block_table=d.runner.table.block_table, raw_bs=raw)
        graphs, outputs = self.chain_graphs[bs]
        for graph in graphs:
            graph.replay()
        return torch.cat([first[:, None], *(tokens[:raw] for tokens in outputs)], dim=1)
