"""What the Hopper (sm_90a) Gluon kernels share: the Gluon imports, TMA descriptors, the shared-memory
rings' barrier phases, the persistent kernels' tile claim and hand-off, the online-softmax step, zeroing a
value tile's tail, and staging an output through a ring slot.

A ring of ``STAGES`` slots is filled in order: use i of the ring takes slot ``i % STAGES``; its ``ready``
barrier completes once per fill and its ``empty`` barrier once per release, so use i waits for ready
phase ``phase(i, STAGES)`` and the producer of use i for empty phase ``free_phase(i, STAGES)`` (which passes
at once on the first round). One barrier (a one-slot ring) is ``STAGES`` = 1.
"""

from __future__ import annotations

import functools
import re

import torch

from pagedmla.device import gluon_available

HAVE_GLUON = gluon_available()
if HAVE_GLUON:  # an older or newer Triton without this Gluon API: the portable kernels run instead
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# The persistent kernels' tile counters and tile ids are int32, and the programs' last claims run past the
# tile count by up to the number of programs: 2**20 of headroom.
MAX_TILES = 2 ** 31 - 2 ** 20


# A TMA tensor load as Triton 3.6 writes it in PTX, one per line: optional guard predicate, opcode, then the
# shared destination, the [descriptor, {coordinates}] source and the mbarrier operands.
_TMA_LOAD = re.compile(r"(?m)^(\s*)(@!?%\w+\s+)?(cp\.async\.bulk\.tensor\.[1-5]d\.shared::cluster\.global"
                       r"\.mbarrier::complete_tx::bytes) (\[[^\]]+\]), (\[[^\]]+\]), (\[[^\]]+\]);")
# Every TMA tensor load, whatever its form (the all-or-nothing count).
_ANY_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\d+d\.shared::\w+\.global")


def tma_loads_evict_first(ptx: str) -> str:
    """``ptx`` with every TMA tensor load carrying an L2 evict-first cache policy, or ``ptx`` unchanged when
    any of its TMA loads is not in the form this rewrites (another Triton's PTX).

    Why: a decode kernel streams each KV row once, and its split-KV partials must stay in L2 for the combine;
    with the streamed tiles marked evict-first the partials (stored evict-last) are not pushed out to DRAM
    (FlashMLA's Hopper decode hints its K and Q copies the same way). Gluon 3.6's TMA copy takes no cache
    hint, so ``CachedKernel(..., ptx_pass=...)`` applies this to the compiled PTX. Each load gets a scope of
    its own holding the policy register (the loads sit in the loader partition's function), its predicate
    moved inside."""
    hinted, n = _TMA_LOAD.subn(r"\1{ .reg .b64 %l2pol; createpolicy.fractional.L2::evict_first.b64 %l2pol, 1.0; "
                               r"\2\3.L2::cache_hint \4, \5, \6, %l2pol; }", ptx)
    if n == 0 or n != len(_ANY_TMA_LOAD.findall(ptx)):
        return ptx
    return hinted


def gl_dtype(dtype: torch.dtype):
    """The Gluon element type of a bf16 / fp16 torch dtype."""
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.cache
def shared_layout(rows: int, width: int, dtype: torch.dtype):
    """The NVMMA shared-memory layout of a [rows, width] TMA tile of ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for([rows, width], gl_dtype(dtype))


def tma_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D row-major tensor with a 16-byte aligned base, copied only when it is not one already."""
    if x.data_ptr() % 16 or x.stride() != (x.shape[1], 1):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def descriptor(x: torch.Tensor, block_shape: list[int], layout) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor`` without its per-call validation, which was a third of the decode
    launcher's host time: ``x`` comes from ``tma_rows`` or a cache the caller's support check accepted
    (aligned base, 16-byte row stride, unit last stride); block shapes are the kernels' constants."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = x, x.shape, x.stride()
    desc.block_shape, desc.layout, desc.padding = block_shape, layout, "zero"
    return desc


