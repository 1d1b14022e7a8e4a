"""Row operations a step runs over indices the device holds, guarded on the device (``pagedmla.errors``).

Each is one Triton launch on CUDA (``kernels/triton/rows.py``) and torch ops elsewhere, with the same result
and the same error bits; none synchronises with the host, so they run inside a step, a CUDA-graph capture
and (through the ``pagedmla::`` custom ops) a ``torch.compile``d forward alike:

- ``store_slots`` / ``gather_slots``: latent rows into / out of a 16-bit cache layer at cache slots; a slot
  outside the layer is never written and reads as a NaN row (``errors.CACHE_SLOT``).
- ``select_requests``: the step's block-table rows and lengths by request slot; a slot outside the table
  gives page-0 rows and length -1 (``errors.REQUEST_SLOT``), which the attention kernels turn into NaN rows.
- ``poison_bad_lengths``: NaN output rows for the requests whose device length the host's plan cannot stand
  for (the backend's MHA forms, which attend over the host lengths).
"""

from __future__ import annotations

import torch

from pagedmla import errors


def live_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Which of ``slots`` (int64 [n]) lie in 0 .. num_slots - 1 (bool [n]); any other sets ``errors.CACHE_SLOT``."""
    ok = (slots >= 0) & (slots < num_slots)
    errors.error_word(slots.device).bitwise_or_((~ok).any().to(torch.int32) * errors.CACHE_SLOT)
    return ok


def store_slots(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[slots[i]] = rows[i] (cast to flat's dtype) for flat [num_slots, D] (a cache layer's rows: 16-bit
    values, or on CPU an FP8 layer's bytes), slots int64 [n], rows [n, D]; a row whose slot is outside the
    layer is dropped."""
    if flat.is_cuda:
        from pagedmla.kernels.triton.rows import store_rows

        store_rows(flat, slots, rows if rows.stride(-1) == 1 else rows.contiguous())
        return
    ok = live_slots(slots, flat.shape[0])
    # A row with a bad slot rewrites slot 0 (the reserved page: no request's data) with what it holds.
    flat.index_copy_(0, torch.where(ok, slots, 0), torch.where(ok.unsqueeze(1), rows.to(flat.dtype), flat[0]))


def gather_slots(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] as a new [n, D] tensor (flat [num_slots, D], slots int64 [n]); a slot outside the layer
    gives a NaN row."""
    if flat.is_cuda:
        from pagedmla.kernels.triton.rows import gather_rows

        return gather_rows(flat, slots)
    ok = live_slots(slots, flat.shape[0])
    return flat.index_select(0, torch.where(ok, slots, 0)).masked_fill(~ok.unsqueeze(1), float("nan"))


def select_requests(table: torch.Tensor, index: torch.Tensor, lens: torch.Tensor, out_table: torch.Tensor,
                    out_lens: torch.Tensor, tokens_per_page: int) -> None:
    """out_table[i] = table[index[i]] and out_lens[i] = lens[i] for the step's requests: table int32 [rows >= 1,
    in_width], index int [n], lens int32 [n], out_table int32 [n, width], out_lens int32 [n]; a block-table page
    holds ``tokens_per_page`` tokens. The first min(width, in_width) columns are copied and any others are page 0
    (a CUDA graph's buffers wider than the engine's table); a length beyond the copied pages (``in_width`` x
    ``tokens_per_page`` at most) becomes ``width`` x ``tokens_per_page`` + 1, beyond the out table too, so that
    the attention kernels give the request NaN rows and ``errors.LENGTH_BEYOND_TABLE`` (not the page-0 columns'
    rows). A request slot outside the table gives page-0 rows and length -1."""
    if table.is_cuda:
        from pagedmla.kernels.triton.rows import select_requests as launch

        launch(table, index, lens, out_table, out_lens, tokens_per_page)
        return
    width = out_table.shape[1]
    in_width = min(width, table.shape[1])
    ok = (index >= 0) & (index < table.shape[0])
    rows = table.index_select(0, torch.where(ok, index, 0).to(torch.int64))[:, :in_width]
    out_table[:, :in_width].copy_(rows.masked_fill(~ok.unsqueeze(1), 0))
    out_table[:, in_width:].zero_()
    lens = torch.where(lens > in_width * tokens_per_page, width * tokens_per_page + 1, lens)
    out_lens.copy_(torch.where(ok, lens, -1))
    errors.error_word(table.device).bitwise_or_((~ok).any().to(torch.int32) * errors.REQUEST_SLOT)


def poison_bad_lengths(out: torch.Tensor, indptr: torch.Tensor, lens: torch.Tensor, planned: torch.Tensor,
                       capacity: int, max_rows: int) -> None:
    """NaN into rows indptr[b] .. indptr[b + 1] - 1 of ``out`` [T, W] for each request b whose device length
    ``lens[b]`` is negative, above ``capacity`` or else differs from ``planned[b]`` (the host's length the
    step's work was planned for), setting ``errors.NEGATIVE_LENGTH``, ``LENGTH_BEYOND_TABLE`` or ``PAGE_LAYOUT``;
    the other rows are not touched. indptr int32 [b + 1], lens and planned int32 [b]; ``max_rows``: the host's
    longest request."""
    if out.is_cuda:
        from pagedmla.kernels.triton.rows import poison_bad_lengths as launch

        launch(out, indptr, lens, planned, capacity, max_rows)
        return
    negative = lens < 0
    beyond = lens > capacity
    mismatch = ~(negative | beyond) & (lens != planned)
    rows = torch.repeat_interleave(negative | beyond | mismatch, indptr.diff(), output_size=out.shape[0])
    out.masked_fill_(rows.unsqueeze(1), float("nan"))
    bits = ((negative.any().to(torch.int32) * errors.NEGATIVE_LENGTH)
            | (beyond.any().to(torch.int32) * errors.LENGTH_BEYOND_TABLE)
            | (mismatch.any().to(torch.int32) * errors.PAGE_LAYOUT))
    errors.error_word(out.device).bitwise_or_(bits)
