"""The decode kernel compiled for sm_90a on the CPU (benchmarks/compile_report.py, no GPU needed): the
code properties benchmarks/NOTES.md (v5) relies on, so that a Triton upgrade that changes them is noticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
libtriton = pytest.importorskip("triton._C.libtriton")
if not (hasattr(libtriton, "native_specialize_impl") and PTXAS.exists()):
    pytest.skip("needs Triton 3.6's specialisation API and the wheel's ptxas", allow_module_level=True)


def _reports(*specs: str, extra: tuple[str, ...] = ()) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = [sys.executable, str(ROOT / "benchmarks" / "compile_report.py"), "--json", *extra]
    for spec in specs:
        args += ["--config", spec]
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_carried_page_ids_double_buffer_the_small_tiles():
    base16, carried16, carried32 = _reports("m16n32w4s3c4", "m16n32w4s3c4p", "m32n32w4s3c4p")
    # Page id read in the same step: one KV buffer, every wait drains all copies (no prefetch).
    assert base16["kv_buffers"] == [1] and base16["cp_async_wait_depths"] == [0]
    for rep in (carried16, carried32):
        assert rep["kv_buffers"] == [2] and max(rep["cp_async_wait_depths"]) > 0, rep
        # Two CTAs per SM must still fit in the H100/H200's 228 KB (1 KB reserved per CTA).
        assert 2 * (rep["shared_bytes"] + 1024) <= 228 * 1024, rep
        assert rep["mma_sync"] and not rep["wgmma"], rep
    # The bf16 16-row kernel scales its scores by one scalar: with the per-row vector that only fp8_e4m3's
    # rescaled q rows need, ptxas gave the same code 186 registers instead of 252 and it ran 4-5% slower on the
    # H200 (benchmarks/NOTES.md, decode v19).
    assert carried16["registers"] >= 240, carried16
    # The partial results are stored with L2 priority (common.PARTIALS_EVICTION, decode v23), the output and the
    # verdict word without it.
    for rep in (base16, carried16, carried32):
        assert 0 < rep["evict_last_stores"] < rep["global_stores"], rep
        _waits_for_the_prior_kernel(rep)


def _waits_for_the_prior_kernel(rep: dict) -> None:
    """Built as launched on a Hopper GPU (``common.wait_prior_options``): one ``griddepcontrol.wait``, no
    global load or store before it (the warp-specialised kernels' partitions start after it, at the
    partition split), and the combine let start only after it (the combine reads the schedule and the
    lengths before its own wait, ``decode._decode_combine_kernel``)."""
    assert rep["prior_waits"] == 1 and rep["global_accesses_before_prior_wait"] == 0, rep
    assert rep["dependent_launches"] >= 1 and rep["dependent_launches_before_prior_wait"] == 0, rep


def _fp8_reports(fmt: str) -> list[dict]:
    return _reports(extra=("--kv-format", fmt))


@pytest.mark.parametrize("fmt, spills", [("fp8_e4m3", ((0, 0), (4, 4), (200, 208))),
                                         ("fp8_ds_mla", ((0, 0), (32, 32), (360, 372)))])
def test_fp8_tiles(fmt, spills):
    """The portable decode over FP8 caches (default tiles for 16, 32 and 64 rows, benchmarks/NOTES.md FP8):
    up to 32 rows the tiles come by TMA (pointer loads feeding the conversion were not pipelined) as 16-bit
    words, so that shared memory is read by ldmatrix (transposed for the value operand) and never a byte at a
    time (``decode.fp8_pairs``; the byte loads, 128 per build, took 9-23% longer on the H200); 16-row programs
    still fit two per SM, the 64-row tiles (three pointer-load stages, wgmma) fit one CTA's 227 KB; spills
    bounded at today's build (2026-12-02 cross-compile), so that a new spill is noticed."""
    r16, r32, r64 = _fp8_reports(fmt)
    assert r16["tma_loads"] > 0 and r32["tma_loads"] > 0 and r64["tma_loads"] == 0, (r16, r32, r64)
    for rep in (r16, r32):
        assert rep["shared_byte_loads"] == 0 and rep["ldmatrix_trans"] > 0, rep
        # Built for sm_90a, the words convert by the inline PTX byte permute + e4m3x2 conversion.
        assert rep["e4m3_pair_permutes"] > 0, rep
    assert r64["e4m3_pair_permutes"] == 0, r64
    assert 2 * (r16["shared_bytes"] + 1024) <= 228 * 1024, r16
    assert r64["shared_bytes"] <= 227 * 1024, r64
    for rep, (stores, loads) in zip((r16, r32, r64), spills):
        assert rep["spill_store_load_bytes"][0] <= stores and rep["spill_store_load_bytes"][1] <= loads, rep


