"""What every pagedmla kernel shares: the base-2 softmax constants, the value guards, the row finish, the FP8
cache rows' reader and the prefill kernels' config.

The guards implement ``pagedmla.errors``' contract inside the kernels (Triton and Gluon kernels both call
these ``@triton.jit`` helpers): a value that would address memory outside a tensor is replaced by a safe one
before any load or store uses it, the request it belongs to is marked bad (its rows become NaN) and the
error bit is OR-ed into the device's error word.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language import target_info
from triton.runtime.jit import constexpr_function

from pagedmla import errors, kv_format
from pagedmla.device import triton_interpreting

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: scores are scaled by softmax_scale * LOG2E
LN2 = 0.6931471805599453  # and their log2 LSE is returned as a natural log
_LN2 = tl.constexpr(LN2)

BLOCK_TABLE = tl.constexpr(errors.BLOCK_TABLE)
NEGATIVE_LENGTH = tl.constexpr(errors.NEGATIVE_LENGTH)
LENGTH_BEYOND_TABLE = tl.constexpr(errors.LENGTH_BEYOND_TABLE)
PAGE_LAYOUT = tl.constexpr(errors.PAGE_LAYOUT)
SCHEDULE = tl.constexpr(errors.SCHEDULE)
QUERY_INDPTR = tl.constexpr(errors.QUERY_INDPTR)
KEY_INDPTR = tl.constexpr(errors.KEY_INDPTR)
MAX_SEQLEN = tl.constexpr(errors.MAX_SEQLEN)
CACHE_SLOT = tl.constexpr(errors.CACHE_SLOT)

# The cache formats as the kernels' KV_FMT constexpr: rows of q's float dtype, fp8_e4m3, fp8_ds_mla.
KV_FORMATS = {None: 0, "fp8_e4m3": 1, "fp8_ds_mla": 2}
# ``pagedmla.kv_format``'s row layout as the kernels' constants (the reader below, the FP8 store of rows.py).
FP8_MAX = tl.constexpr(kv_format.FP8_MAX)
DS_TILE = tl.constexpr(kv_format.DS_TILE)
DS_TILES = tl.constexpr(kv_format.DS_TILES)
DS_SCALES_OFFSET = tl.constexpr(kv_format.DS_SCALES_OFFSET)
DS_ROPE_OFFSET = tl.constexpr(kv_format.DS_ROPE_OFFSET)
DS_MIN_SCALE_INV = tl.constexpr(kv_format.DS_MIN_SCALE_INV)
LATENT_DIM = tl.constexpr(kv_format.LATENT_DIM)
ROPE_DIM = tl.constexpr(kv_format.ROPE_DIM)


def fp8_nan_fixup() -> bool:
    """Whether FP8 decodes need their NaN codes restored by hand: Triton 3.6's interpreter converts the
    float8_e4m3fn NaN codes 0x7F / 0xFF to +-480 (the other 254 codes convert exactly; checked over all 256),
    while the GPU's conversion gives NaN."""
    return triton_interpreting()


def wait_prior_options(wait_prior: bool) -> dict:
    """Launch options of a main kernel that follows the stream's previous kernel as a programmatic dependent
    (PDL; ``wait_prior`` from ``device.pdl_available``): launched with the attribute, its programs are
    scheduled while that kernel's last programs end instead of a launch latency (~1.4 µs on the H200) after
    its end, and ``WAIT_PRIOR`` makes them wait for its end (``griddepcontrol.wait``) before their first
    global memory access. FlashMLA's main kernel starts the same way (benchmarks/NOTES.md, decode v29)."""
    return dict(WAIT_PRIOR=wait_prior, launch_pdl=True) if wait_prior else dict(WAIT_PRIOR=False)


def kv_format_width(kv_fmt: str | None, d: int) -> int:
    """Elements of one row of a cache in format ``kv_fmt`` for q's head dim ``d``: d, or 656 bytes for
    fp8_ds_mla."""
    return kv_format.DS_ROW_BYTES if kv_fmt == "fp8_ds_mla" else d


