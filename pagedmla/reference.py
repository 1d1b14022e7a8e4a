"""The oracle: plain PyTorch attention for every op, in float32 (float64 when given float64).

These functions are the `torch` provider and the yardstick every kernel is tested against. The paged
one is written with static shapes only (no host synchronisation), so it also runs inside a captured
CUDA graph. Conventions: LSE is the natural log of the softmax denominator (scaled scores);
a query row that sees no key returns output 0 and LSE -inf; causal masks are bottom-right aligned; a NaN
score makes its row's output and LSE NaN. Bad index values get the kernels' defined results
(``pagedmla.errors``): nothing is read outside the tensors, and the requests they belong to get NaN rows
(every row, when the query index array is not a partition of the rows).
"""

from __future__ import annotations

import torch

from pagedmla.kv_format import dequantize_latent

# Elements (of the gathered rows and of the scores) one chunk of the paged reference may hold.
_SCORE_BUDGET = 1 << 26


def lse_dtype(t: torch.Tensor) -> torch.dtype:
    """The compute and LSE dtype for inputs of ``t``'s dtype: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _softmax_rows(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim; rows with no valid key give p = 0 and lse = -inf, rows with a NaN
    score give NaN (the corruption propagates instead of passing for an empty row)."""
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    p = torch.where(valid, p, torch.zeros_like(p))
    return p, lse


def _is_partition(indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Whether ``indptr`` starts at 0, never decreases and ends at ``total`` (a 0-d bool tensor: no sync)."""
    ok = (indptr[0] == 0) & (indptr[-1] == total)
    return ok & (indptr[1:] >= indptr[:-1]).all() if indptr.shape[0] > 1 else ok


def _poison(out: torch.Tensor, lse: torch.Tensor, bad_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN into the rows (first dim) of out / lse where ``bad_rows`` (bool [T], or a 0-d bool for all) is set."""
    mask = bad_rows.reshape(-1, *([1] * (lse.dim() - 1))) if bad_rows.dim() else bad_rows
    nan = float("nan")
    return out.masked_fill(mask.unsqueeze(-1), nan), lse.masked_fill(mask, nan)


def paged_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    head_dim_v: int,
    page_size: int,
    kv_format: str | None = None,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of packed query tokens over a paged single-head latent cache.

    q: [T, H, D] with the tokens of request b at rows qo_indptr[b]:qo_indptr[b+1];
    kv_cache: [num_slots, 1, W] or [num_pages, page_size, 1, W] (any page stride); the value is the first
    head_dim_v columns of each row; rows of a float dtype (W = D, kv_format None) or FP8 rows
    (``pagedmla.kv_format``): kv_format "fp8_e4m3" (float8_e4m3fn, W = D, with k_scale float32 [1]) or
    "fp8_ds_mla" (656 bytes); the rows a request reads are dequantised to the compute dtype as gathered;
    block_table: int [bs, max_pages]; seq_lens: int [bs], KV length including this step's tokens;
    qo_indptr: int [bs + 1]. Returns out [T, H, head_dim_v] and lse [T, H] in the compute dtype.
    """
    cdt = lse_dtype(q)
    T, H, D = q.shape
    bs, max_pages = block_table.shape
    dev = q.device
    # [num_pages, page_size, W] without a copy, whatever the page stride (FlashMLA's quantiser pads pages).
    pages = kv_cache.unflatten(0, (-1, page_size))[:, :, 0] if kv_cache.dim() == 3 else kv_cache[:, :, 0]
    num_pages = pages.shape[0]
    out = torch.zeros(T, H, head_dim_v, dtype=cdt, device=dev)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32 if cdt == torch.float32 else cdt, device=dev)
    if T == 0 or bs == 0:
        return out, lse
    qo_indptr = qo_indptr.to(device=dev, dtype=torch.int64)
    rows_ok = _is_partition(qo_indptr, T)
    if num_pages == 0:
        # A cache of 0 pages holds no key: requests of length 0 are empty, any other length is bad.
        tok = torch.arange(T, device=dev)
        req = torch.searchsorted(qo_indptr[1:], tok, right=True).clamp_(max=bs - 1)
        return _poison(out, lse, (seq_lens.to(device=dev) != 0)[req] | ~rows_ok)
    max_kv = max_pages * page_size
    raw_lens = seq_lens.to(device=dev, dtype=torch.int64)
    # Per request: a length outside 0 .. the row's capacity, or a page id outside the cache among the pages
    # it reads, poisons it; the reads use the clamped length and page 0 instead.
    seq_lens = raw_lens.clamp(0, max_kv)
    pages_used = (seq_lens + page_size - 1) // page_size
    used = torch.arange(max_pages, device=dev).unsqueeze(0) < pages_used.unsqueeze(1)
    bad_page = (block_table < 0) | (block_table >= num_pages)
    bad_req = (raw_lens != seq_lens) | (used & bad_page).any(dim=1)
    block_table = torch.where(bad_page, torch.zeros_like(block_table), block_table)
    tok = torch.arange(T, device=dev)
    req = (torch.searchsorted(qo_indptr[1:], tok, right=True)).clamp_(max=bs - 1)
    q_len = (qo_indptr[1:] - qo_indptr[:-1])[req]
    q_idx = tok - qo_indptr[req]
    kv_len = seq_lens[req]
    offsets = torch.arange(page_size, device=dev)
    # Each query row gathers its request's [max_kv, D] rows and scores [H, max_kv]: bound both.
    rows_per_chunk = max(1, _SCORE_BUDGET // max(1, max_kv * max(H, D)))
    for start in range(0, T, rows_per_chunk):
        sl = slice(start, min(T, start + rows_per_chunk))
        r = req[sl]
        slots = (block_table[r].to(torch.int64).unsqueeze(-1) * page_size + offsets).reshape(len(r), max_kv)
        key_pos = torch.arange(max_kv, device=dev)
        valid = key_pos.unsqueeze(0) < kv_len[sl].unsqueeze(1)
        if causal:
            last = kv_len[sl] - q_len[sl] + q_idx[sl]
            valid &= key_pos.unsqueeze(0) <= last.unsqueeze(1)
        # Invalid positions may index unused or poisoned slots: read slot 0 there and zero the rows.
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        kv = _rows_as(pages[slots // page_size, slots % page_size], cdt, kv_format, k_scale)
        kv.masked_fill_(~valid.unsqueeze(-1), 0.0)
        scores = torch.einsum("thd,tkd->thk", q[sl].to(cdt), kv) * softmax_scale
        p, l = _softmax_rows(scores, valid.unsqueeze(1))
        out[sl] = torch.einsum("thk,tkd->thd", p, kv[..., :head_dim_v])
        lse[sl] = l.to(lse.dtype)
    return _poison(out, lse, bad_req[req] | ~rows_ok)


def _rows_as(rows: torch.Tensor, dtype: torch.dtype, kv_format: str | None, k_scale: torch.Tensor | None
             ) -> torch.Tensor:
    """Gathered cache rows [..., W] as values [..., D] of ``dtype`` (FP8 rows dequantised)."""
    if kv_format is None:
        return rows.to(dtype)
    return dequantize_latent(rows, kv_format, k_scale=k_scale, dtype=dtype)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    max_seqlen_q: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention over packed sequences (MHA or GQA; q/k head dim may differ from v's).

    q: [Tq, H, Dqk], k: [Tk, Hk, Dqk], v: [Tk, Hk, Dv] with H a multiple of Hk; sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v.
    Returns out [Tq, H, Dv] and lse [Tq, H] in the compute dtype. Reads the lengths on the host (a
    synchronisation on CUDA: the oracle is not a step-path kernel). A cu_seqlens_q that is not a partition
    of the rows makes every row NaN; a sequence whose key range lies outside k, or longer than
    ``max_seqlen_q`` when given, gets NaN rows.
    """
    cdt = lse_dtype(q)
    Tq, H, _ = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    group = H // Hk
    out = torch.zeros(Tq, H, Dv, dtype=cdt, device=q.device)
    lse = torch.full((Tq, H), float("-inf"), dtype=torch.float32 if cdt == torch.float32 else cdt, device=q.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    if cq[0] != 0 or cq[-1] != Tq or any(b < a for a, b in zip(cq, cq[1:])):
        return out.fill_(float("nan")), lse.fill_(float("nan"))
    Tk = k.shape[0]
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if not 0 <= k0 <= k1 <= Tk or (max_seqlen_q is not None and lq > max_seqlen_q):
            out[q0:q1], lse[q0:q1] = float("nan"), float("nan")
            continue
        qb = q[q0:q1].to(cdt)
        kb = k[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        vb = v[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * softmax_scale
        valid = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            valid = torch.arange(lk, device=q.device).unsqueeze(0) <= (
                torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq))
        p, l = _softmax_rows(scores, valid.unsqueeze(0))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vb)
        lse[q0:q1] = l.transpose(0, 1).to(lse.dtype)
    return out, lse


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets.

    v_*: [T, H, D], s_*: [T, H] natural-log LSE. An empty state contributes nothing, whatever its values
    hold; its LSE is -inf (pagedmla's convention) or +inf (FlashMLA's and FlashAttention's convention for a
    row that saw no key): both read as empty. Two empty states give output 0 and LSE -inf. A NaN LSE, or a
    NaN value in a non-empty state, is corruption and never read as empty: that row's output (and, for a
    NaN LSE, its LSE) is NaN. Returns (v, s) in float32 (float64 for float64 inputs).
    """
    cdt = lse_dtype(v_a)
    s_a = _empty_as_neg_inf(s_a.to(cdt))
    s_b = _empty_as_neg_inf(s_b.to(cdt))
    m = torch.maximum(s_a, s_b)  # NaN if either is NaN
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w_a = torch.exp(s_a - m_safe)
    w_b = torch.exp(s_b - m_safe)
    total = w_a + w_b
    inv = torch.where(empty, torch.zeros_like(total), 1.0 / torch.where(empty, torch.ones_like(total), total))
    zero = torch.zeros((), dtype=cdt, device=v_a.device)
    # Select by emptiness rather than multiply by a zero weight: an empty state's values may be garbage
    # (never-written memory, NaN), while a live state's NaN must reach the output even when its weight
    # underflows to 0 (NaN * 0 is NaN).
    part_a = torch.where(torch.isneginf(s_a).unsqueeze(-1), zero, v_a.to(cdt) * (w_a * inv).unsqueeze(-1))
    part_b = torch.where(torch.isneginf(s_b).unsqueeze(-1), zero, v_b.to(cdt) * (w_b * inv).unsqueeze(-1))
    s = torch.where(empty, m, m_safe + torch.log(torch.where(empty, torch.ones_like(total), total)))
    return part_a + part_b, s


def _empty_as_neg_inf(s: torch.Tensor) -> torch.Tensor:
    """LSE with both empty-row conventions (+inf and -inf) mapped to -inf; NaN and finite values kept."""
    return torch.where(torch.isinf(s), torch.full_like(s, float("-inf")), s)