def test_hopper_kernel_structure():
    """The Gluon kernel's plan (sm90/decode.py): S computed once (36 m64n64k16 MMAs per tile), P V split in
    two warpgroups (4 m64n256k16 each), a two-stage KV ring loaded by TMA, register budgets set per
    partition, nothing spilled, within the 227 KB of shared memory one CTA may use."""
    pytest.importorskip("triton.experimental.gluon")
    (rep,) = _reports("m64n64w8s2c1h")
    assert rep["wgmma"] == {"m64n64k16": 36, "m64n256k16": 8}, rep
    assert rep["kv_buffers"] == [2] and rep["tma_loads"] > 0 and not rep["mma_sync"], rep
    assert rep["spill_store_load_bytes"] == [0, 0], rep
    assert rep["shared_bytes"] <= 227 * 1024 and 32 in rep["setmaxnreg"], rep
    assert 0 < rep["evict_last_stores"] < rep["global_stores"], rep  # the partials only (PARTIALS_EVICTION)
    _partials_stored_in_pairs(rep, typed=True)
    assert rep["evict_first_tma_loads"] == rep["tma_loads"], rep  # the launcher's PTX pass hints every load
    assert rep["ptxas_injected_waits"] == 0, rep
    _waits_for_the_prior_kernel(rep)


def _partials_stored_in_pairs(rep: dict, typed: bool = False) -> None:
    """Compiled as a launch specialises it (16-byte aligned pointers and strides), every partial value store
    of a Hopper kernel writes a thread's two adjacent columns at once: two fp32 as one 8-byte vector store
    (four lanes fill a 32-byte sector), the two one-element ones being the LSEs'; or with ``typed`` (bf16
    partials, many requests) two bf16 as one 32-bit store, never one 16-bit element."""
    if typed:
        assert rep["evict_last_b16_stores"] == 0 and rep["vector_global_stores"] == 0, rep
    else:
        assert rep["vector_global_stores"] == rep["evict_last_stores"] - 2, rep


def test_hopper_seesaw_kernel_structure():
    """The seesaw decode kernel (sm90/seesaw.py, 128-row requests): per pair of KV tiles each warpgroup
    computes one S (36 m64n64k16 each) and four P V k-steps per tile it adds (warpgroup 1's P_A V_A,R is
    compiled twice, for pairs with and without a tile B: 20 m64n256k16 in all); 27 TMA boxes (Q and two KV
    slots, each as 4 + 4 + 1 boxes of 64 columns); per-partition register budgets and, in the partitions,
    no spill: the 8 bytes are one value passed to the loader before the partitions split (read off the SASS
    on 2026-12-02). A Triton that hoists the loop's wgmma descriptors again spills ~540 bytes here. No wgmma
    wait injected by ptxas: without the explicit one before warpgroup 1 rescales O beside S_B, ptxas waits for
    S_B there (its note C7517; NOTES decode v25)."""
    pytest.importorskip("triton.experimental.gluon")
    (rep,) = _reports(extra=("--decode-seesaw",))
    assert rep["wgmma"] == {"m64n64k16": 72, "m64n256k16": 20}, rep
    assert rep["tma_loads"] == 27 and not rep["mma_sync"], rep
    assert rep["spill_store_load_bytes"][0] <= 8 and rep["spill_store_load_bytes"][1] <= 8, rep
    assert rep["shared_bytes"] <= 227 * 1024 and {32, 232} <= set(rep["setmaxnreg"]), rep
    assert 0 < rep["evict_last_stores"] < rep["global_stores"], rep
    _partials_stored_in_pairs(rep, typed=True)
    assert rep["evict_first_tma_loads"] == rep["tma_loads"], rep
    assert rep["ptxas_injected_waits"] == 0, rep
    _waits_for_the_prior_kernel(rep)