def kv_format_args(k_cache, kv_fmt: str | None, k_scale) -> tuple:
    """(cache as the kernels read it, k_scale pointer argument, KV_FMT constexpr) of a paged k_cache in format
    ``kv_fmt`` (``pagedmla.kv_format``; None for rows of q's dtype): FP8 caches go in as their bytes (uint8),
    the scale only for fp8_e4m3."""
    if kv_fmt is None:
        return k_cache, None, 0
    return k_cache.view(torch.uint8), k_scale, KV_FORMATS[kv_fmt]


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Kernel choice and tile shape of a prefill call (the paged ``paged_varlen`` and the ragged ``varlen``
    op), overriding the per-call default (``default_config`` of ``paged_varlen.py`` / ``varlen.py``, and the
    Hopper kernel where it applies); benchmarks and tests use it.

    use_sm90: run the Hopper Gluon kernel (``sm90/``, fixed tiles: the other fields do not apply to it);
    False runs the portable kernel. block_m: query rows per program; block_n: keys per step; num_warps,
    num_stages: Triton's; a field left None keeps the default's value.
    """

    use_sm90: bool = False
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def over(self, default: PrefillConfig) -> PrefillConfig:
        """``default`` with this config's set fields in its place."""
        return dataclasses.replace(default, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                               if getattr(self, f.name) is not None})

    @staticmethod
    def checked(config) -> PrefillConfig | None:
        """``config`` itself: None or a PrefillConfig, anything else a TypeError naming the argument."""
        if config is not None and not isinstance(config, PrefillConfig):
            raise TypeError(f"config: expected a PrefillConfig or None, got {type(config).__name__}")
        return config


# Both portable prefill kernels' tiles under the interpreter: small enough that the tests' small shapes run
# several tiles and the masked paths.
INTERPRETER_TILES = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


@triton.jit
def fp8_cols(rows, col0, mask, WIDTH: tl.constexpr, KV_FMT: tl.constexpr, ROPE: tl.constexpr,
             MASKED: tl.constexpr, NAN_FIXUP: tl.constexpr):
    """Values of columns col0 .. col0 + WIDTH - 1 of FP8 cache rows (``pagedmla.kv_format``) as a
    [N, WIDTH] tile: rows [N, 1] uint8 pointers to the rows' first bytes, mask [N, WIDTH] or [N, 1] (read only
    when MASKED: masked-off values are 0, their bytes never read; [N, 1] where WIDTH > 128 for fp8_ds_mla).

    KV_FMT 1 (fp8_e4m3): the fp8 values themselves as float16, *not* times k_scale: they are exact in fp16 and
    bf16, so the dots see them unrounded, and the kernel folds the one scale into the softmax scale and the output
    normaliser (x * k_scale rounded to bf16 would err by up to 2^-9 relative per element). KV_FMT 2
    (fp8_ds_mla): latent columns fp8 x their 128-column tile's float32 scale (bytes 512..527 of the row; a
    power of two, so the product is exact), loaded once per row and tile, or with ROPE (columns 512.. of that
    format) the bfloat16 values at bytes 528... NAN_FIXUP: ``fp8_nan_fixup``."""
    cols = col0 + tl.arange(0, WIDTH)[None, :]
    if KV_FMT == 2 and ROPE:
        ptrs = (rows + DS_ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16)) + (cols - LATENT_DIM)
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        return tl.load(ptrs).to(tl.float32)
    if MASKED:
        bits = tl.load(rows + cols, mask=mask, other=0)
    else:
        bits = tl.load(rows + cols)
    return fp8_values(bits, rows, col0, mask, KV_FMT, MASKED, NAN_FIXUP)


@triton.jit
def fp8_values(bits, rows, col0, mask, KV_FMT: tl.constexpr, MASKED: tl.constexpr, NAN_FIXUP: tl.constexpr):
    """``fp8_cols``'s values of latent bytes already loaded (uint8 [N, WIDTH], columns col0 ..; a TMA tile
    in the decode kernel): rows and mask as there, read only for fp8_ds_mla's scales."""
    if KV_FMT == 1:
        # One conversion instruction per two values (cvt.rn.f16x2.e4m3x2); through float32 it took four, and
        # the conversions, not the bytes, bounded the FP8 decode (benchmarks/NOTES.md, FP8).
        x = bits.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        x = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if NAN_FIXUP:
        x = tl.where((bits & 0x7F) == 0x7F, float("nan"), x)
    if KV_FMT == 2:
        x = _ds_scaled(x, rows, col0, mask, x.shape[1], MASKED)
    return x


@triton.jit
def fp8_pair_values(words, rows, word0, mask, KV_FMT: tl.constexpr, MASKED: tl.constexpr, NAN_FIXUP: tl.constexpr):
    """The latent bytes of FP8 cache rows read as 16-bit words (int16 [N, W]: words word0 .., columns
    2 * word0 .. 2 * (word0 + W) - 1) as two [N, W] tiles of ``fp8_values``' values: the even columns
    2 * (word0 + j) and the odd ones 2 * (word0 + j) + 1. rows and mask as ``fp8_cols`` has them (read only
    for fp8_ds_mla's scales; W words span 2 * W / 128 scale tiles, at most two).

    Why words: a dot over the tokens (P V) takes its operand as pairs of consecutive tokens per column. From
    a tile of bytes that is a byte load per token and column; from a tile of words it is what ``ldmatrix.trans``
    reads for 16-bit data, and each word holds the pair of an even and an odd column."""
    if _ptx_e4m3_pairs():
        x_even, x_odd = _e4m3_pairs_ptx(words)
    else:
        x_even = fp8_values((words & 0xFF).to(tl.uint8), rows, 0, mask, 1, MASKED, NAN_FIXUP)
        x_odd = fp8_values((words >> 8).to(tl.uint8), rows, 0, mask, 1, MASKED, NAN_FIXUP)
    if KV_FMT == 2:
        scale = _ds_pair_scales(rows, word0, mask, words.shape[1], MASKED)
        x_even = x_even.to(tl.float32) * scale
        x_odd = x_odd.to(tl.float32) * scale
    return x_even, x_odd


