"""Triton ragged (varlen) attention: FlashAttention-2 style forward over packed sequences.

One program computes a BLOCK_M tile of one sequence's queries for one head, streaming that sequence's
keys/values in BLOCK_N tiles with an online softmax kept in the log2 domain (``exp2`` with log2(e)
folded into the scale); the returned LSE is converted to natural log. The q/k head dim is split into a
power-of-two part and a remainder (192 = 128 + 64, 576 = 512 + 64) so that no MMA work is spent on
padding. Causal masks are bottom-right aligned: query i of a sequence with lq queries and lk keys sees
keys 0 .. i + lk - lq. Key tiles fully below the diagonal run a mask-free loop; only the diagonal and
the ragged tail pay for masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla import checks, errors
from pagedmla.device import triton_interpreting
from pagedmla.kernels.triton.common import (
    INTERPRETER_TILES,
    KEY_INDPTR,
    LOG2E,
    MAX_SEQLEN,
    QUERY_INDPTR,
    PrefillConfig,
    finish_rows,
    indptr_is_partition,
    report,
    store_nan,
)
from pagedmla.kernels.triton.launch import current_stream, unaligned_mask
from pagedmla.kernels.triton.sm90.pipeline import MAX_TILES
from pagedmla.kernels.triton.sm90.varlen import (
    varlen_sm90,
    varlen_sm90_args,
    varlen_sm90_plan,
    varlen_sm90_supported,
)
from pagedmla.kernels.triton.steps import key_scores, load_cols, load_split, softmax_step, store_rows

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def split_head_dim(d: int) -> tuple[int, int]:
    """Split a head dim into (BLOCK_D1, BLOCK_D2): a power-of-two main part (>= 16) and a padded
    power-of-two remainder (0 when none), so that D = 192 becomes 128 + 64 with no padded columns."""
    if d < 1:
        raise ValueError(f"head dim: expected >= 1, got {d}")
    d1 = max(16, 1 << (d.bit_length() - 1))
    rem = d - d1
    d2 = 0 if rem <= 0 else max(16, triton.next_power_of_2(rem))
    return d1, d2


def pow2_dim(d: int) -> int:
    """Smallest power of two >= max(d, 16) (tl.dot needs at least 16 along K)."""
    return max(16, triton.next_power_of_2(d))


def check_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{name}: the triton provider supports float16, bfloat16 and float32, got {t.dtype}")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index rows with strides but read each row as a contiguous vector."""
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q1, q2,
    k_base, v_base, stride_kt, stride_vt,
    lo, hi, offs_m, diag_off, lk, qk_scale,
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online-softmax update over key tiles [lo, hi). MASKED tiles apply the length and causal masks;
    unmasked tiles must lie fully inside the sequence and below the diagonal."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        # The tile start in int64 keeps long sequences (position x row stride > 2^31) addressable; the
        # in-tile offsets stay small enough for int32.
        k_rows = k_base + tl.cast(start_n, tl.int64) * stride_kt + offs_n[:, None] * stride_kt
        v_rows = v_base + tl.cast(start_n, tl.int64) * stride_vt + offs_n[:, None] * stride_vt
        n_ok = n < lk
        s, _ = key_scores(q1, q2, k_rows, n_ok, DK, BLOCK_D1, BLOCK_D2, MASKED, DOT_PREC)
        valid = n_ok[None, :]
        if CAUSAL:
            valid = valid & (n[None, :] <= offs_m[:, None] + diag_off)
        p, alpha, m_new = softmax_step(s, m_i, valid, qk_scale, MASKED)
        v = load_cols(v_rows, 0, BLOCK_DV, n_ok, DV, MASKED)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _varlen_fwd_kernel(
    Q, K, V, O, LSE, cu_q, cu_k, err_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    num_heads, batch, total_q, total_k, max_seqlen_q, qk_scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one sequence and head over the keys they see. Long (~80 lines)
    on purpose, as the decode kernel: the sequence search, guards and key loop share the loop-carried
    state, which a split into helpers would pass through every call."""
    # Tile pid of head h: sequence b owns tiles cu_q[b] // BLOCK_M + b .. (at least its ceil(lq / BLOCK_M)),
    # so total_q // BLOCK_M + batch tiles per head cover any lengths; later tiles (more keys when causal)
    # launch first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, BLOCK_DV)
    local_m = tl.arange(0, BLOCK_M)
    if not indptr_is_partition(cu_q, batch, total_q, tl.arange(0, 1024)):
        # Without a partition of the query rows no row belongs to one sequence: every row is NaN, tile pid
        # covering rows pid * BLOCK_M .. of head h.
        rows = pid.to(tl.int64) * BLOCK_M + local_m
        ok = rows < total_q
        store_nan(O + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], LSE + rows * num_heads + h, ok, dv < DV)
        if (pid == 0) & (h == 0):
            report(err_ptr, QUERY_INDPTR)
        return
    lo = 0
    hi = batch - 1
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go_up = tl.load(cu_q + mid) // BLOCK_M + mid <= pid
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    b = lo
    q_start = tl.load(cu_q + b)
    lq = tl.load(cu_q + b + 1) - q_start
    m0 = (pid - (q_start // BLOCK_M + b)) * BLOCK_M
    if m0 >= lq:
        return
    k_start = tl.load(cu_k + b)
    k_end = tl.load(cu_k + b + 1)
    # A key range outside k, or more queries than max_seqlen_q promised: the sequence's rows are NaN.
    bits = (tl.where((k_start < 0) | (k_end < k_start) | (k_end > total_k), KEY_INDPTR, 0)
            | tl.where(lq > max_seqlen_q, MAX_SEQLEN, 0))
    k_start = tl.where(bits != 0, 0, k_start)
    lk = tl.where(bits != 0, 0, k_end - k_start)
    kvh = h // GROUP

    offs_m = m0 + local_m
    row_ok = offs_m < lq
    row0 = q_start.to(tl.int64) + m0
    q_rows = Q + row0 * stride_qt + h * stride_qh + local_m[:, None] * stride_qt
    q1, q2 = load_split(q_rows, row_ok, DK, BLOCK_D1, BLOCK_D2)
    k_base = K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    diag_off = lk - lq
    if CAUSAL:
        # Tiles wholly visible to the tile's first row need no mask; the rest stop at its last row's limit.
        full_end = (tl.minimum(tl.maximum(m0 + diag_off + 1, 0), lk) // BLOCK_N) * BLOCK_N
        hi = tl.maximum(tl.minimum(lk, tl.minimum(m0 + BLOCK_M, lq) + diag_off), full_end)
    else:
        full_end = (lk // BLOCK_N) * BLOCK_N
        hi = lk
    acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                               0, full_end, offs_m, diag_off, lk, qk_scale,
                               DK, DV, BLOCK_D1, BLOCK_D2, BLOCK_DV, BLOCK_N, False, CAUSAL, DOT_PREC)
    acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                               full_end, hi, offs_m, diag_off, lk, qk_scale,
                               DK, DV, BLOCK_D1, BLOCK_D2, BLOCK_DV, BLOCK_N, True, CAUSAL, DOT_PREC)
    if m0 == 0:
        report(err_ptr, bits)
    # Rows that saw no key: l = 0, acc = 0 -> output 0 and LSE -inf.
    inv_l, lse2 = finish_rows(l_i, m_i, bits != 0)
    store_rows(O + row0 * stride_ot + h * stride_oh + local_m[:, None] * stride_ot, acc, inv_l, lse2,
               LSE, q_start, offs_m, num_heads, h, row_ok, dv, DV)


_FP32_TILES = PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
# 128 x 64 tiles, 8 warps (two warpgroups of 64 query rows), 3 stages: best of the variants measured on the
# H200 for 192/128 (benchmarks/NOTES.md); 256-wide heads drop to 2 stages to fit shared memory.
_TILES = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
_WIDE_TILES = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


def default_config(dk: int, dv: int, dtype: torch.dtype) -> PrefillConfig:
    """The portable kernel's tiles and launch parameters. Under the interpreter small tiles exercise the
    multi-tile and masked paths on small test shapes; on the GPU the H200-tuned shapes (benchmarks/NOTES.md)."""
    if triton_interpreting():
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return _FP32_TILES
    return _TILES if dk + dv <= 384 else _WIDE_TILES


# A non-contiguous q/k/v (the value half of a kv_b_proj output) costs the Hopper kernel a copy of ~512 B per
# key row and head; attention at full speed spends ~Tq x 1.1 ps per key row and head, so below ~512 query
# rows the copy would eat most of the Hopper kernel's gain over the strided portable kernel.
SM90_COPY_MIN_Q = 512


def _use_sm90(config: PrefillConfig | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int,
              batch: int) -> bool:
    if k.shape[0] == 0:  # no keys at all: a TMA descriptor cannot describe an empty tensor
        return False
    if config is not None:
        return config.use_sm90
    if not varlen_sm90_supported(q, k, v):
        return False
    if varlen_sm90_plan(max_seqlen_q, q.shape[0], q.shape[1], batch)[0] >= MAX_TILES:
        return False
    return max_seqlen_q >= SM90_COPY_MIN_Q or all(t.is_contiguous() for t in (q, k, v))


# Bound Hopper launches by call shape (False where binding does not apply: strided inputs are copied per call).
_sm90_bound: dict[tuple, tuple | bool] = {}


def _bind_sm90(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, out, lse):
    """(BoundLaunch, grid, result shapes) of the Hopper launch for calls shaped like this one, when every
    tensor goes to the kernel as it is (contiguous q / k / v rows, cu_seqlens dense), else False."""
    rows = [x.reshape(x.shape[0], -1) for x in (q, k, v)]
    if any(r.stride() != (r.shape[1], 1) for r in rows) or not (cu_seqlens_q.is_contiguous()
                                                                and cu_seqlens_k.is_contiguous()):
        return False
    if len(_sm90_bound) > 1024:
        _sm90_bound.clear()
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    kernel, grid, args, options = varlen_sm90_args(*rows, q.shape[1], k.shape[1], cu_seqlens_q, cu_seqlens_k,
                                                   max_seqlen_q, softmax_scale, causal, out, lse, counter)
    bound = kernel.bind(q.device, grid, *args, **options)
    return False if bound is None else (bound, grid, (q.shape[0], q.shape[1], v.shape[2]))


def _launch_bound(bound, q, k, v, cu_seqlens_q, cu_seqlens_k, out):
    """(out, lse) of a bound launch, or None when q, k or v (the tensor maps' bases) is not 16-byte aligned, or
    q's device is not the current one (the bound launch does not switch devices): the caller then takes the full
    path. The other pointers' alignment is part of the bound launch's key."""
    launch, grid, (tq, h, dv) = bound
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    dev = q.device
    if (qp | kp | vp) & 15 or dev.index != torch.cuda.current_device():
        return None
    cqp, ckp = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    if out is None:
        out = torch.empty(tq, h, dv, dtype=q.dtype, device=dev)
    lse = torch.empty(tq, h, dtype=torch.float32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    ptrs = (out.data_ptr(), lse.data_ptr(), cqp, ckp, counter.data_ptr(), errors.error_word(dev).data_ptr())
    launch.launch(grid, current_stream(dev.index), ptrs, (qp, qp, kp, kp, vp))
    return out, lse


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    out: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention over packed sequences (the ``varlen`` op of the ``triton`` provider).

    q: [Tq, H, Dqk]; k: [Tk, Hk, Dqk]; v: [Tk, Hk, Dv]; H a multiple of Hk; float16/bfloat16/float32.
    cu_seqlens_q/k: int32 [b + 1] on q's device; max_seqlen_q bounds every q length (sizes the grid;
    max_seqlen_k is not needed by the kernel). causal: bottom-right aligned when lengths differ.
    ``out`` [Tq, H, Dv] (q's dtype) receives the output when given. ``config`` (a ``PrefillConfig``,
    benchmarks use it) picks the kernel by its ``use_sm90`` and overrides the portable kernel's tiles.
    Without ``config`` an sm_90 GPU runs the Hopper kernel (``sm90/varlen.py``: bf16/fp16, head dims
    64/128/192 and 64/128) when the inputs are contiguous or the queries long enough to amortise copying
    them. Returns (out [Tq, H, Dv] q.dtype, lse [Tq, H] float32, natural log; rows
    that see no key give 0 and -inf). No host synchronisation. Long for its checks, one per argument with
    its own message, and the bound-launch fast path ahead of them.
    """
    # The Hopper kernel's launch, bound for this call shape by an earlier call (see _bind_sm90).
    key = None if config is not None else (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.get_device(),
        cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_k.shape, cu_seqlens_k.stride(), max_seqlen_q,
        softmax_scale, causal, None if out is None else (out.shape, out.stride(), out.dtype),
        # Triton specialises each pointer on its 16-byte alignment: a slice cu_seqlens[1:] gets its own launch.
        unaligned_mask((cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), 0 if out is None else out.data_ptr())))
    bound = _sm90_bound.get(key)
    if bound:
        result = _launch_bound(bound, q, k, v, cu_seqlens_q, cu_seqlens_k, out)
        if result is not None:
            return result
    softmax_scale = checks.positive_scale(softmax_scale)
    config = PrefillConfig.checked(config)
    check_dtype(q, "q")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q: expected 3-D q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    tq, h, dk = q.shape
    tk, hk, dv = v.shape
    if k.shape != (tk, hk, dk):
        raise ValueError(f"k: expected shape {(tk, hk, dk)}, got {tuple(k.shape)}")
    if hk < 1 or h % hk:
        raise ValueError(f"k: q's {h} heads must be a multiple of k's {hk} heads")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(f"{name}: expected an int32 1-D tensor on {q.device}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError("cu_seqlens_k: expected as many entries as cu_seqlens_q")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q: expected an int >= 0, got {max_seqlen_q!r}")
    if out is None:
        out = torch.empty(tq, h, dv, dtype=q.dtype, device=q.device)
    elif out.shape != (tq, h, dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out: expected {q.dtype} [{tq}, {h}, {dv}] with unit last stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    lse = torch.empty(tq, h, dtype=torch.float32, device=q.device)
    given = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    # The kernel indexes the cumulative lengths as dense arrays (a no-op when they already are).
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    batch = cu_seqlens_q.shape[0] - 1
    if tq == 0:
        return out, lse
    if batch <= 0:
        raise ValueError(f"cu_seqlens_q: no sequences (1 entry) but q has {tq} rows")
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    cfg = default_config(dk, dv, q.dtype) if config is None else config.over(default_config(dk, dv, q.dtype))
    if _use_sm90(config, q, k, v, max_seqlen_q, batch):
        # Bind only from a call that runs on the caller's own tensors, not on copies made above: a later call's
        # addresses stand for this one's, so a launch bound on a copy would read the caller's strided tensor.
        own = all(a is b for a, b in zip(given, (q, k, v, cu_seqlens_q, cu_seqlens_k)))
        if key is not None and key not in _sm90_bound and q.is_cuda and own:
            _sm90_bound[key] = _bind_sm90(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                                              causal, out, lse)
        varlen_sm90(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, out, lse)
        return out, lse
    d1, d2 = split_head_dim(dk)
    grid = (tq // cfg.block_m + batch, h)
    _varlen_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, errors.error_word(q.device),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        h, batch, tq, tk, max_seqlen_q, softmax_scale * LOG2E,
        GROUP=h // hk, DK=dk, DV=dv, BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_DV=pow2_dim(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal), SEARCH_STEPS=max(1, batch.bit_length()),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse

