"""Hopper (sm_90a) ragged attention in Gluon: FlashAttention-3's warp-specialised structure for packed
variable-length batches (the ``varlen`` op), written for q/k head dim 192 (128 + 64) or 64/128 and value
head dim 64/128.

Work tiles are 128 query rows of one sequence and one head. The kernel is persistent: one program per SM,
whose 1-warp loader partition takes tiles from a global counter and hands each tile to the consumers through
shared memory. Two ways to number the tiles (``varlen_sm90_plan`` picks one per call):
- every sequence gets the longest one's ``ceil(max_seqlen_q / 128)`` row tiles per head, those past its own
  length empty, numbered sequence, head, row tiles heaviest first; the hand-off carries the tile id, from
  which each partition computes the bounds. The loader takes them in that order (the tiles in flight read
  few heads' K/V, which stays in L2) up to the last few pairs (``tail_window``), whose row tiles it takes
  heaviest first across those pairs, so that a causal launch ends on light tiles and the SMs finish
  together: a pair at a time, the last pair's heaviest tile started among the launch's last claims;
- sequence b gets ``cu_q[b+1] // 128 - cu_q[b] // 128 + 1`` row tiles per head (at least its own
  ``ceil(lq / 128)``), so the tiles before it, ``(cu_q[b] // 128 + b) * H``, need no prefix sum and a
  launch has ``(Tq // 128 + batch) * H`` tiles, taken sequence, head, row tiles heaviest first; the loader
  finds a tile's sequence by binary search over ``cu_seqlens_q`` and hands over its bounds. For one long
  prompt among many short ones the first numbering would hand out mostly empty tiles, one atomic and one
  hand-off each (2.3-3.7x slower on such batches, benchmarks/NOTES.md); on equal lengths the second was
  2-6% slower (its search sits between two tiles).
Per tile the loader streams Q and the sequence's K and V in 128-key tiles through two two-stage shared-memory
rings (K and V separately, with TMA, each K tile before the previous V tile), and the next tile's Q and first
keys while the consumers finish the current one. Two consumer warpgroups each own 64 query rows (their
S = Q K^T, online softmax, P kept in registers as the A operand of O += P V). Within a warpgroup, S of key
tile j is issued before P V of key tile j - 1 and the softmax of tile j runs while that P V is on the tensor
cores (FA3's intra-warpgroup overlap); a K slot is freed as soon as its S is done, so the split rings keep the
loader a tile ahead. The consumers come in two forms, chosen per call by ``max_seqlen_q`` against
``CTA_SEQLEN`` (a ``CTA`` constexpr, so two compiled kernels):
- prompts of 129-1536 tokens: both warpgroups in one 8-warp partition running one copy of the code, Q
  loaded as one 128-row box, and FA3's inter-warpgroup ping-pong (named barriers hand the tensor cores from
  one warpgroup's S and P V issue to the other's, so one's softmax runs under the other's MMAs). With a
  partition per warpgroup the two copies of the consumer code did not fit the SM's instruction cache
  together, which short prompts pay for on every tile (benchmarks/NOTES.md, Prefill v12-v14);
- longer prompts and those of one tile: a partition per warpgroup, each warpgroup's half of Q loaded as soon
  as that warpgroup's last S is done (warpgroup 0's half and the first K tile before warpgroup 1's half), a
  half past the sequence's end skipped; the warpgroups share every K/V tile but are otherwise independent,
  so one's softmax overlaps the other's MMAs without turns.
A key tile that runs past a sequence's end holds the next sequence's rows, spare rows of the caller's buffer
(anything, NaN included) or TMA's zero fill: their scores are masked, and each warpgroup zeroes those value
rows in shared memory before its P V (0 * NaN would poison the output). A tile's output goes out through its
last value slot (both warpgroups' P V done with it, each writing its 64 rows there and reading them back as
whole rows) so that it is stored in 128-byte lines: from the MMA layout every store instruction wrote 4-byte
pieces of 8 rows, and at 128-token prompts those partial sectors held the L2 at 88% of its throughput with
DRAM at 66% (benchmarks/NOTES.md, Prefill v10).

``varlen_attention`` runs it by default where ``varlen_sm90_supported`` accepts a call (it was the faster
kernel on the H200: benchmarks/NOTES.md, Prefill); ``PrefillConfig(use_sm90=False)`` asks for the portable one.
"""

from __future__ import annotations

import re

import torch

from pagedmla import errors
from pagedmla.device import sm90_available, sm_count
from pagedmla.kernels.triton.common import (
    _LN2,
    KEY_INDPTR,
    LOG2E,
    MAX_SEQLEN,
    QUERY_INDPTR,
    finish_rows,
    indptr_is_partition,
    report,
)
from pagedmla.kernels.triton.launch import CachedKernel
from pagedmla.kernels.triton.sm90.pipeline import HAVE_GLUON, MAX_TILES, descriptor, shared_layout, tma_rows

# The consumer partition's barrier as Triton 3.6 writes it before an mbarrier wait, and the label comment of
# the basic block it sits in (LLVM's loop-depth note).
_WAIT_BARRIER = re.compile(r"\tbar\.sync \t0, 256;\n(?=\t// begin inline asm\n\t\n\{\n\t\.reg \.pred complete;\n"
                           r"\twaitLoop:\n\tmbarrier\.try_wait)")


def key_loop_wait_barriers(ptx: str) -> list[re.Match]:
    """The consumer partition's barriers (``_WAIT_BARRIER``) in ``ptx`` that sit in a basic block at loop
    depth 2, the key loop (LLVM's label comment on each block names its depth)."""
    found = []
    for m in _WAIT_BARRIER.finditer(ptx):
        head = ptx[:m.start()]
        label = head[max(head.rfind("\n$L__BB"), head.rfind("\n// %bb")) + 1:].split("\n", 1)[0]
        if "Depth=2" in label:
            found.append(m)
    return found


def drop_key_loop_barrier(ptx: str) -> str:
    """``ptx`` without the partition barrier that Triton 3.6 puts before the K wait of every key-loop
    iteration of the 8-warp consumer, or ``ptx`` unchanged unless exactly one such barrier is found.

    Why it may go: its shared-memory analysis syncs all 8 warps after a wgmma wait, which only waits for the
    issuing warpgroup's MMAs (upstream Triton now marks such waits warpgroup-local), so every key tile held
    each warpgroup until the other caught up: long prompts 16-19% slower on the H200. Nothing in the loop
    needs it: the loop writes no shared memory but the K / V releases, each thread's own arrival after its
    own warpgroup's wait (``_release``, counts of 256), and every thread waits for the TMA fills itself."""
    drop = key_loop_wait_barriers(ptx)
    if len(drop) != 1:
        return ptx
    return ptx[:drop[0].start()] + ptx[drop[0].end():]


