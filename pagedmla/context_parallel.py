"""Decode context parallelism (DCP): the latent cache split by token interleave over ``dcp_size`` ranks.

Layout. Token t of a request lives on DCP rank ``t % D`` as that rank's local token ``j = t // D``, at slot
``block_table[req, j // page_size] * page_size + j % page_size`` of that rank's cache: every rank reads the
same block table, and one page holds ``page_size * D`` tokens of the request (``page_size`` on each rank).
A request of S tokens has ``(S + D - 1 - r) // D`` of them on rank r (rank 0 the most). The ranks of a DCP
group are ranks of one tensor-parallel group, each with its own query heads.

Absorbed attention (every DECODE, TARGET_VERIFY, MIXED, DRAFT_EXTEND step and absorbed EXTEND): each rank
gathers the query heads of its DCP group (all-gather), attends with all of them over its own tokens, and
the (out, LSE) partials go back to the heads' owners (all-to-all), which merge them with the ``merge``
op. A causal query sees a different number of local tokens on each rank, which no bottom-right causal mask
expresses, so each query row attends as a one-token request of its own: row i of a request of S tokens
and n new ones sees the first ``S - (n - 1 - i)`` tokens, of which ``(S - (n - 1 - i) + D - 1 - r) // D``
are rank r's. Those lengths are computed on the device. A request whose length is negative or beyond its
block-table row gets length -1 on every row (NaN rows, ``pagedmla.errors``); a NaN partial stays NaN
through the merge, and an empty partial (LSE -inf, no local token) contributes nothing.

Chunked-prefix prefill gathers each prefix chunk's latent rows from the group (all-gather, then reordered
to the tokens' order), after which it runs as on one rank. The MHA forms' new-token attention needs no
other rank: every rank has every new token's latent row in the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedmla.checks import outside_pages, pages_spanned
from pagedmla.config import MLAConfig
from pagedmla.device import to_device
from pagedmla.ops.schedule import get_mla_metadata, num_sm_parts_for, schedule_into
from pagedmla.parallel import Group


@dataclass
class DCPAttention:
    """One step's absorbed attention on one DCP rank: a one-token request per query row.

    seq_lens: int32 [rows] the local tokens each row sees (-1: a bad request); block_table: int32 [rows,
    width] each row's request's pages; tile_scheduler_metadata / num_splits: the decode schedule for
    ``num_dcp_heads`` heads over those lengths; spans: int32 [rows] the block-table pages each row's request
    spans (all of them are its: a page id among them outside the cache makes every row of the request NaN,
    as on one rank, not only the rows whose window reaches it)."""

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor
    spans: torch.Tensor
    # Rows whose request spans a page outside the cache (bool [rows]), computed by the step's first attend, and
    # whether that ran inside a CUDA-graph capture (a value from a warm-up run outside it would not be recorded).
    bad_rows: torch.Tensor | None = None
    bad_rows_captured: bool = False


@dataclass
class _GraphBuffers:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor
    spans: torch.Tensor


class ContextParallel:
    """The DCP side of one MLABackend: rank ``config.dcp_rank`` of ``group`` (``config.dcp_size`` ranks).

    decode_impl / merge_impl: the backend's providers of the ``paged_decode`` and ``merge`` ops."""

    def __init__(self, config: MLAConfig, group: Group, device: torch.device, decode_impl: Callable,
                 merge_impl: Callable):
        self.size = config.dcp_size
        self.rank = config.dcp_rank
        self.group = group
        self.device = device
        self.heads = config.num_dcp_heads
        self.kv_format = config.kv_format  # the schedule's part count follows the cache's kernel
        self.tokens_per_page = config.tokens_per_page
        self.v_dim = config.kv_lora_rank
        self.scale = float(config.softmax_scale)
        self._decode_impl = decode_impl
        self._merge_impl = merge_impl
        self._graph: _GraphBuffers | None = None

    # ------------------------------------------------------------------ planning
    def local_lengths(self, seq_lens: torch.Tensor, back: torch.Tensor | int, width: int) -> torch.Tensor:
        """int32: local tokens seen by query rows of requests of ``seq_lens`` tokens that sit ``back`` rows
        before their request's last one; -1 where the request's length is negative or beyond ``width``
        pages of the block table."""
        lens = seq_lens.to(torch.int64)
        local = (lens - back + (self.size - 1 - self.rank)).clamp(min=0) // self.size
        bad = (lens < 0) | (lens > width * self.tokens_per_page)
        return torch.where(bad, -1, local).to(torch.int32)

    def spans(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """int32: the block-table pages requests of ``seq_lens`` tokens span (0 for a negative length)."""
        return pages_spanned(seq_lens, self.tokens_per_page).to(torch.int32)

    def plan_uniform(self, seq_lens: torch.Tensor, block_table: torch.Tensor, q_len: int) -> DCPAttention:
        """Decode-like steps: ``q_len`` query rows per request (request-major), seq_lens int32 [bs] and
        block_table int32 [bs, width] the requests' own."""
        rows = seq_lens.shape[0] * q_len
        if q_len == 1:
            lens, table, spans = self.local_lengths(seq_lens, 0, block_table.shape[1]), block_table, seq_lens
        else:
            req, back = self._uniform_rows(rows, q_len)
            lens = self.local_lengths(seq_lens[req], back, block_table.shape[1])
            table, spans = block_table.index_select(0, req), seq_lens[req]
        md, ns = get_mla_metadata(lens, self.heads, 1, kv_format=self.kv_format)
        return DCPAttention(lens, table, md, ns, self.spans(spans))

    def plan_ragged(self, seq_lens: torch.Tensor, block_table: torch.Tensor, qo_indptr: torch.Tensor,
                    num_tokens: int) -> DCPAttention:
        """Steps with per-request query counts: request b's rows are ``qo_indptr[b]:qo_indptr[b + 1]``
        (int32 [bs + 1] on the device; ``num_tokens`` their total, known on the host)."""
        bs = seq_lens.shape[0]
        counts = qo_indptr[1:] - qo_indptr[:-1]
        req = torch.repeat_interleave(torch.arange(bs, device=self.device), counts, output_size=num_tokens)
        back = qo_indptr[1:].to(torch.int64)[req] - 1 - torch.arange(num_tokens, device=self.device)
        lens = self.local_lengths(seq_lens[req], back, block_table.shape[1])
        md, ns = get_mla_metadata(lens, self.heads, 1, kv_format=self.kv_format)
        return DCPAttention(lens, block_table.index_select(0, req), md, ns, self.spans(seq_lens[req]))

    def _uniform_rows(self, rows: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request index and rows-before-the-last of each of ``rows`` rows, ``q_len`` per request."""
        index = torch.arange(rows, device=self.device)
        return index // q_len, q_len - 1 - index % q_len

    # ------------------------------------------------------------------ CUDA graphs
    def init_graph_state(self, max_rows: int, max_pages: int) -> None:
        """Buffers for the query rows of captured steps (``max_rows``: max batch size x tokens per request)."""
        parts = num_sm_parts_for(self.device, self.heads, 1, self.kv_format)
        self._graph = _GraphBuffers(
            seq_lens=torch.ones(max_rows, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(max_rows, max_pages, dtype=torch.int32, device=self.device),
            tile_scheduler_metadata=torch.zeros(parts, 8, dtype=torch.int32, device=self.device),
            num_splits=torch.zeros(max_rows + 1, dtype=torch.int32, device=self.device),
            spans=torch.zeros(max_rows, dtype=torch.int32, device=self.device),
        )

    def plan_uniform_into_graph(self, seq_lens: torch.Tensor, block_table: torch.Tensor, q_len: int) -> DCPAttention:
        """``plan_uniform`` written into the graph buffers (the addresses a captured step reads)."""
        g = self._graph
        if g is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        rows = seq_lens.shape[0] * q_len
        if q_len == 1:
            g.seq_lens[:rows].copy_(self.local_lengths(seq_lens, 0, block_table.shape[1]))
            g.spans[:rows].copy_(self.spans(seq_lens))
            table = block_table
        else:
            req, back = self._uniform_rows(rows, q_len)
            g.seq_lens[:rows].copy_(self.local_lengths(seq_lens[req], back, block_table.shape[1]))
            g.spans[:rows].copy_(self.spans(seq_lens[req]))
            table = torch.index_select(block_table, 0, req, out=g.block_table[:rows, : block_table.shape[1]])
        schedule_into(g.seq_lens[:rows], g.tile_scheduler_metadata, g.num_splits[: rows + 1], self.heads,
                      default_plan=True)
        return DCPAttention(g.seq_lens[:rows], table, g.tile_scheduler_metadata, g.num_splits[: rows + 1],
                            g.spans[:rows])

    # ------------------------------------------------------------------ running
    def attend(self, q: torch.Tensor, paged_cache: torch.Tensor, plan: DCPAttention, kv_format: str | None = None,
               k_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, local heads, 576] (this rank's heads) over the whole context -> [T, local heads * 512]; an FP8
        cache's ``kv_format`` and ``k_scale`` as the decode kernels take them.

        All-gather of the group's queries, attention over this rank's tokens, all-to-all of the float32
        (out, LSE) partials to the heads' owners, merged in rank order."""
        t, heads, dim = q.shape
        d = self.size
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if plan.bad_rows is None or plan.bad_rows_captured != capturing:
            # Once a step (its first layer; recorded into a captured graph, which recomputes it on replay).
            plan.bad_rows = outside_pages(plan.block_table, plan.spans, paged_cache.shape[0]).any(1)
            plan.bad_rows_captured = capturing
        queries = self.group.all_gather(q).permute(1, 0, 2, 3).reshape(t, 1, d * heads, dim)
        out, lse = self._decode_impl(queries, paged_cache, plan.block_table, plan.seq_lens, self.v_dim,
                                     plan.tile_scheduler_metadata, plan.num_splits, self.scale, True,
                                     kv_format=kv_format, k_scale=k_scale)
        # Per destination rank j: [its heads' out (t, heads, v) | their LSE (t, heads)], flat.
        out = out.view(t, d, heads, self.v_dim).transpose(0, 1).reshape(d, -1).float()
        lse = lse.view(t, d, heads).transpose(0, 1).reshape(d, -1).float()
        parts = self.group.all_to_all(torch.cat([out, lse], dim=1))
        split = t * heads * self.v_dim
        o, s = parts[0, :split].view(t, heads, self.v_dim), parts[0, split:].view(t, heads)
        for j in range(1, d):
            o, s = self._merge_impl(o, s, parts[j, :split].view(t, heads, self.v_dim), parts[j, split:].view(t, heads),
                                    o, s)
        # Every rank finds the same rows (the same table and lengths): a request's rows, all of them, are NaN.
        return o.masked_fill_(plan.bad_rows.view(t, 1, 1), float("nan")).to(q.dtype).reshape(t, heads * self.v_dim)

    # ------------------------------------------------------------------ chunked prefix
    def prefix_chunk(self, block_table: torch.Tensor, starts: list[int], lens: list[int]) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """One loop of chunked-prefix prefill: request b's prefix tokens ``starts[b] .. starts[b] + lens[b]``.

        Returns (slots int64 [N]: this rank's rows of them, request-major, padded with slot 0 to the most
        any rank holds; index int64 [sum(lens)]: where each token's row lies in the group's gathered
        [D * N] rows, request-major in token order)."""
        d, n = self.size, len(starts)
        # first[r][b]: request b's first token on rank r; count[r][b]: how many it has there.
        first = [[s + (r - s) % d for s in starts] for r in range(d)]
        count = [[max(0, -(-(s + length - f) // d)) for s, length, f in zip(starts, lens, first[r])]
                 for r in range(d)]
        offset = [[sum(c[:b]) for b in range(n)] for c in count]
        width = max(1, max(sum(c) for c in count))
        # One host-to-device copy: [first (d x n) | offset (d x n) | this rank's count (n) | starts | lens].
        host = [v for r in range(d) for v in first[r]] + [v for r in range(d) for v in offset[r]] + \
            count[self.rank] + starts + lens
        packed = to_device(host, torch.int64, self.device)
        first_dev, offset_dev = packed[: d * n].view(d, n), packed[d * n: 2 * d * n].view(d, n)
        count_dev = packed[2 * d * n: 2 * d * n + n]
        starts_dev, lens_dev = packed[2 * d * n + n: 2 * d * n + 2 * n], packed[2 * d * n + 2 * n:]
        rows = torch.arange(n, device=self.device)
        ps = self.tokens_per_page // d
        # This rank's rows: tokens first + d * j of each request (j < count), local tokens first // d + j.
        mine = sum(count[self.rank])
        req = torch.repeat_interleave(rows, count_dev, output_size=mine)
        local = first_dev[self.rank][req] // d + torch.arange(mine, device=self.device) - offset_dev[self.rank][req]
        pages = block_table[req, local // ps].to(torch.int64)
        slots = torch.zeros(width, dtype=torch.int64, device=self.device)
        slots[:mine] = pages * ps + local % ps
        # Every token of the chunk, request-major: its owner rank and place in that rank's rows.
        total = sum(lens)
        cu = torch.cumsum(lens_dev, 0) - lens_dev
        req = torch.repeat_interleave(rows, lens_dev, output_size=total)
        token = starts_dev[req] + torch.arange(total, device=self.device) - cu[req]
        owner = token % d
        index = owner * width + offset_dev[owner, req] + (token - first_dev[owner, req]) // d
        return slots, index

    def gather_rows(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """This rank's gathered prefix rows [N, 576] -> the chunk's rows of every rank, in token order."""
        gathered = self.group.all_gather(rows)
        return gathered.reshape(-1, rows.shape[-1]).index_select(0, index)
