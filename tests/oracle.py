"""An independent dense float64 oracle for pagedmla's attention ops, and random paged-cache builders.

Nothing here imports ``pagedmla``: the functions are deliberately naive (a Python loop per query token,
explicit max / exp / sum softmax in float64) so that they share no code and no vectorisation trick with
``pagedmla.reference`` or the kernels they judge.

Conventions (those of pagedmla.reference), mirrored exactly:
  * LSE is the natural log of the softmax denominator over *scaled* scores;
  * a query row that sees no key has output 0 and LSE ``-inf``;
  * causal masking is bottom-right aligned: with ``n`` queries over ``L`` keys, query ``i`` is the
    token at position ``L - n + i`` and sees keys ``0 .. L - n + i`` (none when that is negative).

All functions accept tensors on any device and return float64 CPU tensors. They compute on the CPU, except that
a large problem (``_LARGE`` score elements or more, such as FlashMLA's batch-128 test sizes) is computed in
float64 on a CUDA device when one is present: IEEE float64 arithmetic there too, the same naive loop, and a
machine of a few cores would otherwise spend minutes per case.

Public API
  dense_absorbed(q, kv_rows, scale, causal, dv)           one request, absorbed MLA (single latent head)
  dense_paged(q, qo_indptr, rows, scale, causal, dv)      a packed batch of requests (calls dense_absorbed)
  dense_mha(q, k, v, scale, causal)                       one sequence, MHA / GQA
  dense_varlen(q, k, v, cu_q, cu_k, scale, causal)        a packed batch of sequences (calls dense_mha)
  dense_merge(v_a, s_a, v_b, s_b)                         combine two attention states
  make_paged_cache(seq_lens, page_size, D, dtype, ...)    random paged latent cache poisoned with NaN
                                                          (plain or FP8 rows, through a given encoder)
  decode_e4m3(codes)                                      float8_e4m3fn bit patterns to float64, by hand
  decode_fp8_rows(stored, kv_format, k_scale)             stored FP8 cache rows to float64, by hand
  gather_rows(k_cache, block_table, seq_lens)             read a request's rows back through its pages
  merge_inputs(g, T, H, D, dtype, lse_dtype, ...)         two random attention states with empty entries
  assert_attention_close(out, lse, ref_out, ref_lse, ...) the comparison every test uses
  cos_diff(actual, expected)                              FlashMLA's cosine difference (FP8 acceptance)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

F64 = torch.float64
NEG_INF = float("-inf")

# Relative tolerances by input dtype: float64 inputs are computed in float64, float32 in float32.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# ----------------------------------------------------------------------------------------------------
# Dense attention
# ----------------------------------------------------------------------------------------------------

def gen(*key) -> torch.Generator:
    """A CPU generator seeded from a test case's parameters (stable across runs and processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


_LARGE = 1 << 24


def _cpu64(t: torch.Tensor) -> torch.Tensor:
    """Any tensor (any device, any float dtype) as a float64 CPU tensor."""
    return t.detach().to(device="cpu", dtype=F64)