if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from pagedmla.kernels.triton.sm90.pipeline import (
        WARPGROUP,
        claim_tile,
        free_phase,
        online_softmax,
        phase,
        receive_fields,
        receive_slot,
        release_staged,
        restage,
        zero_tail_rows,
    )

BLOCK_M = 128  # query rows per program: two warpgroups of 64
BLOCK_N = 128  # keys per tile
# Calls with lo < max_seqlen_q <= hi run the one-partition consumer, others a partition per warpgroup (module
# docstring). On the H200 the first was 4-16% faster at 512-1024 tokens, 0.5% slower at 2048 and 2-4% slower
# from 4096 (benchmarks/NOTES.md, Prefill v13); at 128 tokens and below, where a sequence fills at most one
# tile, 0.5-2.5% slower, and 25% at 64 (its 128 rows computed whole, where each warpgroup of the other form
# skips a half past the sequence's end; Prefill v14). The switches sit between the measured lengths.
CTA_SEQLEN = (128, 1536)
if HAVE_GLUON:
    _WM = gl.constexpr(64)
    _BM = gl.constexpr(BLOCK_M)
    # The one-partition consumer's 8 warps, a lane each (reads of hand-off slots and of cu_seqlens_q).
    _CONSUMERS = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0]))
    _CONSUMER_THREADS = gl.constexpr(256)
    _BN = gl.constexpr(BLOCK_N)
    _STAGES = gl.constexpr(2)