@triton.jit
def _ds_pair_scales(rows, word0, mask, W: tl.constexpr, MASKED: tl.constexpr):
    """fp8_ds_mla scales of ``fp8_pair_values``' W words from word0 on ([N, 1], or [N, W] where the words span
    two 128-column scale tiles)."""
    tl.static_assert(W <= DS_TILE, "fp8_pair_values: at most two fp8_ds_mla scale tiles")
    scales = (rows + DS_SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + (2 * word0) // DS_TILE
    if MASKED:
        scale = tl.load(scales, mask=mask, other=0.0)
    else:
        scale = tl.load(scales)
    if 2 * W > DS_TILE:
        # The words' second half lies in the next scale tile.
        if MASKED:
            scale_hi = tl.load(scales + 1, mask=mask, other=0.0)
        else:
            scale_hi = tl.load(scales + 1)
        scale = tl.where(2 * tl.arange(0, W)[None, :] < DS_TILE, scale, scale_hi)
    return scale


@constexpr_function
def _ptx_e4m3_pairs() -> bool:
    """Whether ``fp8_pair_values`` converts its words by inline PTX (``_e4m3_pairs_ptx``): compiled for an
    NVIDIA GPU with the e4m3x2 conversion (sm_89 and later), not under the interpreter (no inline assembly)."""
    # Triton's own reading of TRITON_INTERPRET (``device.triton_interpreting``'s): a compile-time function may
    # reference no plain Python function.
    return not knobs.runtime.interpret and target_info.cuda_capability_geq(8, 9)


@triton.jit
def _e4m3_pairs_ptx(words):
    """(even, odd) bytes of int16 ``words`` as the float16 values of their e4m3 codes (exact; NaN codes give
    NaN). Triton lowers the byte extraction and the cast element by element (about 3 integer instructions per
    value beside each conversion in the word-tile SASS, benchmarks/NOTES.md FP8); on a register holding two
    words (bytes e0 o0 e1 o1) one byte permute gives the pairs (e0 e1) and (o0 o1), and one
    ``cvt.rn.f16x2.e4m3x2`` converts each: 3 instructions per 4 values."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 e, o; prmt.b32 t, $2, $2, 0x3120; mov.b32 {e, o}, t; "
        "cvt.rn.f16x2.e4m3x2 $0, e; cvt.rn.f16x2.e4m3x2 $1, o; }",
        "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _ds_scaled(x, rows, col0, mask, WIDTH: tl.constexpr, MASKED: tl.constexpr):
    """fp8_ds_mla latent values ``x`` (float32 [N, WIDTH], columns col0 ..) times their 128-column tile's
    scale (``fp8_cols``)."""
    scales = (rows + DS_SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + col0 // DS_TILE
    if WIDTH <= DS_TILE:
        if MASKED:
            x = x * tl.load(scales, mask=mask, other=0.0)
        else:
            x = x * tl.load(scales)
    else:
        # Several tiles: their WIDTH / 128 scales per row, broadcast over each tile's columns (a per-column
        # gather of the scales would stage WIDTH float32 values per row in shared memory: 128 KB per stage
        # of 64 rows).
        n: tl.constexpr = x.shape[0]
        tiles: tl.constexpr = WIDTH // DS_TILE
        if MASKED:
            per_tile = tl.load(scales + tl.arange(0, tiles)[None, :], mask=mask, other=0.0)
        else:
            per_tile = tl.load(scales + tl.arange(0, tiles)[None, :])
        x = tl.reshape(tl.reshape(x, [n, tiles, DS_TILE]) * per_tile[:, :, None], [n, WIDTH])
    return x


@triton.jit
def checked_page(page, num_pages):
    """(page id, or 0 where it lies outside 0 .. num_pages - 1; whether it did): page 0 is reserved, so a
    bad id reads the reserved page and the caller poisons the request's result."""
    bad = (page < 0) | (page >= num_pages)
    return tl.where(bad, 0, page), bad


@triton.jit
def fp16_row_scale(amax):
    """(multiplier, its inverse) taking query rows whose largest magnitude is ``amax`` (float32 [R]) to just
    below 2^15: a power of two, so that bf16 rows become fp16 without overflow and, up to fp16's finer
    mantissa, without rounding (values down to 2^-24 of the row's largest keep full precision; a zero row, or a
    NaN, keeps 1). The fp8_e4m3 decode runs its dots in fp16 on these rows (its tiles convert to fp16 in one
    instruction per two values) and multiplies the scores by the inverse."""
    e = tl.where(amax > 0.0, tl.ceil(tl.log2(amax)) - 15.0, 0.0)
    e = tl.minimum(tl.maximum(e, -126.0), 126.0)
    return tl.exp2(-e), tl.exp2(e)


# float32 words before the split-KV partials' values: the schedule verdict in a 128-byte line of its own.
PARTIALS_HEADER = tl.constexpr(32)
# L2 priority of the main kernels' partial stores. The partials buffer is scratch that the caching allocator
# hands back at the same address on the next call of the shape; kept in L2 ahead of the streamed KV rows, its
# lines are rewritten there by that call instead of being written back to DRAM while it streams. Measured on
# the H200 (benchmarks/NOTES.md, decode v23): 1-3% faster as CUDA graphs at batch 64-128, eager within
# noise; demoting the lines again when the combine reads them (evict_first) gave most of it back.
PARTIALS_EVICTION = tl.constexpr("evict_last")


@triton.jit
def partials_views(part_ptr, out_ptr, pieces, rows, DV: tl.constexpr, OUT_TYPED: tl.constexpr):
    """(schedule verdict, values, log2 LSEs) of the split-KV decode's partials buffer (float32 words,
    ``decode.partials_size``): word 0 the verdict (1.0 when the metadata describes these lengths), from word
    ``PARTIALS_HEADER`` pieces x rows x DV normalised values, then pieces x rows log2 LSEs. The values are
    float32, or with ``OUT_TYPED`` in ``out_ptr``'s dtype (the portable kernel's: half the bytes for bf16/fp16,
    rounded like a one-piece request's own output; the merge adds them in float32)."""
    vty: tl.constexpr = out_ptr.dtype.element_ty if OUT_TYPED else tl.float32
    values = part_ptr + PARTIALS_HEADER
    lse = values + pieces.to(tl.int64) * rows * (DV * vty.primitive_bitwidth // 32)
    return part_ptr, values.to(tl.pointer_type(vty)), lse


@triton.jit
def checked_length(length, capacity):
    """(length clamped to 0 .. capacity; the error bits of what was wrong: negative, or beyond the block
    table's capacity = its pages x page size)."""
    bits = tl.where(length < 0, NEGATIVE_LENGTH, 0) | tl.where(length > capacity, LENGTH_BEYOND_TABLE, 0)
    return tl.minimum(tl.maximum(length, 0), capacity), bits


@triton.jit
def report(err_ptr, bits):
    """OR ``bits`` (a scalar) into the error word, when any is set."""
    if bits != 0:
        tl.atomic_or(err_ptr, bits)


@triton.jit
def finish_rows(l_i, m2, bad):
    """(1 / l, log2 LSE) of rows with softmax denominator ``l_i`` and log2 row max ``m2`` (scaled): a row
    that saw no key (l = 0) gives 0 and -inf; ``bad`` (a scalar) or a NaN score makes both NaN, so that a
    corrupt row never passes for an empty one."""
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m2 + tl.log2(tl.where(empty, 1.0, l_i)))
    nan = float("nan")
    return tl.where(bad, nan, inv_l), tl.where(bad, nan, lse2)


@triton.jit
def indptr_is_partition(indptr_ptr, n, total, lanes):
    """Whether ``indptr`` [n + 1] starts at 0, never decreases and ends at ``total``: the rows it assigns to
    its n sequences are disjoint and cover 0 .. total - 1. Reads it ``lanes`` (an arange, with the caller's
    layout in Gluon kernels) entries at a time."""
    CHUNK: tl.constexpr = lanes.shape[0]
    ok = (tl.load(indptr_ptr) == 0) & (tl.load(indptr_ptr + n) == total)
    for c in range(0, n, CHUNK):
        j = c + lanes
        lo = tl.load(indptr_ptr + j, mask=j < n, other=0)
        hi = tl.load(indptr_ptr + j + 1, mask=j < n, other=0)
        ok = ok & (tl.max((hi < lo).to(tl.int32), 0) == 0)
    return ok


@triton.jit
def store_nan(o_ptrs, lse_ptrs, row_ok, col_ok):
    """NaN into the output block ``o_ptrs`` [R, C] (rows ``row_ok``, columns ``col_ok``) and its LSEs
    ``lse_ptrs`` [R]: the defined result of rows whose indices could not be trusted."""
    nan = float("nan")
    tl.store(o_ptrs, tl.full(o_ptrs.shape, nan, o_ptrs.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(lse_ptrs, tl.full(lse_ptrs.shape, nan, lse_ptrs.dtype.element_ty), mask=row_ok)