_WIDE = {"m64n64k16": 36, "m64n256k16": 8}


@pytest.mark.parametrize("fmt, rows, wgmma, converts, spills", [
    ("fp8_e4m3", 64, _WIDE, 288, (328, 380)), ("fp8_ds_mla", 64, _WIDE, 256, (504, 554)),
    ("fp8_e4m3", 16, {"m64n16k16": 68}, 144, (12, 12)), ("fp8_ds_mla", 16, {"m64n16k16": 68}, 128, (24, 24)),
    ("fp8_e4m3", 32, {"m64n32k16": 68}, 144, (192, 204)), ("fp8_ds_mla", 32, {"m64n32k16": 68}, 128, (200, 212))])
def test_hopper_fp8_kernel_structure(fmt, rows, wgmma, converts, spills):
    """The FP8-cache Hopper decode kernel (sm90/decode_fp8.py). Over 64-row Q tiles: the one-softmax kernel's
    MMAs on its 16-bit ring (36 m64n64k16 and 8 m64n256k16) and a two-warp converter (per thread and tile: 256
    latent pairs, and fp8_e4m3's 32 rope pairs, by the hardware's two-at-a-time e4m3 conversion). Its narrow
    form (16- / 32-row tiles): S^T = K Q^T and O^T = V^T P^T with the tile's rows as every MMA's N, so no MMA
    is padded to 64 query rows (36 + 2 x 16 m64nRk16), and a four-warp converter (half the conversions per
    thread). Both: every TMA load evict-first, within the 227 KB of shared memory (fp8_ds_mla's scale ring
    included), no wgmma wait injected by ptxas, nothing read before the prior kernel's end; spills bounded at
    today's builds (2026-12-04 / 2026-12-06 cross-compiles, the partitions' budgets of sm90/decode_fp8.py; the
    32-row ones ~20 bytes more since the row sums stay per key slot, measured 7-10% faster), so that a new
    spill is noticed."""
    pytest.importorskip("triton.experimental.gluon")
    narrow = () if rows == 64 else ("--narrow", str(rows))
    (rep,) = _reports(extra=("--decode-sm90-fp8", "--kv-format", fmt, *narrow))
    assert rep["wgmma"] == wgmma and not rep["mma_sync"], rep
    assert rep["e4m3x2_converts"] == converts and rep["e4m3_pair_permutes"] == 0, rep
    assert rep["tma_loads"] > 0 and rep["evict_first_tma_loads"] == rep["tma_loads"], rep
    assert rep["shared_bytes"] <= 227 * 1024, rep
    assert rep["spill_store_load_bytes"][0] <= spills[0] and rep["spill_store_load_bytes"][1] <= spills[1], rep
    assert rep["ptxas_injected_waits"] == 0, rep
    if rows == 64:
        _partials_stored_in_pairs(rep)  # fp32 partials after the FP8 kernels
    _waits_for_the_prior_kernel(rep)


def test_hopper_prefill_kernel_structure():
    """The paged-prefill Hopper kernel reuses the decode kernel's steps: the same MMAs and ring. Its loader
    warp (32 registers) carries the next tile's bounds and the next page id and spills a few words per tile
    (read off the SASS on 2026-11-30, none in the warpgroups) and, since the value guards (2026-12-01), a few
    words computed once from kernel arguments before the partitions split and passed through local memory
    (the qo_indptr end pointer, the row count), bounded at today's 24 / 48 bytes so that any new spill fails
    here."""
    pytest.importorskip("triton.experimental.gluon")
    (rep,) = _reports(extra=("--paged-varlen-sm90",))
    assert rep["wgmma"] == {"m64n64k16": 36, "m64n256k16": 8}, rep
    assert rep["kv_buffers"] == [2] and rep["tma_loads"] > 0, rep
    assert rep["spill_store_load_bytes"][0] <= 24 and rep["spill_store_load_bytes"][1] <= 48, rep
    assert rep["shared_bytes"] <= 227 * 1024 and 32 in rep["setmaxnreg"], rep
    # Each KV tile is read again by the sequence's other row tiles: no evict-first hint here (decode's only).
    assert rep["evict_first_tma_loads"] == 0, rep
    assert rep["ptxas_injected_waits"] == 0, rep