def tile_counts(max_seqlen_q: int, total_q: int, heads: int, batch: int) -> tuple[int, int]:
    """Work tiles of a launch over ``total_q`` packed query rows in each numbering (module docstring):
    (padded, per-sequence)."""
    return -(-max_seqlen_q // BLOCK_M) * heads * batch, (total_q // BLOCK_M + batch) * heads


def varlen_sm90_plan(max_seqlen_q: int, total_q: int, heads: int, batch: int) -> tuple[int, bool]:
    """(work tiles, per-sequence numbering) of a launch over ``total_q`` packed query rows (see the module
    docstring): the per-sequence numbering once more than half of the longest-sequence grid would be empty
    tiles, where their hand-offs cost more than the per-sequence numbering's search between tiles."""
    padded, per_sequence = tile_counts(max_seqlen_q, total_q, heads, batch)
    # (max_seqlen_q 0 with rows to write: only the per-sequence numbering has tiles for them.)
    if padded > 2 * per_sequence or padded == 0:
        return per_sequence, True
    return padded, False


# The padded causal order's last window (module docstring, ``tail_window``): at most this many bytes of K/V
# and this many rounds of tiles over the programs.
TAIL_WINDOW_BYTES = 8 << 20
TAIL_WINDOW_ROUNDS = 3


def tail_window(heads: int, kv_heads: int, batch: int, keys: int, dk: int, dv: int, itemsize: int, causal: bool,
                row_tiles: int, programs: int) -> int:
    """(sequence, head) pairs of the padded order's last window: enough for ``TAIL_WINDOW_ROUNDS`` tiles per
    program (``row_tiles`` per pair) where their K and V (``keys`` key rows over the batch, ``dk + dv`` wide,
    one K/V head per heads // kv_heads query heads) fit in ``TAIL_WINDOW_BYTES``; 1 (no window) without a
    causal mask, whose row tiles are all alike."""
    pair_bytes = -(-keys // max(batch, 1)) * (dk + dv) * itemsize * kv_heads // heads
    if not causal or pair_bytes == 0 or row_tiles < 2:
        return 1
    rounds = -(-TAIL_WINDOW_ROUNDS * programs // row_tiles)
    return max(1, min(heads * batch, TAIL_WINDOW_BYTES // pair_bytes, rounds))


def varlen_sm90_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Gluon kernel can run this call: an sm_90 GPU, bf16/fp16, q/k head dim 64, 128 or 192,
    value head dim 64 or 128. The launcher copies inputs that are not contiguous with 16-byte aligned bases."""
    if not sm90_available(q.device):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] in (64, 128, 192) and v.shape[-1] in (64, 128))


if HAVE_GLUON:

    @gluon.jit
    def _sequence_keys(cu_k, b, lq, Tk, MAXQ):
        """(first key row, key count, error bits) of sequence b: a key range outside k, or more queries than
        max_seqlen_q promised, gives no keys (nothing is loaded) and the bits that poison its rows. The loader
        and the consumers call it alike, so they agree on the tiles they stream."""
        k_start = gl.load(cu_k + b)
        k_end = gl.load(cu_k + b + 1)
        bits = (gl.where((k_start < 0) | (k_end < k_start) | (k_end > Tk), KEY_INDPTR, 0)
                | gl.where(lq > MAXQ, MAX_SEQLEN, 0))
        return gl.where(bits != 0, 0, k_start), gl.where(bits != 0, 0, k_end - k_start), bits

    @gluon.jit
    def _tile_bounds(t, NM, H, cu_q, cu_k, Tk, MAXQ, CAUSAL: gl.constexpr):
        """Tile t of the launch order (sequence-major, then head, then row tiles heaviest first): (head,
        q_start, lq, m0, k_start, lk, diagonal offset lk - lq, end of the keys any row of the tile sees, error
        bits of the sequence)."""
        grp = t // NM
        m0 = (NM - 1 - t % NM) * (2 * _WM)
        b = grp // H
        q_start = gl.load(cu_q + b)
        lq = gl.load(cu_q + b + 1) - q_start
        k_start, lk, bits = _sequence_keys(cu_k, b, lq, Tk, MAXQ)
        diag = lk - lq
        if CAUSAL:
            hi = gl.maximum(gl.minimum(lk, gl.minimum(m0 + 2 * _WM, lq) + diag), 0)
        else:
            hi = lk
        return grp % H, q_start, lq, m0, k_start, lk, diag, hi, bits

    @gluon.jit
    def _windowed(c, NM, WIN, pairs):
        """The padded numbering's id of the c-th claim: a (sequence, head) pair at a time, its row tiles
        heaviest first, until the last WIN pairs, which are taken a row-tile level at a time (heaviest first)
        across all WIN of them."""
        head = (pairs - WIN) * NM
        r = c - head
        level = r // WIN
        return gl.where(c < head, c, (pairs - WIN + r - level * WIN) * NM + level)

    @gluon.jit
    def _tile_count(cu_q, H, batch):
        """Work tiles of a per-sequence launch (``varlen_sm90_plan`` of the rows the sequences use)."""
        return (gl.load(cu_q + batch) // (2 * _WM) + batch) * H

    @gluon.jit
    def _tile_of(t, cu_q, cu_k, H, batch, Tk, MAXQ, SEARCH_STEPS: gl.constexpr):
        """Tile t of the per-sequence numbering (sequence-major, then head, then row tiles heaviest first):
        (head, q_start, lq, m0, k_start, lk, error bits). Sequence b's tiles start at (cu_q[b] // 128 + b) * H,
        an increasing function of b: binary search."""
        lo = t * 0
        hi = lo + batch - 1
        for _ in gl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            go_up = (gl.load(cu_q + mid) // (2 * _WM) + mid) * H <= t
            lo = gl.where(go_up, mid, lo)
            hi = gl.where(go_up, hi, mid - 1)
        q_start = gl.load(cu_q + lo)
        q_end = gl.load(cu_q + lo + 1)
        nm = q_end // (2 * _WM) - q_start // (2 * _WM) + 1
        rem = t - (q_start // (2 * _WM) + lo) * H
        k_start, lk, bits = _sequence_keys(cu_k, lo, q_end - q_start, Tk, MAXQ)
        return rem // nm, q_start, q_end - q_start, (nm - 1 - rem % nm) * (2 * _WM), k_start, lk, bits

    @gluon.jit
    def _tile_end(lq, m0, lk, CAUSAL: gl.constexpr):
        """End of the keys any row m0 .. m0 + 127 of a sequence with lq queries and lk keys sees."""
        if CAUSAL:
            return gl.maximum(gl.minimum(lk, gl.minimum(m0 + 2 * _WM, lq) + lk - lq), 0)
        else:
            return lk

    @gluon.jit
    def _claim_tile_info(counter, tile_ids, s, T, cu_q, cu_k, H, batch, Tk, MAXQ, SEARCH_STEPS: gl.constexpr):
        """Loader: claim the next per-sequence tile that holds query rows and publish its bounds in hand-off
        slot ``s``; returns (id, head, q_start, lq, m0, k_start, lk). The numbering gives a sequence and head
        up to one tile past its rows (``varlen_sm90_plan``): those are claimed again here instead of handed
        over, since each hand-off is a round trip the consumers wait on (one long prompt among 63 short ones
        had 4096 of 16256 tiles empty). Past the last tile the search still reads inside cu_q / cu_k (the
        consumers then only look at the id)."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        t = claim_tile(counter, tile_ids, s)
        h, q_start, lq, m0, k_start, lk, bits = _tile_of(t, cu_q, cu_k, H, batch, Tk, MAXQ, SEARCH_STEPS)
        while (t < T) & (m0 >= lq):
            t = claim_tile(counter, tile_ids, s)
            h, q_start, lq, m0, k_start, lk, bits = _tile_of(t, cu_q, cu_k, H, batch, Tk, MAXQ, SEARCH_STEPS)
        idx = gl.arange(0, 8, layout=one)
        tile_ids.index(s).store(gl.where(idx == 0, t, gl.where(idx == 1, h, gl.where(idx == 2, q_start, gl.where(
            idx == 3, lq, gl.where(idx == 4, m0, gl.where(idx == 5, lk, bits)))))))
        gl.thread_barrier()
        return t, h, q_start, lq, m0, k_start, lk

    @gluon.jit
    def _receive_work(i, tile_ids, tile_ready, tile_free, layout: gl.constexpr, PER_SEQ: gl.constexpr):
        """Consumer side of the tile hand-off, read by every thread of ``layout``: (the id of the loader's i-th
        tile, the fields ``_work_bounds`` takes): with the per-sequence numbering the loader published the
        tile's (id, head, q_start, lq, m0, lk, error bits), with the padded one only its id."""
        if PER_SEQ:
            fields = receive_fields(i, tile_ids, tile_ready, tile_free, layout)
            return fields[0], fields
        else:
            t = gl.max(receive_slot(i, tile_ids, tile_ready, tile_free, layout), axis=0)
            return t, (t,)

    @gluon.jit
    def _work_bounds(t, fields, NM, H, cu_q, cu_k, Tk, MAXQ, CAUSAL: gl.constexpr, PER_SEQ: gl.constexpr):
        """A received tile t < T as (head, q_start, lq, m0, lk, diagonal offset lk - lq, end of the keys any
        row of the tile sees, error bits): from the loader's fields (per-sequence numbering) or computed from
        the id (padded numbering, only for ids below the count: ``_tile_bounds`` loads the sequence's bounds)."""
        if PER_SEQ:
            _, h, q_start, lq, m0, lk, bits = fields
            return h, q_start, lq, m0, lk, lk - lq, _tile_end(lq, m0, lk, CAUSAL), bits
        else:
            h, q_start, lq, m0, _, lk, diag, hi, bits = _tile_bounds(t, NM, H, cu_q, cu_k, Tk, MAXQ, CAUSAL)
            return h, q_start, lq, m0, lk, diag, hi, bits

    @gluon.jit
    def _load_q(q_desc, q_pe_desc, q_smem, q_pe_smem, q_ready, q_free, nq, row, q_col, DK1: gl.constexpr,
                DK2: gl.constexpr):
        """A tile's 128 query rows, once the previous tile's last S is done (the nq-th load)."""
        mbarrier.wait(q_free, free_phase(nq, 1))
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q_pe_desc.block_type.nbytes if DK2 > 0 else 0)
        mbarrier.expect(q_ready, q_bytes)
        tma.async_copy_global_to_shared(q_desc, [row, q_col], q_ready, q_smem)
        if DK2 > 0:
            tma.async_copy_global_to_shared(q_pe_desc, [row, q_col + DK1], q_ready, q_pe_smem)

    @gluon.jit
    def _load_q_half(q_desc, q_pe_desc, q_smem, q_pe_smem, q_ready, q_free, nq, row0, q_col, W: gl.constexpr,
                     DK1: gl.constexpr, DK2: gl.constexpr):
        """Warpgroup W's 64 query rows of a tile, once its previous tile's last S is done (the nq-th load)."""
        mbarrier.wait(q_free.index(W), free_phase(nq, 1))
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q_pe_desc.block_type.nbytes if DK2 > 0 else 0)
        ready = q_ready.index(W)
        mbarrier.expect(ready, q_bytes)
        row = row0 + W * _WM
        tma.async_copy_global_to_shared(q_desc, [row, q_col], ready, q_smem.index(W))
        if DK2 > 0:
            tma.async_copy_global_to_shared(q_pe_desc, [row, q_col + DK1], ready, q_pe_smem.index(W))

    @gluon.jit
    def _varlen_loader(q_desc, q_pe_desc, k_desc, k_pe_desc, v_desc, cu_q, cu_k, counter, GROUP, H, NM, WIN, T,
                       batch, Tq, Tk, MAXQ, q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids, tile_ready,
                       tile_free, q_ready, q_free, k_ready, k_empty, v_ready, v_empty,
                       DK1: gl.constexpr, DK2: gl.constexpr, CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                       PER_SEQ: gl.constexpr, CTA: gl.constexpr):
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        if PER_SEQ:
            T = _tile_count(cu_q, H, batch)
        # Without a partition of the q rows there is no work tile: the consumers poison every row.
        T = gl.where(indptr_is_partition(cu_q, batch, Tq, gl.arange(0, 32, layout=one)), T, 0)
        i = 0
        nq = 0
        base = 0  # ring position: K/V tiles issued for earlier work tiles
        t = 0
        while t < T:
            # Tiles are claimed from a global counter in launch order (module docstring): the tiles in flight
            # read few heads' K/V (it stays in L2), the heaviest causal tiles go first.
            s = i % 2
            mbarrier.wait(tile_free.index(s), free_phase(i, 2))
            if PER_SEQ:
                t, h, q_start, lq, m0, k_start, lk = _claim_tile_info(counter, tile_ids, s, T, cu_q, cu_k, H, batch,
                                                                      Tk, MAXQ, SEARCH_STEPS)
            else:
                t = claim_tile(counter, tile_ids, s)
                if (t < T) & (WIN > 1):
                    t = _windowed(t, NM, WIN, H * batch)
                    gl.thread_barrier()  # every lane has read the claim from the slot before it is overwritten
                    tile_ids.index(s).store(gl.full([1], t, gl.int32, one))
                    gl.thread_barrier()
            mbarrier.arrive(tile_ready.index(s), count=1)
            i += 1
            if t < T:
                if PER_SEQ:
                    hi = _tile_end(lq, m0, lk, CAUSAL)
                else:
                    h, q_start, lq, m0, k_start, _, _, hi, _ = _tile_bounds(t, NM, H, cu_q, cu_k, Tk, MAXQ, CAUSAL)
                if m0 < lq:
                    q_col = h * (DK1 + DK2)
                    # Warpgroup 0's half of Q, then the first K tile, then warpgroup 1's half: each half waits
                    # only for its own warpgroup's last S of the previous tile, so the warpgroup that finishes
                    # first starts the next tile without waiting for the other.
                    if CTA:
                        _load_q(q_desc, q_pe_desc, q_smem, q_pe_smem, q_ready.index(0), q_free.index(0), nq,
                                q_start + m0, q_col, DK1, DK2)
                        nq += 1
                    else:
                        _load_q_half(q_desc, q_pe_desc, q_smem, q_pe_smem, q_ready, q_free, nq, q_start + m0, q_col,
                                     0, DK1, DK2)
                    kh = h // GROUP
                    k_col = kh * (DK1 + DK2)
                    v_col = kh * v_desc.block_type.shape[1]
                    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (k_pe_desc.block_type.nbytes if DK2 > 0 else 0)
                    n_tiles = gl.cdiv(hi, _BN)
                    # K of tile j goes out before V of tile j - 1, the order the consumers use them in.
                    for j in range(0, n_tiles + 1):
                        if j < n_tiles:
                            c = base + j
                            s = c % _STAGES
                            mbarrier.wait(k_empty.index(s), free_phase(c, _STAGES))
                            ready = k_ready.index(s)
                            mbarrier.expect(ready, k_bytes)
                            tma.async_copy_global_to_shared(k_desc, [k_start + j * _BN, k_col], ready, k_ring.index(s))
                            if DK2 > 0:
                                tma.async_copy_global_to_shared(k_pe_desc, [k_start + j * _BN, k_col + DK1], ready,
                                                                k_pe_ring.index(s))
                        if not CTA:
                            if j == 0:
                                _load_q_half(q_desc, q_pe_desc, q_smem, q_pe_smem, q_ready, q_free, nq, q_start + m0,
                                             q_col, 1, DK1, DK2)
                                nq += 1
                        if j > 0:
                            c = base + j - 1
                            s = c % _STAGES
                            mbarrier.wait(v_empty.index(s), free_phase(c, _STAGES))
                            ready = v_ready.index(s)
                            mbarrier.expect(ready, v_desc.block_type.nbytes)
                            tma.async_copy_global_to_shared(v_desc, [k_start + (j - 1) * _BN, v_col], ready,
                                                            v_ring.index(s))
                    base += n_tiles

    @gluon.jit
    def _scores(q, q_pe, k_ring, k_pe_ring, c, DK2: gl.constexpr, s_layout: gl.constexpr):
        """Issue S = Q K^T for ring position c (asynchronous: the caller waits)."""
        s = c % _STAGES
        rows: gl.constexpr = q.shape[0]  # a warpgroup's 64 or the tile's 128
        zero_s = gl.zeros([rows, _BN], dtype=gl.float32, layout=s_layout)
        acc = warpgroup_mma(q, k_ring.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if DK2 > 0:
            acc = warpgroup_mma(q_pe, k_pe_ring.index(s).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _store_staged(o, v, v_free, out_ptr, q_start, mw, lq, h, stride_ot, stride_oh, W: gl.constexpr,
                      DV: gl.constexpr):
        """Warpgroup W's normalised output rows mw .. mw + 63 (of lq) through rows 64 W .. of the tile's last
        value slot v (``restage``), once both warpgroups' P V have read it; releases the slot."""
        rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        x = restage(v.slice(W * _WM, _WM, dim=0), o.to(v.dtype), rows_l)
        r = mw + gl.arange(0, _WM, layout=gl.SliceLayout(1, rows_l))
        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, rows_l))
        tok = q_start.to(gl.int64) + r
        gl.store(out_ptr + (tok * stride_ot + h * stride_oh)[:, None] + cols[None, :], x.to(out_ptr.dtype.element_ty),
                 mask=(r < lq)[:, None])
        release_staged(v_free)

    @gluon.jit
    def _varlen_consumer(q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids, tile_ready, tile_free, q_ready,
                         q_free, k_ready, k_empty, v_ready, v_empty, o_done, out_ptr, lse_ptr, cu_q, cu_k, err_ptr, H,
                         NM, T, batch, Tq, Tk, MAXQ, qk_scale, stride_ot, stride_oh, W: gl.constexpr, DK2: gl.constexpr,
                         DV: gl.constexpr,
                         CAUSAL: gl.constexpr, PER_SEQ: gl.constexpr):
        """Warpgroup W: query rows m0 + 64 W .. m0 + 64 W + 63 of each tile. FA3's intra-warpgroup overlap:
        S of key tile j is issued before P V of key tile j - 1, and the softmax of tile j runs while that
        P V is on the tensor cores; a K slot is released as soon as its S is done, a V slot after its P V.
        Long (~130 lines): the prologue, the overlapped loop and the epilogue share one ring position and
        the softmax state across the loop's edges, which helpers would take and return whole."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        q = q_smem.index(W)
        q_pe = q_pe_smem.index(W)
        if PER_SEQ:
            T = _tile_count(cu_q, H, batch)
        rows_ok = indptr_is_partition(cu_q, batch, Tq, gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0])))
        T = gl.where(rows_ok, T, 0)
        i = 0
        nq = 0
        base = 0
        t = 0
        while t < T:
            t, fields = _receive_work(i, tile_ids, tile_ready, tile_free, WARPGROUP, PER_SEQ)
            i += 1
            if t < T:
                h, q_start, lq, m0, lk, diag, hi, bits = _work_bounds(t, fields, NM, H, cu_q, cu_k, Tk, MAXQ, CAUSAL,
                                                                      PER_SEQ)
                if m0 < lq:
                    mw = m0 + W * _WM
                    rows = mw + gl.arange(0, _WM, layout=row_l)
                    # Keys row r sees: [0, lim) (bottom-right causal: query r of lq sees keys 0 .. r + lk - lq).
                    if CAUSAL:
                        lim = gl.maximum(gl.minimum(rows + diag + 1, lk), 0)
                        first_masked = gl.maximum(gl.minimum(mw + diag + 1, lk), 0)
                        my_end = gl.maximum(gl.minimum(gl.minimum(mw + _WM, lq) + diag, lk), 0)
                    else:
                        lim = gl.zeros([_WM], dtype=gl.int32, layout=row_l) + lk
                        first_masked = lk
                        my_end = lk
                    n_my = gl.cdiv(gl.where(mw < lq, my_end, 0), _BN)
                    n_tiles = gl.cdiv(hi, _BN)
                    m_i = gl.full([_WM], float("-inf"), dtype=gl.float32, layout=row_l)
                    l_i = gl.zeros([_WM], dtype=gl.float32, layout=row_l)
                    o = gl.zeros([_WM, DV], dtype=gl.float32, layout=o_layout)
                    mbarrier.wait(q_ready.index(W), phase(nq, 1))
                    nq += 1
                    if n_my > 0:
                        mbarrier.wait(k_ready.index(base % _STAGES), phase(base, _STAGES))
                        acc = _scores(q, q_pe, k_ring, k_pe_ring, base, DK2, s_layout)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, q))[0]
                        mbarrier.arrive(k_empty.index(base % _STAGES), count=1)
                        p, alpha, m_i, l_i = online_softmax(acc, m_i, l_i, 0, first_masked, lim, qk_scale, s_layout)
                        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
                        for j in range(1, n_my):
                            c = base + j
                            mbarrier.wait(k_ready.index(c % _STAGES), phase(c, _STAGES))
                            acc = _scores(q, q_pe, k_ring, k_pe_ring, c, DK2, s_layout)
                            sv = (c - 1) % _STAGES
                            mbarrier.wait(v_ready.index(sv), phase(c - 1, _STAGES))
                            v = v_ring.index(sv)
                            o = warpgroup_mma(p_op, v, o, is_async=True)
                            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, q))[0]
                            mbarrier.arrive(k_empty.index(c % _STAGES), count=1)
                            p, alpha, m_i, l_i = online_softmax(acc, m_i, l_i, j * _BN, first_masked, lim, qk_scale,
                                                                 s_layout)
                            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, v))[0]
                            mbarrier.arrive(v_empty.index(sv), count=1)
                            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                            p_op = gl.convert_layout(p.to(q.dtype), p_layout)
                        # This warpgroup's last S is done: the loader may bring the next tile's Q.
                        mbarrier.arrive(q_free.index(W), count=1)
                        # Only a sequence's last key tile can run past its keys (earlier V tiles are whole).
                        j = n_my - 1
                        c = base + j
                        sv = c % _STAGES
                        mbarrier.wait(v_ready.index(sv), phase(c, _STAGES))
                        v = v_ring.index(sv)
                        if j * _BN + _BN > lk:
                            # Both warpgroups may zero the same rows: they write the same zeros.
                            zero_tail_rows(v, 0, lk - j * _BN, DV // 64, 4)
                        o = warpgroup_mma(p_op, v, o, is_async=True)
                        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, v))[0]
                        if n_my < n_tiles:  # the last tile's slot is released after the epilogue
                            mbarrier.arrive(v_empty.index(sv), count=1)
                    else:
                        mbarrier.arrive(q_free.index(W), count=1)
                    # Key tiles past this warpgroup's last visible key are only released (the other needs them).
                    for j in range(n_my, n_tiles):
                        c = base + j
                        mbarrier.wait(k_ready.index(c % _STAGES), phase(c, _STAGES))
                        mbarrier.arrive(k_empty.index(c % _STAGES), count=1)
                        mbarrier.wait(v_ready.index(c % _STAGES), phase(c, _STAGES))
                        if j < n_tiles - 1:
                            mbarrier.arrive(v_empty.index(c % _STAGES), count=1)
                    base += n_tiles
                    if (W == 0) & (m0 == 0) & (h == 0):
                        report(err_ptr, bits)
                    inv_l, lse2 = finish_rows(l_i, m_i * qk_scale, bits != 0)
                    r = mw + gl.arange(0, _WM, layout=gl.SliceLayout(1, o_layout))
                    ok = r < lq
                    tok = q_start.to(gl.int64) + r
                    o = o * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
                    # Both warpgroups' P V of this tile are done (nq counts the tiles both took Q for).
                    mbarrier.arrive(o_done, count=1)
                    mbarrier.wait(o_done, phase(nq - 1, 1))
                    if n_tiles > 0:
                        _store_staged(o, v_ring.index((base - 1) % _STAGES), v_empty.index((base - 1) % _STAGES),
                                      out_ptr, q_start, mw, lq, h, stride_ot, stride_oh, W, DV)
                    else:
                        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
                        gl.store(out_ptr + (tok * stride_ot + h * stride_oh)[:, None] + cols[None, :],
                                 o.to(out_ptr.dtype.element_ty), mask=ok[:, None])
                    gl.store(lse_ptr + tok * H + h, gl.convert_layout(lse2 * _LN2, gl.SliceLayout(1, o_layout)),
                             mask=ok)
                    if not PER_SEQ:
                        if m0 + 2 * _WM == NM * 2 * _WM:
                            # The padded numbering gives each sequence NM row tiles: the top one poisons the rows of
                            # a sequence longer than max_seqlen_q that no tile covers.
                            _poison_rows(out_ptr, lse_ptr, q_start, NM * 2 * _WM + W * _WM, lq, 2 * _WM, h, H,
                                         stride_ot, stride_oh, DV, _WM, o_layout)
        if not rows_ok:
            # No partition of the q rows: every row of every head is NaN, this warpgroup's 64-row halves of the
            # 128-row tiles t = program, program + programs, ...
            for t in range(gl.program_id(0), gl.cdiv(Tq, 2 * _WM) * H, gl.num_programs(0)):
                r0 = (t // H) * 2 * _WM + W * _WM
                _poison_rows(out_ptr, lse_ptr, r0 * 0, r0, gl.minimum(r0 + _WM, Tq), 2 * _WM, t % H, H, stride_ot,
                             stride_oh, DV, _WM, o_layout)
            if (gl.program_id(0) == 0) & (W == 0):
                report(err_ptr, QUERY_INDPTR)

    @gluon.jit
    def _release(bar):
        """Every consumer thread's arrival on ``bar`` (initialised with ``_CONSUMER_THREADS``), no barrier
        first: ``mbarrier.arrive`` is one thread's after a barrier of the whole partition, which held each
        warpgroup at every K and V release until the other caught up (-16 to -18% on long prompts, NOTES,
        Prefill v12); the copy-completion arrive (no cp.async is pending) is each thread's own."""
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _turn_wait(wg):
        """Warpgroup ``wg`` (per thread: 0 or 1) waits for its turn to issue MMAs (named barrier 14 + wg,
        completed by the other warpgroup's ``_turn_pass``)."""
        gl.inline_asm_elementwise("bar.sync $1, 256; mov.b32 $0, 0;", "=r,r", [14 + wg], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _turn_pass(wg):
        """Warpgroup ``wg`` hands the turn to the other one (an arrival on its named barrier 15 - wg)."""
        gl.inline_asm_elementwise("bar.arrive $1, 256; mov.b32 $0, 0;", "=r,r", [15 - wg], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _store_staged_cta(o, v, v_free, out_ptr, q_start, m0, lq, h, stride_ot, stride_oh, DV: gl.constexpr):
        """The tile's normalised output rows m0 .. m0 + 127 (of lq) through its last value slot v
        (``restage``), once both warpgroups' P V have read it; releases the slot."""
        rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        # Each warpgroup's P V reads every row of the slot: both are done before either writes into it.
        gl.thread_barrier()
        x = restage(v, o.to(v.dtype), rows_l)
        r = m0 + gl.arange(0, _BM, layout=gl.SliceLayout(1, rows_l))
        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, rows_l))
        tok = q_start.to(gl.int64) + r
        gl.store(out_ptr + (tok * stride_ot + h * stride_oh)[:, None] + cols[None, :], x.to(out_ptr.dtype.element_ty),
                 mask=(r < lq)[:, None])
        # This thread's writes into the slot ordered before the loader's next TMA write into it.
        fence_async_shared()
        _release(v_free)

    @gluon.jit
    def _cta_consumer(q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids, tile_ready, tile_free, q_ready,
                      q_free, k_ready, k_empty, v_ready, v_empty, out_ptr, lse_ptr, cu_q, cu_k, err_ptr, H, NM, T,
                      batch, Tq, Tk, MAXQ, qk_scale, stride_ot, stride_oh, DK2: gl.constexpr, DV: gl.constexpr,
                      CAUSAL: gl.constexpr, PER_SEQ: gl.constexpr):
        """Both consumer warpgroups, one partition of 8 warps: query rows m0 .. m0 + 127 of each tile, 64 per
        warpgroup (the MMAs' M = 128 is one m64 wgmma per warpgroup). One partition, not one per warpgroup,
        so that both run the same instructions: with a copy each the SM's instruction cache held neither, and
        a quarter of the warps' samples on 64 x 512 prompts waited for instructions (benchmarks/NOTES.md,
        Prefill v12). The warpgroups take turns at the tensor cores (``_turn_wait`` / ``_turn_pass``, FA3's
        ping-pong): ptxas waits for P V before the softmax's exponentials in every form, so a warpgroup's
        softmax overlaps only the other's MMAs, and the turns keep the two out of step. FA3's
        intra-warpgroup overlap: S of key tile j is issued before P V of key tile j - 1,
        and the softmax of tile j runs while that P V is on the tensor cores; a K slot is released as soon as
        its S is done, a V slot after its P V. Long (~100 lines): the prologue, the overlapped loop and the
        epilogue share one ring position and the softmax state across the loop's edges, which helpers would
        take and return whole."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                           instr_shape=[16, _BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                           instr_shape=[16, DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        if PER_SEQ:
            T = _tile_count(cu_q, H, batch)
        q_ready = q_ready.index(0)
        q_free = q_free.index(0)
        wg = gl.arange(0, 256, layout=_CONSUMERS) // 128  # each thread's warpgroup
        # Warpgroup 0 takes the first turn (``_turn_wait``).
        gl.inline_asm_elementwise("{ .reg .pred p; setp.eq.s32 p, $1, 1; @p bar.arrive 14, 256; } mov.b32 $0, 0;",
                                  "=r,r", [wg], dtype=gl.int32, is_pure=False, pack=1)
        rows_ok = indptr_is_partition(cu_q, batch, Tq, gl.arange(0, 256, layout=_CONSUMERS))
        T = gl.where(rows_ok, T, 0)
        i = 0
        nq = 0
        base = 0
        t = 0
        while t < T:
            t, fields = _receive_work(i, tile_ids, tile_ready, tile_free, _CONSUMERS, PER_SEQ)
            i += 1
            if t < T:
                h, q_start, lq, m0, lk, diag, hi, bits = _work_bounds(t, fields, NM, H, cu_q, cu_k, Tk, MAXQ, CAUSAL,
                                                                      PER_SEQ)
                if m0 < lq:
                    rows = m0 + gl.arange(0, _BM, layout=row_l)
                    # Keys row r sees: [0, lim) (bottom-right causal: query r of lq sees keys 0 .. r + lk - lq).
                    # A key tile past a row's last key is all masked for that row (its P is 0).
                    if CAUSAL:
                        lim = gl.maximum(gl.minimum(rows + diag + 1, lk), 0)
                        first_masked = gl.maximum(gl.minimum(m0 + diag + 1, lk), 0)
                    else:
                        lim = gl.zeros([_BM], dtype=gl.int32, layout=row_l) + lk
                        first_masked = lk
                    n_tiles = gl.cdiv(hi, _BN)
                    m_i = gl.full([_BM], float("-inf"), dtype=gl.float32, layout=row_l)
                    l_i = gl.zeros([_BM], dtype=gl.float32, layout=row_l)
                    o = gl.zeros([_BM, DV], dtype=gl.float32, layout=o_layout)
                    mbarrier.wait(q_ready, phase(nq, 1))
                    nq += 1
                    if n_tiles > 0:
                        mbarrier.wait(k_ready.index(base % _STAGES), phase(base, _STAGES))
                        _turn_wait(wg)
                        acc = _scores(q_smem, q_pe_smem, k_ring, k_pe_ring, base, DK2, s_layout)
                        _turn_pass(wg)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, q_smem))[0]
                        _release(k_empty.index(base % _STAGES))
                        p, alpha, m_i, l_i = online_softmax(acc, m_i, l_i, 0, first_masked, lim, qk_scale, s_layout)
                        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
                        for j in range(1, n_tiles):
                            c = base + j
                            mbarrier.wait(k_ready.index(c % _STAGES), phase(c, _STAGES))
                            sv = (c - 1) % _STAGES
                            mbarrier.wait(v_ready.index(sv), phase(c - 1, _STAGES))
                            # The warpgroups take turns to issue a key tile's MMAs (FA3's ping-pong), so that one's
                            # softmax runs while the other's MMAs hold the tensor cores.
                            _turn_wait(wg)
                            acc = _scores(q_smem, q_pe_smem, k_ring, k_pe_ring, c, DK2, s_layout)
                            v = v_ring.index(sv)
                            o = warpgroup_mma(p_op, v, o, is_async=True)
                            _turn_pass(wg)
                            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, q_smem))[0]
                            _release(k_empty.index(c % _STAGES))
                            p, alpha, m_i, l_i = online_softmax(acc, m_i, l_i, j * _BN, first_masked, lim, qk_scale,
                                                                 s_layout)
                            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, v))[0]
                            _release(v_empty.index(sv))
                            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
                        # The tile's last S is done: the loader may bring the next tile's Q.
                        _release(q_free)
                        # Only a sequence's last key tile can run past its keys (earlier V tiles are whole).
                        j = n_tiles - 1
                        c = base + j
                        sv = c % _STAGES
                        mbarrier.wait(v_ready.index(sv), phase(c, _STAGES))
                        v = v_ring.index(sv)
                        if j * _BN + _BN > lk:
                            zero_tail_rows(v, 0, lk - j * _BN, DV // 64, 8)
                            # Each warpgroup's P V reads the rows the other's warps zeroed.
                            gl.thread_barrier()
                        o = warpgroup_mma(p_op, v, o, is_async=True)
                        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, v))[0]
                    else:
                        _release(q_free)
                    base += n_tiles
                    if (m0 == 0) & (h == 0):
                        report(err_ptr, bits)
                    inv_l, lse2 = finish_rows(l_i, m_i * qk_scale, bits != 0)
                    r = m0 + gl.arange(0, _BM, layout=gl.SliceLayout(1, o_layout))
                    ok = r < lq
                    tok = q_start.to(gl.int64) + r
                    o = o * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
                    if n_tiles > 0:
                        _store_staged_cta(o, v_ring.index((base - 1) % _STAGES), v_empty.index((base - 1) % _STAGES),
                                          out_ptr, q_start, m0, lq, h, stride_ot, stride_oh, DV)
                    else:
                        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
                        gl.store(out_ptr + (tok * stride_ot + h * stride_oh)[:, None] + cols[None, :],
                                 o.to(out_ptr.dtype.element_ty), mask=ok[:, None])
                    gl.store(lse_ptr + tok * H + h, gl.convert_layout(lse2 * _LN2, gl.SliceLayout(1, o_layout)),
                             mask=ok)
                    if not PER_SEQ:
                        if m0 + _BM == NM * _BM:
                            # The padded numbering gives each sequence NM row tiles: the top one poisons the rows of
                            # a sequence longer than max_seqlen_q that no tile covers.
                            _poison_rows(out_ptr, lse_ptr, q_start, NM * _BM, lq, _BM, h, H, stride_ot, stride_oh, DV,
                                         _BM, o_layout)
        if not rows_ok:
            # No partition of the q rows: every row of every head is NaN, the 128-row tiles t = program,
            # program + programs, ...
            for t in range(gl.program_id(0), gl.cdiv(Tq, _BM) * H, gl.num_programs(0)):
                r0 = (t // H) * _BM
                _poison_rows(out_ptr, lse_ptr, r0 * 0, r0, gl.minimum(r0 + _BM, Tq), _BM, t % H, H, stride_ot,
                             stride_oh, DV, _BM, o_layout)
            if gl.program_id(0) == 0:
                report(err_ptr, QUERY_INDPTR)

    @gluon.jit
    def _poison_rows(out_ptr, lse_ptr, q_start, r_lo, r_hi, step, h, H, stride_ot, stride_oh, DV: gl.constexpr,
                     ROWS: gl.constexpr, layout: gl.constexpr):
        """NaN into head h's output and LSE of rows q_start + r for r in r_lo .. r_hi - 1, ROWS rows every
        ``step`` (a warpgroup's half of each 128-row tile, or the whole tile)."""
        r_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, layout))
        nan = gl.full([ROWS, DV], float("nan"), out_ptr.dtype.element_ty, layout)
        for r0 in range(r_lo, r_hi, step):
            r = r0 + r_in
            ok = r < r_hi
            tok = q_start.to(gl.int64) + r
            gl.store(out_ptr + (tok * stride_ot + h * stride_oh)[:, None] + cols[None, :], nan, mask=ok[:, None])
            gl.store(lse_ptr + tok * H + h, gl.full([ROWS], float("nan"), gl.float32, gl.SliceLayout(1, layout)),
                     mask=ok)

    @gluon.jit
    def _varlen_sm90_kernel(
        q_desc, q_pe_desc, k_desc, k_pe_desc, v_desc, out_ptr, lse_ptr, cu_q, cu_k, counter, err_ptr,
        H, GROUP, NM, WIN, T, batch, Tq, Tk, MAXQ, qk_scale, stride_ot, stride_oh,
        DK1: gl.constexpr, DK2: gl.constexpr, DV: gl.constexpr, CAUSAL: gl.constexpr, SEARCH_STEPS: gl.constexpr,
        PER_SEQ: gl.constexpr, CTA: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        if CTA:  # one [128, dk] box of Q
            q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
            q_pe_smem = gl.allocate_shared_memory(dtype, q_pe_desc.block_type.shape, q_pe_desc.layout)
        else:  # a [64, dk] half per consumer warpgroup
            q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
            q_pe_smem = gl.allocate_shared_memory(dtype, [2] + q_pe_desc.block_type.shape, q_pe_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [_STAGES] + k_desc.block_type.shape, k_desc.layout)
        k_pe_ring = gl.allocate_shared_memory(dtype, [_STAGES] + k_pe_desc.block_type.shape, k_pe_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [_STAGES] + v_desc.block_type.shape, v_desc.layout)
        # Per hand-off slot: the tile id (per-sequence numbering: id, head, q_start, lq, m0, lk and a spare word).
        if PER_SEQ:
            tile_ids = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        tile_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # per consumer warpgroup's half of Q
        q_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_layout)
        o_done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(o_done, count=2)  # both warpgroups' last P V of a tile
        # A release: one arrive per consumer partition (after a barrier of its warps), or in the one-partition
        # form every consumer thread's (``_release``: K, V and Q slots).
        releases: gl.constexpr = _CONSUMER_THREADS if CTA else 2
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=_CONSUMER_THREADS if CTA else 1)  # (per warpgroup's half)
            mbarrier.init(tile_ready.index(i), count=1)
            mbarrier.init(tile_free.index(i), count=1 if CTA else 2)
        for i in gl.static_range(_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=releases)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=releases)
        if CTA:
            gl.warp_specialize(
                [(_cta_consumer, (q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids, tile_ready, tile_free,
                                  q_ready, q_free, k_ready, k_empty, v_ready, v_empty, out_ptr, lse_ptr, cu_q, cu_k,
                                  err_ptr, H, NM, T, batch, Tq, Tk, MAXQ, qk_scale, stride_ot, stride_oh, DK2, DV,
                                  CAUSAL, PER_SEQ)),
                 (_varlen_loader, (q_desc, q_pe_desc, k_desc, k_pe_desc, v_desc, cu_q, cu_k, counter, GROUP, H, NM,
                                   WIN, T, batch, Tq, Tk, MAXQ, q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids,
                                   tile_ready, tile_free, q_ready, q_free, k_ready, k_empty, v_ready, v_empty, DK1,
                                   DK2, CAUSAL, SEARCH_STEPS, PER_SEQ, CTA))],
                worker_num_warps=[1],
                worker_num_regs=[40],
            )
        else:
            gl.warp_specialize(
                [(_varlen_consumer, (q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids, tile_ready, tile_free,
                                     q_ready, q_free, k_ready, k_empty, v_ready, v_empty, o_done, out_ptr, lse_ptr,
                                     cu_q, cu_k, err_ptr, H, NM, T, batch, Tq, Tk, MAXQ, qk_scale, stride_ot,
                                     stride_oh, 0, DK2, DV, CAUSAL, PER_SEQ)),
                 (_varlen_consumer, (q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids, tile_ready, tile_free,
                                     q_ready, q_free, k_ready, k_empty, v_ready, v_empty, o_done, out_ptr, lse_ptr,
                                     cu_q, cu_k, err_ptr, H, NM, T, batch, Tq, Tk, MAXQ, qk_scale, stride_ot,
                                     stride_oh, 1, DK2, DV, CAUSAL, PER_SEQ)),
                 (_varlen_loader, (q_desc, q_pe_desc, k_desc, k_pe_desc, v_desc, cu_q, cu_k, counter, GROUP, H, NM,
                                   WIN, T, batch, Tq, Tk, MAXQ, q_smem, q_pe_smem, k_ring, k_pe_ring, v_ring, tile_ids,
                                   tile_ready, tile_free, q_ready, q_free, k_ready, k_empty, v_ready, v_empty, DK1,
                                   DK2, CAUSAL, SEARCH_STEPS, PER_SEQ, CTA))],
                worker_num_warps=[4, 1],
                worker_num_regs=[232, 40],
            )

    # The one-partition form's key-loop barrier goes (``drop_key_loop_barrier``); the pass finds none in the other.
    _MAIN = CachedKernel(_varlen_sm90_kernel, ptx_pass=drop_key_loop_barrier)