def _compute_device(score_elements: int) -> torch.device:
    """Where a problem with this many score elements is computed (the module docstring's rule)."""
    if score_elements >= _LARGE and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _attend(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [H, m] (already scaled, all visible), values [H, m, dv] or [m, dv] -> out [H, dv], lse [H]."""
    m = scores.max(dim=-1, keepdim=True).values
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1)
    if values.dim() == 2:
        out = (p @ values) / denom.unsqueeze(-1)
    else:
        out = torch.einsum("hm,hmd->hd", p, values) / denom.unsqueeze(-1)
    return out, m.squeeze(-1) + torch.log(denom)


def _visible(L: int, n: int, i: int, causal: bool) -> int:
    """Number of keys (a prefix 0..k-1) that query i of n (the last n of L tokens) sees."""
    if not causal:
        return L
    return max(0, min(L, L - n + i + 1))


def dense_absorbed(q: torch.Tensor, kv_rows: torch.Tensor, scale: float, causal: bool, dv: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of one request over its latent rows, in float64.

    q: [n, H, D] query tokens, the last n tokens of the sequence; kv_rows: [L, D] latent rows (key = the
    whole row, value = its first ``dv`` columns); n may exceed L (early queries then see nothing when
    causal). Returns out [n, H, dv] and lse [n, H] (float64).
    """
    n, H, D = q.shape
    L = kv_rows.shape[0]
    assert kv_rows.dim() == 2 and kv_rows.shape[1] == D, (tuple(kv_rows.shape), D)
    dev = _compute_device(n * H * L)
    q64, kv64 = q.detach().to(dev, F64), kv_rows.detach().to(dev, F64)
    out = torch.zeros(n, H, dv, dtype=F64, device=dev)
    lse = torch.full((n, H), NEG_INF, dtype=F64, device=dev)
    for i in range(n):
        m = _visible(L, n, i, causal)
        if m == 0:
            continue
        keys = kv64[:m]
        scores = (q64[i] @ keys.T) * scale  # [H, m]
        out[i], lse[i] = _attend(scores, keys[:, :dv])
    return out.cpu(), lse.cpu()


def dense_paged(q: torch.Tensor, qo_indptr: Sequence[int], rows: Sequence[torch.Tensor], scale: float,
                causal: bool, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_absorbed over a packed batch: request b owns q rows qo_indptr[b]:qo_indptr[b+1] and KV rows[b].

    Returns out [T, H, dv] and lse [T, H] (float64).
    """
    qo = [int(x) for x in qo_indptr]
    T, H, _ = q.shape
    assert qo[0] == 0 and qo[-1] == T and len(qo) == len(rows) + 1
    out = torch.zeros(T, H, dv, dtype=F64)
    lse = torch.full((T, H), NEG_INF, dtype=F64)
    for b, kv in enumerate(rows):
        if qo[b + 1] > qo[b]:
            out[qo[b]:qo[b + 1]], lse[qo[b]:qo[b + 1]] = dense_absorbed(q[qo[b]:qo[b + 1]], kv, scale, causal, dv)
    return out, lse


def dense_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence: q [n, H, Dqk], k [L, Hk, Dqk], v [L, Hk, Dv]; q head h uses KV head
    h // (H // Hk). Bottom-right causal as everywhere. Returns out [n, H, Dv], lse [n, H] (float64)."""
    n, H, _ = q.shape
    L, Hk, _ = k.shape
    assert H % Hk == 0
    dev = _compute_device(n * H * L)
    kv_head = torch.arange(H, device=dev) // (H // Hk)
    k64 = k.detach().to(dev, F64)[:, kv_head].transpose(0, 1)  # [H, L, Dqk]
    v64 = v.detach().to(dev, F64)[:, kv_head].transpose(0, 1)  # [H, L, Dv]
    q64 = q.detach().to(dev, F64)
    out = torch.zeros(n, H, v.shape[2], dtype=F64, device=dev)
    lse = torch.full((n, H), NEG_INF, dtype=F64, device=dev)
    for i in range(n):
        m = _visible(L, n, i, causal)
        if m == 0:
            continue
        scores = torch.einsum("hd,hmd->hm", q64[i], k64[:, :m]) * scale
        out[i], lse[i] = _attend(scores, v64[:, :m])
    return out.cpu(), lse.cpu()


def dense_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Sequence[int], cu_k: Sequence[int],
                 scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_mha over packed sequences (FlashAttention varlen layout). Returns out [Tq, H, Dv], lse [Tq, H]."""
    cq, ck = [int(x) for x in cu_q], [int(x) for x in cu_k]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=F64)
    lse = torch.full((q.shape[0], q.shape[1]), NEG_INF, dtype=F64)
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            o, s = dense_mha(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], scale, causal)
            out[cq[b]:cq[b + 1]], lse[cq[b]:cq[b + 1]] = o, s
    return out, lse


def dense_merge(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states over disjoint key sets: v [T, H, D], s [T, H] natural-log LSE.

    A state with LSE -inf is empty: its values are ignored (whatever they hold). Two empty states give
    0 and -inf. Computed row by row in float64. Returns (v [T, H, D], s [T, H]).
    """
    v_a, s_a, v_b, s_b = _cpu64(v_a), _cpu64(s_a), _cpu64(v_b), _cpu64(s_b)
    T, H, D = v_a.shape
    out = torch.zeros(T, H, D, dtype=F64)
    lse = torch.full((T, H), NEG_INF, dtype=F64)
    for t in range(T):
        for h in range(H):
            a, b = float(s_a[t, h]), float(s_b[t, h])
            if a == NEG_INF and b == NEG_INF:
                continue
            if b == NEG_INF:
                out[t, h], lse[t, h] = v_a[t, h], a
                continue
            if a == NEG_INF:
                out[t, h], lse[t, h] = v_b[t, h], b
                continue
            m = max(a, b)
            wa, wb = math.exp(a - m), math.exp(b - m)
            out[t, h] = (wa * v_a[t, h] + wb * v_b[t, h]) / (wa + wb)
            lse[t, h] = m + math.log(wa + wb)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# Random paged caches
# ----------------------------------------------------------------------------------------------------

def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bit patterns (uint8, any shape) as float64, from the bits: sign, 4 exponent bits (bias
    7), 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6); S.1111.111 is NaN (no infinities)."""
    b = codes.to(torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).to(F64)
    e, m = (b >> 3) & 15, (b & 7).to(F64)
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(torch.full_like(m, 2.0), (e - 7).to(F64)))
    return torch.where((b & 127) == 127, torch.full_like(mag, float("nan")), sign * mag)


def _le_float(byte_fields: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian IEEE float32 (width 4) or bfloat16 (width 2, the high half of a float32) fields: uint8
    [..., n * width] -> float64 [..., n]."""
    b = byte_fields.to(torch.int64).unflatten(-1, (-1, width))
    word = sum(b[..., i] << (8 * i) for i in range(width)) << (8 * (4 - width))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.view(torch.float32).to(F64)


def decode_fp8_rows(stored: torch.Tensor, kv_format: str, k_scale: float | None = None) -> torch.Tensor:
    """Stored FP8 latent rows to float64 [..., 576 or D], from their bytes (docs/api.md's layouts):
    ``fp8_e4m3``: D float8_e4m3fn values times ``k_scale``; ``fp8_ds_mla``: 656 bytes, 512 float8_e4m3fn
    latent values, 4 little-endian float32 scales (one per 128 values), 64 little-endian bfloat16 rope values."""
    raw = stored.detach().cpu().view(torch.uint8)
    if kv_format == "fp8_e4m3":
        return decode_e4m3(raw) * k_scale
    assert kv_format == "fp8_ds_mla" and raw.shape[-1] == 656, (kv_format, tuple(raw.shape))
    scales = _le_float(raw[..., 512:528], 4)
    latent = decode_e4m3(raw[..., :512]).unflatten(-1, (4, 128)) * scales.unsqueeze(-1)
    return torch.cat([latent.flatten(-2), _le_float(raw[..., 528:], 2)], dim=-1)


class PagedCache(NamedTuple):
    """k_cache [num_pages, page_size, 1, D]; block_table int32 [bs, max_pages]; rows[b] float64 [L_b, D]
    (the exact values stored, upcast); pages[b] the page ids request b reads, in order; poison_pages the
    ids whose every slot is NaN (page 0 and the extra pages)."""

    k_cache: torch.Tensor
    block_table: torch.Tensor
    rows: list
    pages: list
    poison_pages: list


def make_paged_cache(seq_lens: Sequence[int], page_size: int, D: int, dtype: torch.dtype = torch.float32, *,
                     extra_pages: int = 3, max_pages: int | None = None, generator: torch.Generator | None = None,
                     scale: float = 1.0, kv_format: str | None = None, encode=None,
                     k_scale: float | None = None) -> PagedCache:
    """A random paged latent cache holding ``len(seq_lens)`` requests.

    FP8 caches: ``kv_format`` ("fp8_e4m3" or "fp8_ds_mla") with ``encode`` (float64 rows [L, D] -> the stored
    rows [L, width], the quantiser under test); ``rows`` then holds the stored rows decoded here from their
    bytes (``decode_fp8_rows``, with ``k_scale`` for fp8_e4m3), and ``dtype`` is ignored: the cache takes the
    encoder's dtype and width. Poisoned slots are all-0xFF bytes there, NaN in every field of both formats.

    * Page 0 is reserved and, like ``extra_pages`` further pages no request owns, is entirely NaN.
    * Each request gets ceil(L / page_size) pages drawn from a random permutation of the page ids, so
      its pages are scattered and out of order; the slots after its last token are NaN too. Hence any
      read of a slot that is not one of the request's first L tokens poisons the result.
    * block_table is int32 [bs, max_pages] (max_pages defaults to the largest need plus one); entries past
      a request's pages hold random poisoned page ids (0 or one of the extra pages).
    * Values are ``scale * randn`` cast to ``dtype``; ``rows`` holds them back in float64, exactly.

    Returns a PagedCache (unpacks as k_cache, block_table, rows, pages, poison_pages).
    """
    lens = [int(x) for x in seq_lens]
    assert all(x >= 0 for x in lens) and page_size >= 1
    need = [-(-x // page_size) for x in lens]
    width = max(need, default=0) + 1 if max_pages is None else max_pages
    assert width >= max(need, default=0)
    num_pages = 1 + sum(need) + extra_pages
    perm = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
    owned, cursor = [], 0
    for n in need:
        owned.append(perm[cursor:cursor + n])
        cursor += n
    poison = [0] + perm[cursor:]

    if kv_format is None:
        k_cache = torch.full((num_pages, page_size, 1, D), float("nan"), dtype=dtype)
    else:
        probe = encode(torch.zeros(1, D, dtype=F64))
        k_cache = torch.empty((num_pages, page_size, 1, probe.shape[-1]), dtype=probe.dtype)
        k_cache.view(torch.uint8).fill_(0xFF)
    rows, block_table = [], torch.zeros(len(lens), width, dtype=torch.int32)
    slots_of = k_cache.view(-1, k_cache.shape[-1])
    for b, (L, pages) in enumerate(zip(lens, owned)):
        values = torch.randn(L, D, generator=generator, dtype=F64) * scale
        data = values.to(dtype) if kv_format is None else encode(values)
        if L:
            # Token t of the request sits at slot pages[t // page_size] * page_size + t % page_size (one scatter:
            # a copy per page costs seconds on FlashMLA's batch-128 test sizes).
            t = torch.arange(L)
            slots_of[torch.tensor(pages)[t // page_size] * page_size + t % page_size] = data
        rows.append(data.to(F64) if kv_format is None else decode_fp8_rows(data, kv_format, k_scale))
        fill = torch.randint(0, len(poison), (width,), generator=generator)
        block_table[b] = torch.tensor([poison[i] for i in fill.tolist()], dtype=torch.int32)
        if pages:
            block_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return PagedCache(k_cache, block_table, rows, owned, poison)


def gather_rows(k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: Sequence[int]) -> list:
    """Read each request's first L latent rows through its block-table row: float64 [L, D] per request.

    k_cache is the paged view [num_pages, page_size, 1, D] (view a flat [num_slots, 1, D] buffer as that
    first, e.g. ``MLAKVCache.paged_view``). A plain Python loop over tokens, independent of the kernels."""
    assert k_cache.dim() == 4, "pass the paged view [num_pages, page_size, 1, D]"
    page_size = k_cache.shape[1]
    table = block_table.tolist()
    out = []
    for b, L in enumerate(int(x) for x in seq_lens):
        rows = [k_cache[table[b][pos // page_size], pos % page_size, 0] for pos in range(L)]
        out.append(_cpu64(torch.stack(rows)) if rows else torch.zeros(0, k_cache.shape[-1], dtype=F64))
    return out


def merge_inputs(g: torch.Generator, T: int, H: int, D: int, dtype: torch.dtype, lse_dtype: torch.dtype, *,
                 strided_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two random attention states (v_a [T, H, D], s_a [T, H], v_b, s_b) for merge_state.

    Entries are, in random places: a empty, b empty, both empty (LSE -inf), far apart (one side dominates
    completely) or ordinary; an empty state's values are garbage (large, inf or NaN: never-written memory)
    that must not leak into the result. ``strided_lse`` makes s_a a transposed (non-contiguous) view.
    """
    v_a = torch.randn(T, H, D, generator=g, dtype=F64).to(dtype)
    v_b = torch.randn(T, H, D, generator=g, dtype=F64).to(dtype)
    s_a = torch.randn(H, T, generator=g, dtype=F64).T * 4
    s_a = (s_a if strided_lse else s_a.contiguous()).to(lse_dtype)
    s_b = (torch.randn(T, H, generator=g, dtype=F64) * 4).to(lse_dtype)
    kind = (torch.randperm(T * H, generator=g) % 6).reshape(T, H)
    s_a[kind == 0] = NEG_INF
    s_b[kind == 1] = NEG_INF
    s_a[kind == 2] = NEG_INF
    s_b[kind == 2] = NEG_INF
    s_a[kind == 3] += 70.0
    s_b[kind == 4] += 70.0
    for v, s in ((v_a, s_a), (v_b, s_b)):
        junk = torch.randn(int((s == NEG_INF).sum()), D, generator=g, dtype=F64) * 1e3
        junk[::3, 0] = float("nan")
        junk[1::3, -1] = float("inf")
        v[s == NEG_INF] = junk.to(dtype)
    return v_a, s_a, v_b, s_b


# ----------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------

def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the denominator floored at 1e-3); inf if shapes differ."""
    if tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    actual, expected = _cpu64(actual), _cpu64(expected)
    diff = (actual - expected).abs().max().item()
    return diff / max(expected.abs().max().item(), 1e-3)


def cos_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """1 - 2 sum(a e) / (sum(a^2) + sum(e^2)) over every element, in float64 (FlashMLA's tests' measure: 0 for
    equal tensors, about the squared relative error otherwise); 0 for two all-zero tensors, NaN with a NaN."""
    a, e = _cpu64(actual), _cpu64(expected)
    denom = (a * a).sum() + (e * e).sum()
    return 0.0 if denom.item() == 0 else (1 - 2 * (a * e).sum() / denom).item()


def assert_attention_close(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor,
                           ref_lse: torch.Tensor | None, rtol: float, what: str = "") -> None:
    """Check an op's (out, lse) against the oracle.

    out must match shape, be free of NaN/inf and be within ``rtol`` relative (see rel_error); lse must
    be -inf exactly where the oracle's is, finite elsewhere, and within rtol * (1 + |lse|) there.
    """
    tag = f" [{what}]" if what else ""
    assert tuple(out.shape) == tuple(ref_out.shape), f"out shape {tuple(out.shape)} != {tuple(ref_out.shape)}{tag}"
    assert torch.isfinite(_cpu64(out)).all(), f"out has non-finite values{tag}"
    err = rel_error(out, ref_out)
    assert err <= rtol, f"out relative error {err:.3e} > {rtol:.1e}{tag}"
    if lse is None:
        return
    assert ref_lse is not None
    assert tuple(lse.shape) == tuple(ref_lse.shape), f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}{tag}"
    ref_empty = torch.isneginf(_cpu64(ref_lse))
    got_empty = torch.isneginf(_cpu64(lse))
    assert torch.equal(got_empty, ref_empty), f"lse is -inf at {int(got_empty.sum())} rows, oracle at " \
                                              f"{int(ref_empty.sum())}{tag}"
    finite = ~ref_empty
    assert torch.isfinite(_cpu64(lse)[finite]).all(), f"lse has NaN/inf where the oracle is finite{tag}"
    if finite.any():
        a, e = _cpu64(lse)[finite], _cpu64(ref_lse)[finite]
        lerr = ((a - e).abs() / (1 + e.abs())).max().item()
        assert lerr <= rtol, f"lse relative error {lerr:.3e} > {rtol:.1e}{tag}"
