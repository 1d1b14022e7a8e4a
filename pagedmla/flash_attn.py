"""FlashAttention's varlen call on pagedmla's kernels: ``from pagedmla.flash_attn import flash_attn_varlen_func``.

Follows FlashAttention 2's ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention v2.x, checked
at commit 0251105a): the positional order ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
return_attn_probs, block_table)``, and accepts as keywords what FlashAttention 3 callers (``hopper/``, vLLM's
and sgl-kernel's builds) pass: ``seqused_k``, ``return_softmax_lse``, ``out``, and the FA3 performance
hints ``num_splits``, ``pack_gqa``, ``sm_margin`` (accepted; they do not change results and pagedmla picks
its own schedule). The kv- and qkv-packed varlen variants are here too.

Conventions are FlashAttention's: LSE ``[nheads, total_q]`` float32 natural log; a query row that sees no
key returns output 0 and LSE **+inf** (pagedmla's native API says -inf). Causal masks are bottom-right
aligned. Returns ``out``; with ``return_attn_probs`` FA2's ``(out, softmax_lse, S_dmask)`` (S_dmask is
None: it only carries a dropout pattern); with ``return_softmax_lse`` (and not ``return_attn_probs``)
``(out, softmax_lse)``.

Rejected with a ValueError naming the argument, never ignored: ``dropout_p > 0``, a local window
(``window_size`` other than ``(-1, -1)``), ``softcap != 0``, ``alibi_slopes``, ``seqused_q``, FA3's ``qv``,
FP8 descales and ``attention_chunk``. ``deterministic`` is accepted: the forward pass is deterministic.

Convenience paths (not a fast path): ``block_table`` (paged K/V: k and v ``[num_blocks, page_block_size,
nheads_k, headdim]``, sequence b's keys are its first L_b tokens through row b of ``block_table``, L_b from
``seqused_k`` or else ``cu_seqlens_k``) and ``seqused_k`` on packed K/V (sequence b uses the first
``seqused_k[b]`` of its rows) gather the used rows into packed K/V first: one host synchronisation for
the lengths and one copy of those rows. Gradients: when q, k or v require grad, the backward pass is
recomputed by pagedmla's float32 torch reference (correct, not fast; there is no backward kernel); the
LSE gets no gradient, as in FlashAttention.
"""

from __future__ import annotations

import math

import torch

from pagedmla import reference
from pagedmla.ops import attention


def _reject(name: str, value, default_ok) -> None:
    if not default_ok:
        raise ValueError(f"{name}: {value!r} is not supported by pagedmla.flash_attn (pass the default)")


def _check_features(dropout_p, window_size, softcap, alibi_slopes) -> None:
    _reject("dropout_p", dropout_p, isinstance(dropout_p, (int, float)) and dropout_p == 0)
    local = window_size is not None and not (
        isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
            not isinstance(w, torch.Tensor) and int(w) < 0 for w in window_size))
    _reject("window_size", window_size, not local)
    _reject("softcap", softcap, isinstance(softcap, (int, float)) and softcap == 0)
    _reject("alibi_slopes", alibi_slopes, alibi_slopes is None)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    out: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
):
    """Ragged attention over packed variable-length sequences, FlashAttention's call (module docstring).

    q: [total_q, nheads, headdim]; k, v: [total_k, nheads_k, headdim(_v)] (or paged with ``block_table``),
    nheads a multiple of nheads_k; cu_seqlens_q / cu_seqlens_k: int32 [b + 1]; max_seqlen_q / max_seqlen_k:
    host ints bounding the lengths; softmax_scale defaults to headdim ** -0.5.
    """
    _check_features(dropout_p, window_size, softcap, alibi_slopes)
    _reject("seqused_q", seqused_q, seqused_q is None)
    _reject("qv", qv, qv is None)
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _reject(name, value, value is None)
    _reject("attention_chunk", attention_chunk, attention_chunk in (0, None))
    if block_table is not None or seqused_k is not None:
        k, v, cu_seqlens_k = _gather_used_keys(k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
    elif cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k: required unless seqused_k or block_table gives the key lengths")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        if out is not None:
            raise ValueError("out: not supported when q, k or v require grad")
        o, lse = _VarlenWithReferenceBackward.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                    max_seqlen_k, softmax_scale, bool(causal))
    else:
        o, lse, _ = attention.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, softmax_scale, causal, True, out=out)
    # FlashAttention's empty row: -inf -> +inf in one in-place pass (NaN kept).
    lse.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=math.inf)
    if return_attn_probs:
        return o, lse, None
    if return_softmax_lse:
        return o, lse
    return o


