"""Triton merge_state: combine two partial attention results over disjoint key sets.

out = (exp(s_a) v_a + exp(s_b) v_b) / (exp(s_a) + exp(s_b)), s = log(exp(s_a) + exp(s_b)), computed
against the larger LSE so nothing overflows. An empty state contributes nothing, whatever its values hold:
its LSE is -inf (pagedmla) or +inf (FlashMLA's / FlashAttention's empty row), both read as empty; two
empty states give 0 and -inf. A NaN LSE, or a NaN value in a non-empty state, is corruption, never an
empty state: the row's output (and for a NaN LSE its LSE) is NaN, as in ``reference.merge_state``.
Memory bound: each program streams BLOCK_R (token, head) rows of both inputs once and writes one output,
so it may run in place (out aliasing v_a or v_b).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.kernels.triton.varlen import check_dtype, last_dim_contiguous


@triton.jit
def _merge_kernel(
    VA, SA, VB, SB, VO, SO,
    n_rows, num_heads,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_sat, stride_sah, stride_sbt, stride_sbh, stride_sot, stride_soh,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n_rows
    t = (r // num_heads).to(tl.int64)
    h = r % num_heads
    s_a = tl.load(SA + t * stride_sat + h * stride_sah, mask=row_ok, other=float("-inf")).to(tl.float32)
    s_b = tl.load(SB + t * stride_sbt + h * stride_sbh, mask=row_ok, other=float("-inf")).to(tl.float32)
    # Both empty-row conventions (+inf, -inf) read as empty; NaN stays NaN.
    s_a = tl.where(tl.abs(s_a) == float("inf"), float("-inf"), s_a)
    s_b = tl.where(tl.abs(s_b) == float("inf"), float("-inf"), s_b)
    # tl.maximum may return the non-NaN operand: carry NaN explicitly so corruption is never read as empty.
    nan = (s_a != s_a) | (s_b != s_b)
    m = tl.maximum(s_a, s_b)
    empty = (m == float("-inf")) & (~nan)
    m_safe = tl.where(empty | nan, 0.0, m)
    w_a = tl.exp(s_a - m_safe)
    w_b = tl.exp(s_b - m_safe)
    total = w_a + w_b
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    inv = tl.where(nan, float("nan"), inv)
    c_a = w_a * inv
    c_b = w_b * inv
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < D)
    v_a = tl.load(VA + t[:, None] * stride_at + h[:, None] * stride_ah + d[None, :], mask=mask, other=0.0)
    v_b = tl.load(VB + t[:, None] * stride_bt + h[:, None] * stride_bh + d[None, :], mask=mask, other=0.0)
    # Select by emptiness rather than multiply by a zero weight: an empty state's values may be garbage
    # (NaN/inf) and must not leak, while a live state's NaN reaches the output even when its weight
    # underflows to 0.
    part_a = tl.where((s_a == float("-inf"))[:, None], 0.0, v_a.to(tl.float32) * c_a[:, None])
    part_b = tl.where((s_b == float("-inf"))[:, None], 0.0, v_b.to(tl.float32) * c_b[:, None])
    out = part_a + part_b
    tl.store(VO + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(VO.dtype.element_ty), mask=mask)
    s = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    s = tl.where(nan, float("nan"), s)
    tl.store(SO + t * stride_sot + h * stride_soh, s, mask=row_ok)


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (the ``merge`` op of the ``triton`` provider).

    v_a, v_b: [T, H, D] float16/bfloat16/float32 (any strides, the last one unit or copied);
    s_a, s_b: [T, H] float32 natural-log LSE, any strides (transposed views are fine).
    out [T, H, D] (v_a's dtype) and out_lse [T, H] receive the results when given; they may alias
    v_a / s_a (in place). Returns (v, s) with s float32 unless out_lse says otherwise.
    """
    check_dtype(v_a, "v_a")
    if v_b.dtype != v_a.dtype or v_b.shape != v_a.shape or v_a.dim() != 3:
        raise ValueError(f"v_b: expected {v_a.dtype} of 3-D shape {tuple(v_a.shape)}, got {v_b.dtype} "
                         f"{tuple(v_b.shape)}")
    t, h, d = v_a.shape
    for name, s in (("s_a", s_a), ("s_b", s_b)):
        if s.shape != (t, h) or not s.is_floating_point():
            raise ValueError(f"{name}: expected a float tensor of shape {(t, h)}, got {s.dtype} {tuple(s.shape)}")
    if out is None:
        out = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    elif out.shape != v_a.shape or out.dtype != v_a.dtype or out.stride(-1) != 1:
        raise ValueError(f"out: expected {v_a.dtype} {tuple(v_a.shape)} with unit last stride")
    if out_lse is None:
        out_lse = torch.empty(t, h, dtype=torch.float32, device=v_a.device)
    elif out_lse.shape != (t, h):
        raise ValueError(f"out_lse: expected shape {(t, h)}, got {tuple(out_lse.shape)}")
    n_rows = t * h
    if n_rows == 0:
        return out, out_lse
    v_a, v_b = last_dim_contiguous(v_a), last_dim_contiguous(v_b)
    block_d = triton.next_power_of_2(d)
    # About 4K elements per program: enough bytes in flight per SM, few programs for small problems.
    block_r = max(1, min(128, 4096 // block_d))
    _merge_kernel[(triton.cdiv(n_rows, block_r),)](
        v_a, s_a, v_b, s_b, out, out_lse, n_rows, h,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), out.stride(0), out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), out_lse.stride(0), out_lse.stride(1),
        D=d, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )
    return out, out_lse