def test_hopper_varlen_kernel_structure():
    """The ragged Hopper kernel for 192/128: 12 S and 8 P V MMAs of m64n128k16 per 128-key tile and
    warpgroup, issued from the first tile's prologue, the overlapped loop (S of tile j before P V of tile
    j - 1, waited down to one group) and the last P V; two-stage TMA rings. Its two forms: one 8-warp
    consumer partition (prompts in ``CTA_SEQLEN``: both warpgroups run one copy of the code, 40 MMAs
    in all, the key loop without a partition barrier: ``drop_key_loop_barrier``) and a partition per
    warpgroup (80 in all). Spills are bounded at today's bytes (stores / loads) so that any new one fails here
    (then read the SASS: one in the key loop costs far more than these): the one-partition form 20 / 20
    (padded numbering) and 52 / 52 (per-sequence), the other 16 / 36 and 20 / 44 (kernel arguments and tile
    bounds reloaded once per work tile; none between a partition's first and last wgmma in either form, read
    off the SASS with nvdisasm). The per-sequence bounds were 12 / 12 and 40 / 68 before the hand-off's
    fields became warp-uniform (2026-12-04: the one-partition form's 13 words are stored and reloaded around
    the tile's epilogue)."""
    pytest.importorskip("triton.experimental.gluon")
    cases = ((("--varlen-sm90",), 40, (20, 20)), (("--varlen-sm90", "--per-seq"), 40, (52, 52)),
             (("--varlen-sm90", "--wg-partitions"), 80, (16, 36)),
             (("--varlen-sm90", "--wg-partitions", "--per-seq"), 80, (20, 44)))
    reps = {}
    for extra, mmas, (stores, loads) in cases:
        (rep,) = _reports(extra=extra)
        reps[extra] = rep
        assert rep["wgmma"] == {"m64n128k16": mmas} and rep["wgmma_wait_depths"] == [0, 1], (extra, rep)
        assert rep["kv_buffers"] == [2] and rep["tma_loads"] > 0, (extra, rep)
        assert rep["spill_store_load_bytes"][0] <= stores and rep["spill_store_load_bytes"][1] <= loads, (extra, rep)
        assert rep["shared_bytes"] <= 227 * 1024 and 40 in rep["setmaxnreg"], (extra, rep)
        assert rep["ptxas_injected_waits"] == 0, (extra, rep)
        # The launched PTX holds no barrier of both warpgroups before a key-loop wait: the one Triton 3.6 puts
        # there in the one-partition form (NOTES Prefill v12, 16-19% on long prompts) is taken out by the pass.
        assert rep["key_loop_wait_barriers"] == 0, (extra, rep)
    # The per-sequence hand-off's fields reach the consumers as warp-uniform values (``receive_fields``): with
    # a lane per word and cross-lane sums, every value derived from them went per-thread and the key loop
    # moved its ring positions and wgmma descriptors into uniform registers at each use (R2UR 127 / 216
    # against the padded numbering's 60 / 120, one / two partitions; 11% more instructions and time on the
    # H200, NOTES Prefill v14). Now 68 / 130.
    for form in ((), ("--wg-partitions",)):
        padded, per_seq = reps[("--varlen-sm90", *form)], reps[("--varlen-sm90", *form, "--per-seq")]
        assert per_seq["sass_r2ur"] <= padded["sass_r2ur"] + 24, (form, per_seq["sass_r2ur"], padded["sass_r2ur"])


def test_combine_reads_only_the_schedule_and_length_before_its_wait():
    """The combine, the main kernel's programmatic dependent, reads num_splits' two entries and the request's
    length before its ``griddepcontrol.wait`` (the main kernels let it start only after their own wait, above)
    and nothing else: the verdict and the pieces are the main kernel's results (decode v35)."""
    (rep,) = _reports(extra=("--combine",))
    assert rep["prior_waits"] == 1 and rep["global_accesses_before_prior_wait"] == 3, rep
    assert rep["spill_store_load_bytes"] == [0, 0], rep  # JSON: a list