if HAVE_GLUON:
    ONE_WARP = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
    WARPGROUP = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))

    @gluon.jit
    def phase(i, STAGES: gl.constexpr):
        """The ready-barrier phase use i of a ``STAGES``-slot ring waits for."""
        return (i // STAGES) & 1

    @gluon.jit
    def free_phase(i, STAGES: gl.constexpr):
        """The empty-barrier phase the producer of use i waits for (passes at once on the first round)."""
        return phase(i, STAGES) ^ 1

    @gluon.jit
    def launch_dependents():
        """Programmatic dependent launch: the next kernel's programs (launched with the PDL attribute) may
        be scheduled from here on; they wait (``griddepcontrol.wait``) for this grid's end before reading what
        it wrote."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def wait_prior_grids():
        """Programmatic dependent launch, the other side: a kernel launched with the PDL attribute may start
        while the stream's previous kernel ends; this waits until that grid has ended and its writes are
        visible. Called before the kernel's first global memory access (a no-op without the attribute)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def claim_tile(counter, slots, s):
        """Loader warp: take the next work tile from the global ``counter``; one lane's atomic result goes
        through word 0 of hand-off slot ``s`` of ``slots`` (int32 [2, words] in shared memory) so that every
        lane returns it."""
        fetched = gl.atomic_add(counter + gl.zeros([1], gl.int32, ONE_WARP), gl.full([1], 1, gl.int32, ONE_WARP))
        slot = slots.index(s).slice(0, 1)
        slot.store(fetched)
        # One lane holds the claimed index: every lane reads it back from shared memory.
        gl.thread_barrier()
        return gl.max(slot.load(ONE_WARP), axis=0)

    @gluon.jit
    def _await_slot(i, slots, ready):
        """Consumer side of a two-slot hand-off: slot ``i % 2`` of ``slots`` once the i-th publication is in."""
        s = i % 2
        mbarrier.wait(ready.index(s), phase(i, 2))
        return slots.index(s)

    @gluon.jit
    def _hand_back(i, free):
        """The i-th slot handed back to the loader once every warp has read it (the arrive is one thread's)."""
        gl.thread_barrier()
        mbarrier.arrive(free.index(i % 2), count=1)

    @gluon.jit
    def _slot_word(slot, k: gl.constexpr, layout: gl.constexpr):
        """Word k of a hand-off slot, every thread reading it from the same address (a [1] tensor in
        ``layout``), so that ptxas sees a warp-uniform value (``receive_fields``)."""
        return gl.max(slot.slice(k, 1).load(layout), axis=0)

    @gluon.jit
    def receive_slot(i, slots, ready, free, layout: gl.constexpr):
        """Consumer side of a two-slot hand-off: the i-th published slot of ``slots`` loaded in ``layout``,
        the slot handed back to the loader once every warp has read it."""
        info = _await_slot(i, slots, ready).load(layout)
        _hand_back(i, free)
        return info

    @gluon.jit
    def receive_fields(i, slots, ready, free, layout: gl.constexpr):
        """Words 0 .. 6 of the i-th published slot of a hand-off whose slots hold 8 int32 words, each read
        whole by every thread of ``layout``. Why not one load of the slot and a reduction per word: values
        that come out of cross-lane shuffles are per-thread to ptxas, and so was all the tile arithmetic,
        the key loop's trip count and every wgmma descriptor derived from them (R2UR and vector ALU
        instead of the uniform datapath: 11% more instructions and time on a 4096-token prompt,
        benchmarks/NOTES.md, Prefill v14)."""
        slot = _await_slot(i, slots, ready)
        fields = (_slot_word(slot, 0, layout), _slot_word(slot, 1, layout), _slot_word(slot, 2, layout),
                  _slot_word(slot, 3, layout), _slot_word(slot, 4, layout), _slot_word(slot, 5, layout),
                  _slot_word(slot, 6, layout))
        _hand_back(i, free)
        return fields

    @gluon.jit
    def online_softmax(acc, m_i, l_i, n0, first_masked, lim, qk_scale, s_layout: gl.constexpr):
        """(P, rescale factor, row max, row sum) after a tile of raw scores acc [rows, keys] at keys n0 ..,
        scores of keys >= lim (per row) masked once the tile reaches first_masked; the max is kept unscaled
        (qk_scale > 0) so that the scale folds into one FMA per score."""
        BN: gl.constexpr = acc.shape[1]
        if n0 + BN > first_masked:
            cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            acc = gl.where(cols[None, :] < lim[:, None], acc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(acc, axis=1))
        # A row with no visible key yet keeps max -inf: subtract 0 instead so exp2 gives 0, not NaN.
        m_sc = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.exp2(m_i * qk_scale - m_sc)
        p = gl.exp2(acc * qk_scale - m_sc[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def zero_tail_rows(kv, col0, valid, CHUNKS: gl.constexpr, num_warps: gl.constexpr):
        """Zero rows valid .. of columns col0 .. col0 + 64 * CHUNKS - 1 of a value tile in shared memory."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = gl.arange(0, kv.shape[0], layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(CHUNKS):
            part = kv.slice(col0 + 64 * c, 64, dim=1)
            x = part.load(layout)
            part.store(gl.where(rows[:, None] < valid, x, gl.zeros_like(x)))
        fence_async_shared()

    @gluon.jit
    def restage(part, y, layout: gl.constexpr):
        """``y`` (a warpgroup's output in its MMA layout) written into the shared-memory view ``part`` and read
        back in ``layout``: with eight consecutive columns per thread there, rows go to global memory as whole
        128-byte lines, where stores from the MMA layout write 4-byte pieces of 8 rows (partial L2 sectors)."""
        part.store(y)
        gl.thread_barrier()
        return part.load(layout)

    @gluon.jit
    def release_staged(free):
        """Hand a slot ``restage`` used back to the loader: every warp's reads done, and ordered before the
        loader's next TMA write into it."""
        gl.thread_barrier()
        fence_async_shared()
        mbarrier.arrive(free, count=1)