class _VarlenWithReferenceBackward(torch.autograd.Function):
    """Forward on the provider's kernel; backward by differentiating the float32 reference."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        o, lse, _ = attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, True)
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad():
            o, _ = reference.varlen_attention(*inputs, cu_q, cu_k, ctx.scale, ctx.causal)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(o, wanted, grad_out.to(o.dtype)))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None, None, None)


def _gather_used_keys(k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k):
    """Packed K/V holding only the keys each sequence uses (the convenience paths of the module docstring):
    returns (k [total, nheads_k, d], v [total, nheads_k, dv], cu_seqlens_k int32 [b + 1])."""
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
        raise ValueError("cu_seqlens_q: expected an int32 1-D tensor")
    b = cu_seqlens_q.shape[0] - 1
    dev = cu_seqlens_q.device
    for name, t in (("seqused_k", seqused_k), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != dev):
            raise ValueError(f"{name}: expected an int32 tensor on {dev}")
    if seqused_k is not None:
        if seqused_k.shape != (b,):
            raise ValueError(f"seqused_k: expected shape ({b},), got {tuple(seqused_k.shape)}")
        lens = seqused_k
    elif cu_seqlens_k is not None and cu_seqlens_k.shape == (b + 1,):
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    else:
        raise ValueError(f"cu_seqlens_k: expected shape ({b + 1},) to give the key lengths")
    lens64 = lens.to(torch.int64)
    total = int(lens64.sum()) if b > 0 else 0  # the one host synchronisation of these paths
    if b > 0 and int(lens64.min()) < 0:
        raise ValueError("seqused_k/cu_seqlens_k: key lengths must be >= 0")
    starts = torch.cumsum(lens64, 0) - lens64
    seq = torch.repeat_interleave(torch.arange(b, device=dev), lens64, output_size=total)
    pos = torch.arange(total, device=dev) - starts[seq]
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != b \
                or block_table.dtype != torch.int32:
            raise ValueError(f"block_table: expected an int32 [{b}, max_blocks] tensor")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: with block_table expected [num_blocks, page_block_size, nheads_k, "
                                 f"headdim], got {getattr(t, 'shape', t)}")
        page = k.shape[1]
        if b > 0 and total > 0 and int((lens64 - 1).max()) // page >= block_table.shape[1]:
            raise ValueError(f"block_table: {block_table.shape[1]} blocks of {page} tokens hold fewer keys than "
                             "a sequence uses")
        slots = block_table[seq, pos // page].to(torch.int64) * page + pos % page
        k = k.reshape(-1, *k.shape[2:])
        v = v.reshape(-1, *v.shape[2:])
    else:
        if cu_seqlens_k is None or cu_seqlens_k.shape != (b + 1,):
            raise ValueError(f"cu_seqlens_k: expected shape ({b + 1},) with packed k/v")
        slots = cu_seqlens_k[:-1].to(torch.int64)[seq] + pos
    cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lens64, 0).to(torch.int32)
    return k.index_select(0, slots), v.index_select(0, slots), cu


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FA2's kv-packed varlen call: kv [total_k, 2, nheads_k, headdim] (k, v = kv[:, 0], kv[:, 1])."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv: expected [total_k, 2, nheads_k, headdim], got {getattr(kv, 'shape', kv)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """FA2's qkv-packed varlen call: qkv [total, 3, nheads, headdim], one cu_seqlens for q and k."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv: expected [total, 3, nheads, headdim], got {getattr(qkv, 'shape', qkv)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