def varlen_sm90_args(q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor, heads: int, kv_heads: int,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, softmax_scale: float,
                     causal: bool, out: torch.Tensor, lse: torch.Tensor, counter: torch.Tensor):
    """(kernel, grid, args, options) of a launch over q2 [Tq, H * Dqk], k2 [Tk, Hk * Dqk], v2 [Tk, Hk * Dv]
    (rows from ``tma_rows``), ``counter`` an int32 [1] zero (the tile counter)."""
    tq, tk = q2.shape[0], k2.shape[0]
    dk, dv = q2.shape[1] // heads, v2.shape[1] // kv_heads
    batch = cu_seqlens_q.shape[0] - 1
    dk1 = 128 if dk == 192 else dk
    dk2 = dk - dk1
    pe_width = dk2 or 64  # without a rope part the pe descriptors are passed but never used
    tiles, per_sequence = varlen_sm90_plan(max_seqlen_q, tq, heads, batch)
    if tiles >= MAX_TILES:
        raise ValueError(f"max_seqlen_q: {max_seqlen_q} over {batch} sequences, {tq} rows and {heads} heads is {tiles} "
                         f"work tiles; the Hopper kernel's int32 tile counter takes fewer than {MAX_TILES} (the "
                         "portable kernel has no such limit)")
    cta = CTA_SEQLEN[0] < max_seqlen_q <= CTA_SEQLEN[1]
    programs = min(tiles, sm_count(q2.device))
    q_rows = BLOCK_M if cta else BLOCK_M // 2
    args = (descriptor(q2, [q_rows, dk1], shared_layout(q_rows, dk1, q2.dtype)),
            descriptor(q2, [q_rows, pe_width], shared_layout(q_rows, pe_width, q2.dtype)),
            descriptor(k2, [BLOCK_N, dk1], shared_layout(BLOCK_N, dk1, q2.dtype)),
            descriptor(k2, [BLOCK_N, pe_width], shared_layout(BLOCK_N, pe_width, q2.dtype)),
            descriptor(v2, [BLOCK_N, dv], shared_layout(BLOCK_N, dv, q2.dtype)),
            out, lse, cu_seqlens_q, cu_seqlens_k, counter, errors.error_word(q2.device),
            heads, heads // kv_heads, -(-max_seqlen_q // BLOCK_M),
            1 if per_sequence else tail_window(heads, kv_heads, batch, tk, dk, dv, q2.element_size(), causal,
                                               -(-max_seqlen_q // BLOCK_M), programs),
            tiles, batch, tq, tk, max_seqlen_q,
            softmax_scale * LOG2E, out.stride(0), out.stride(1))
    options = dict(DK1=dk1, DK2=dk2, DV=dv, CAUSAL=bool(causal),
                   SEARCH_STEPS=max(1, batch.bit_length()) if per_sequence else 1, PER_SEQ=per_sequence,
                   CTA=cta, num_warps=8 if cta else 4)
    return _MAIN, (programs, 1, 1), args, options


def varlen_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, softmax_scale: float, causal: bool,
                out: torch.Tensor, lse: torch.Tensor) -> None:
    """Launch on checked inputs (``varlen_attention`` checks them and allocates out [Tq, H, Dv] and lse
    [Tq, H] float32); requires ``varlen_sm90_supported(q, k, v)`` and softmax_scale > 0 (the softmax keeps
    unscaled row maxima). Each call zeroes its own tile counter (one small memset on the stream), so
    concurrent calls on other streams and CUDA-graph replays do not share it. Guards as the portable kernel's
    (``pagedmla.errors``): without a partition of the q rows in cu_seqlens_q every row is NaN; a sequence
    whose key range lies outside k or whose length exceeds ``max_seqlen_q`` gets NaN rows. k must hold at
    least one row (a TMA descriptor cannot describe an empty tensor: ``varlen_attention`` runs the portable
    kernel then)."""
    if not varlen_sm90_supported(q, k, v):
        raise ValueError("config: use_sm90 needs an sm_90 GPU, Triton's Gluon, bf16/fp16 q/k/v, q/k head dim 64, "
                         "128 or 192 and value head dim 64 or 128")
    tq, h, _ = q.shape
    tk, hk, _ = v.shape
    batch = cu_seqlens_q.shape[0] - 1
    if tq == 0:
        return
    if batch == 0 or tk == 0:
        raise ValueError(f"cu_seqlens_q/k: the Hopper kernel needs sequences and keys, got {batch} sequences "
                         f"over {tk} keys")
    # A non-contiguous input is copied here (varlen_attention's default avoids that for short queries).
    q2, k2, v2 = (tma_rows(x.reshape(x.shape[0], -1)) for x in (q, k, v))
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    kernel, grid, args, options = varlen_sm90_args(q2, k2, v2, h, hk, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   softmax_scale, causal, out, lse, counter)
    kernel.launch(q.device, grid, *args, **options)
