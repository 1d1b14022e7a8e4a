"""What Triton emits for the decode main kernel on Hopper, without a GPU.

Compiles ``_decode_split_kernel`` ahead of time for sm_90a (``triton.compile`` with the argument
specialisation a real launch gets: 16-divisible pointers and strides, ``Q_LEN`` 1 as a constant, tensor
descriptors where the config uses TMA), or the Hopper Gluon kernel for configs ending in ``h`` (the Hopper
decode kernels with the same specialisation, ``_decode_launch_source``), and
reports, from the compiled artefacts: shared memory, registers and spills (the Triton wheel's ``ptxas
-v``), the MMA instructions and their shapes, the wgmma wait depths, the KV buffers of the key loop (their
leading dimension is the number of pipeline buffers), the ``cp.async`` wait depths and the register
budgets (``setmaxnreg``) of warp-specialised kernels, the wgmma waits ptxas injects, the L2 hints of loads
and stores, the stores' widths, and the SASS's instruction count and its ``R2UR`` moves (the wheel's
``nvdisasm``: values ptxas cannot prove warp-uniform reach the uniform datapath through them, NOTES Prefill
v14). The Hopper decode kernels are compiled as their launcher compiles them: again from their PTX with every
TMA load at L2 evict-first (``sm90.pipeline.tma_loads_evict_first``). Triton-internal APIs (3.6); the numbers
describe code, not speed.

    python benchmarks/compile_report.py                          # the default configs for 16, 32, 128 rows
    python benchmarks/compile_report.py --config m16n32w4s3c4p   # one config (bench_decode's spec syntax)
    python benchmarks/compile_report.py --config m64n64w8s2c1h   # the Hopper kernel
    python benchmarks/compile_report.py --kv-format fp8_ds_mla   # the portable kernel on an FP8 cache
    python benchmarks/compile_report.py --decode-seesaw          # the Hopper seesaw decode kernel (>= 128 rows)
    python benchmarks/compile_report.py --combine                # the decode combine kernel
    python benchmarks/compile_report.py --decode-sm90-fp8 --kv-format fp8_ds_mla  # the Hopper FP8 decode kernel
    python benchmarks/compile_report.py --decode-sm90-fp8 --narrow 16  # its narrow form (up to 16 rows)
    python benchmarks/compile_report.py --paged-varlen-sm90           # the Hopper paged-prefill kernel
    python benchmarks/compile_report.py --varlen-sm90            # the Hopper ragged kernel, 192/128
    python benchmarks/compile_report.py --varlen-sm90 --per-seq  # the same, per-sequence tile numbering
    python benchmarks/compile_report.py --varlen-sm90 --wg-partitions  # its long-prompt form

Run it without ``TRITON_INTERPRET`` (the interpreter replaces the kernels it compiles).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.language import target_info

from pagedmla.kernels.triton.common import KV_FORMATS, LOG2E, kv_format_width
from pagedmla.kernels.triton.decode import DecodeConfig, _decode_split_kernel, default_config, fp8_pairs
from pagedmla.kernels.triton.launch import rewritten_ptx_file
from pagedmla.kernels.triton.sm90.varlen import key_loop_wait_barriers
from pagedmla.split_plan import BLOCK_N as SCHED_N
from pagedmla.split_plan import METADATA_WIDTH

D, DV, PAGE = 576, 512, 64


def _gluon_desc(width: int, rows: int = 64) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {width}],{layout!r}>"


def _gluon_descs(q_rows: int = 64) -> dict[str, str]:
    return {"q_desc": _gluon_desc(DV, q_rows), "q_pe_desc": _gluon_desc(D - DV, q_rows), "kv_desc": _gluon_desc(DV),
            "kv_pe_desc": _gluon_desc(D - DV)}


def _compile_as_launched(src, arch: int, cached, num_warps: int = 4) -> object:
    """``src`` compiled for sm_``arch``a as its launcher (the ``CachedKernel`` ``cached``) compiles it: again
    from the PTX its ``ptx_pass`` rewrites, where it has one (the Hopper decode kernels' evict-first loads)."""
    target, options = GPUTarget("cuda", arch, 32), dict(num_warps=num_warps)
    compiled = triton.compile(src, target=target, options=options)
    path = rewritten_ptx_file(cached.ptx_pass, compiled.asm["ptx"])
    return compiled if path is None else triton.compile(src, target=target, options=dict(options, ir_override=path))


def compile_paged_varlen_sm90(arch: int = 90, kv_scale: bool = False):
    """The Hopper Gluon paged-prefill kernel (``sm90/paged_varlen.py``) for bf16, page 64, causal; with
    ``kv_scale`` over an fp8_e4m3 cache's dequantised pages (the scale read on the device)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from pagedmla.kernels.triton.sm90.paged_varlen import _MAIN, _paged_varlen_sm90_kernel

    signature = _gluon_descs()
    signature.update({name: "*i32" for name in ("bt_ptr", "seqlens_ptr", "qo_ptr")})
    signature.update(out_ptr="*bf16", lse_ptr="*fp32", counter="*i32", err_ptr="*i32", T="i32", H="i32", batch="i32",
                     T_rows="i32", qk_scale="fp32", stride_btb="i32", max_pages="i32", num_pages="i32",
                     kv_scale_ptr="*fp32" if kv_scale else "constexpr")
    constexprs = dict(CAUSAL=True, PAGE=PAGE, SEARCH_STEPS=4, KV_SCALED=kv_scale)
    if not kv_scale:
        constexprs["kv_scale_ptr"] = None
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(_paged_varlen_sm90_kernel, signature, constexprs=constexprs)
    return _compile_as_launched(src, arch, _MAIN)


def compile_varlen_sm90(arch: int = 90, dk: int = 192, dv: int = 128, per_seq: bool = False, cta: bool = True):
    """The Hopper Gluon ragged-attention kernel (``sm90/varlen.py``) for bf16, causal, with the padded or
    (``per_seq``) the per-sequence tile numbering, its one-partition consumer (``cta``, prompts up to
    ``CTA_SEQLEN``) or a partition per warpgroup."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from pagedmla.kernels.triton.sm90.varlen import _MAIN, BLOCK_M, BLOCK_N, _varlen_sm90_kernel

    def desc(rows: int, width: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {width}],{layout!r}>"

    dk1 = 128 if dk == 192 else dk
    pe = (dk - dk1) or 64
    q_rows = BLOCK_M if cta else BLOCK_M // 2
    signature = {"q_desc": desc(q_rows, dk1), "q_pe_desc": desc(q_rows, pe), "k_desc": desc(BLOCK_N, dk1),
                 "k_pe_desc": desc(BLOCK_N, pe), "v_desc": desc(BLOCK_N, dv), "out_ptr": "*bf16", "lse_ptr": "*fp32",
                 "cu_q": "*i32", "cu_k": "*i32", "counter": "*i32", "err_ptr": "*i32", "H": "i32", "GROUP": "i32",
                 "NM": "i32", "WIN": "i32", "T": "i32", "batch": "i32", "Tq": "i32", "Tk": "i32", "MAXQ": "i32",
                 "qk_scale": "fp32", "stride_ot": "i32", "stride_oh": "i32"}
    constexprs = dict(DK1=dk1, DK2=dk - dk1, DV=dv, CAUSAL=True, SEARCH_STEPS=5 if per_seq else 1, PER_SEQ=per_seq,
                      CTA=cta)
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(_varlen_sm90_kernel, signature, constexprs=constexprs)
    return _compile_as_launched(src, arch, _MAIN, num_warps=8 if cta else 4)


def _decode_launch_source(kernel, signature: dict[str, str], constexprs: dict, rows: int):
    """The Gluon source of a Hopper decode kernel specialised as a launch at batch 128, q_len 1, ``rows`` query
    rows (= heads), 4096-token requests and page 64 specialises it (the JIT's rules): every pointer 16-byte
    aligned (torch's allocations), integer arguments divisible by 16 marked so (the strides and the batch;
    not the part count or the pieces), q_len 1 a constant. Without them the partial and output stores compile
    to 4- and 2-byte stores where the launched kernel's are 8 and 4 bytes."""
    from triton.experimental.gluon._runtime import GluonASTSource

    pages = 4096 // PAGE + 3  # the benchmark's widest table row at mean 4096
    parts = 132 // max(1, rows // 64)
    ints = dict(B=128, PARTS=parts, H=rows, Q_LEN=1, ROWS=rows, stride_btb=pages, PIECES=128 + parts,
                CAPACITY=pages * PAGE, num_pages=128 * pages + 1, stride_ob=rows * DV, stride_ot=rows * DV,
                stride_oh=DV)
    signature, constexprs = dict(signature), dict(constexprs)
    signature["Q_LEN"], constexprs["Q_LEN"] = "constexpr", ints["Q_LEN"]
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    aligned = [name for name, ty in signature.items() if ty.startswith("*")]
    aligned += [name for name, value in ints.items() if signature.get(name) == "i32" and value % 16 == 0]
    attrs = {(kernel.arg_names.index(name),): backend.parse_attr("D") for name in aligned}
    return GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)


def _compile_hopper_decode(kernel, cached, descs: dict[str, str], arch: int, rows: int, **extra):
    """One of the two Hopper decode kernels (the same arguments, ``descs`` their descriptor types; ``cached``
    its launcher's ``CachedKernel``) for bf16, page 64, causal, ``rows`` query rows, as launched
    (``_decode_launch_source``); ``extra``: more constexpr arguments."""
    signature = dict(descs)
    signature.update({name: "*i32" for name in ("bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr")})
    signature.update(out_ptr="*bf16", lse_ptr="*fp32", partials_ptr="*fp32", err_ptr="*i32")
    signature.update({name: "i32" for name in ("B", "PARTS", "H", "Q_LEN", "ROWS")}, qk_scale="fp32")
    signature.update({name: "i32" for name in ("stride_btb", "PIECES", "CAPACITY", "num_pages", "stride_ob",
                                                "stride_ot", "stride_oh")})
    constexprs = dict(CAUSAL=True, PAGE=PAGE, META_W=METADATA_WIDTH, PDL=True, WAIT_PRIOR=True, **extra)
    signature.update({name: "constexpr" for name in constexprs})
    return _compile_as_launched(_decode_launch_source(kernel, signature, constexprs, rows), arch, cached)


def compile_sm90(arch: int = 90, rows: int = 64):
    """The Hopper Gluon main kernel compiled for bf16, page 64, causal, over Q tiles of ``rows`` rows (64, or
    the transposed form's 16 / 32), with bf16 partials from 32 rows, as the plan runs batch 128 (many
    requests)."""
    from pagedmla.kernels.triton.sm90.decode import _MAIN, _decode_sm90_kernel

    return _compile_hopper_decode(_decode_sm90_kernel, _MAIN, _gluon_descs(rows), arch, rows, TRANSPOSED=rows < 64,
                                  OUT_TYPED=rows >= 32)


def compile_seesaw(arch: int = 90):
    """The Hopper Gluon seesaw main kernel (``sm90/seesaw.py``) compiled for bf16, page 64, causal, with bf16
    partials (batch 128: many requests)."""
    from pagedmla.kernels.triton.sm90.seesaw import _SEESAW, _decode_seesaw_kernel

    descs = {"q_desc": _gluon_desc(DV // 2), "q_pe_desc": _gluon_desc(D - DV), "kv_desc": _gluon_desc(DV // 2),
             "kv_pe_desc": _gluon_desc(D - DV)}
    return _compile_hopper_decode(_decode_seesaw_kernel, _SEESAW, descs, arch, 128, OUT_TYPED=True)


def compile_sm90_fp8(kv_format: str, arch: int = 90, rows: int = 64):
    """The Hopper Gluon FP8-cache decode kernel (``sm90/decode_fp8.py``) for bf16 q, page 64, causal, over a
    ``kv_format`` cache, as its launcher compiles it: Q tiles of ``rows`` rows (64, or the narrow form's 16 /
    32)."""
    from pagedmla.kernels.triton.sm90.decode_fp8 import (
        _FORMAT_IDS,
        _MAIN,
        _decode_sm90_fp8_kernel,
        _fp8_layout,
        _scales_layout,
    )

    def desc(dtype: str, width: int, layout) -> str:
        return f"tensordesc<{dtype}[64, {width}],{layout!r}>"

    e4m3 = kv_format == "fp8_e4m3"
    signature = {"q_desc": _gluon_desc(DV, rows), "q_pe_desc": _gluon_desc(D - DV, rows),
                 "lat_desc": desc("fp8e4nv", DV, _fp8_layout(64, DV)),
                 "pe_desc": desc("fp8e4nv", D - DV, _fp8_layout(64, D - DV)) if e4m3 else _gluon_desc(D - DV),
                 "sc_desc": "constexpr" if e4m3 else desc("fp32", 4, _scales_layout())}
    signature.update({name: "*i32" for name in ("bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr")})
    signature.update(out_ptr="*bf16", lse_ptr="*fp32", partials_ptr="*fp32", err_ptr="*i32",
                     kv_scale_ptr="*fp32" if e4m3 else "constexpr")
    signature.update({name: "i32" for name in ("B", "PARTS", "H", "Q_LEN", "ROWS")}, qk_scale="fp32")
    signature.update({name: "i32" for name in ("stride_btb", "PIECES", "CAPACITY", "num_pages", "stride_ob",
                                                "stride_ot", "stride_oh")})
    constexprs = dict(CAUSAL=True, PAGE=PAGE, META_W=METADATA_WIDTH, PDL=True, WAIT_PRIOR=True,
                      KV_FMT=_FORMAT_IDS[kv_format], TRANSPOSED=rows < 64)
    signature.update({name: "constexpr" for name in constexprs})
    constexprs.update({"sc_desc": None} if e4m3 else {"kv_scale_ptr": None})
    src = _decode_launch_source(_decode_sm90_fp8_kernel, signature, constexprs, rows)
    return _compile_as_launched(src, arch, _MAIN)


@contextlib.contextmanager
def _targeting(target: GPUTarget):
    """Kernels' target checks (``triton.language.target_info``, e.g. the FP8 word tiles' inline PTX) see
    ``target``: they read the active driver's device, and this machine may have none."""
    active = target_info.current_target

    def current_target():
        return target

    current_target.__triton_builtin__ = True  # as Triton marks its own, for the kernels' dependency hashing
    target_info.current_target = current_target
    try:
        yield
    finally:
        target_info.current_target = active


def compile_decode(cfg: DecodeConfig, heads: int, arch: int = 90, kv_format: str | None = None):
    """The compiled kernel (``.asm`` holds ttgir / ptx / cubin) for bf16 q, q_len 1, page 64, causal, over a
    cache of q's dtype or, with ``kv_format``, an FP8 one (``pagedmla.kv_format``: its bytes, as the
    launcher passes them)."""
    if cfg.use_sm90:
        if kv_format is not None:
            raise ValueError(f"kv_format: the Hopper kernels read bf16/fp16 caches, not {kv_format}")
        return compile_sm90(arch, cfg.block_m)
    from triton.runtime.jit import MockTensor
    from triton.tools.tensor_descriptor import TensorDescriptor

    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    width = kv_format_width(kv_format, D)
    kv_dtype = bf16 if kv_format is None else torch.uint8
    desc = desc_pe = None
    if cfg.use_tma:
        flat = torch.empty(16 * PAGE, width, dtype=kv_dtype)  # only shape, dtype and block shape reach the type
        # FP8 latent bytes as 16-bit words where the kernel reads them so (the launcher's view).
        lat = flat.view(torch.int16) if fp8_pairs(cfg, kv_format) else flat
        desc = TensorDescriptor(lat, list(lat.shape), [lat.shape[1], 1], [cfg.block_n, DV // cfg.chunks])
        # fp8_ds_mla's rope columns are bf16 values at a 16-byte aligned offset of the row (the launcher's view).
        pe = flat.view(bf16) if kv_format == "fp8_ds_mla" else flat
        desc_pe = TensorDescriptor(pe, list(pe.shape), [pe.shape[1], 1], [cfg.block_n, D - DV])
    values = dict(
        q_ptr=MockTensor(bf16), kv_ptr=MockTensor(kv_dtype), bt_ptr=MockTensor(i32), seqlens_ptr=MockTensor(i32),
        meta_ptr=MockTensor(i32), splits_ptr=MockTensor(i32), out_ptr=MockTensor(bf16), lse_ptr=MockTensor(f32),
        part_ptr=MockTensor(f32), err_ptr=MockTensor(i32), desc=desc, desc_pe=desc_pe,
        scale_ptr=MockTensor(f32) if kv_format == "fp8_e4m3" else None,
        B=128, H=heads, Q_LEN=1, ROWS=heads, NUM_PAGES=4099, MAX_PAGES=67, qk_scale=D ** -0.5 * LOG2E,
        stride_qb=heads * D, stride_qt=heads * D, stride_qh=D, stride_page=PAGE * width, stride_tok=width,
        stride_btb=64, stride_ob=heads * DV, stride_ot=heads * DV, stride_oh=DV,
    )
    constants = dict(CAUSAL=True, PAGE=PAGE, SCHED_N=SCHED_N, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DV=DV,
                     NC=cfg.chunks, DR=D - DV, HAS_PE=True, META_W=METADATA_WIDTH, USE_TMA=cfg.use_tma,
                     CARRY_PAGES=cfg.carry_pages, PRECISION="tf32",
                     KV_FMT=0 if kv_format is None else KV_FORMATS[kv_format], NAN_FIXUP=False,
                     PAIRS=fp8_pairs(cfg, kv_format), PDL=True, OUT_TYPED=True, WAIT_PRIOR=True)
    return _compile_jit(_decode_split_kernel, values, constants, arch, cfg.num_warps, cfg.num_stages)


def _compile_jit(fn, values: dict, constants: dict, arch: int, num_warps: int, num_stages: int):
    """The ``@triton.jit`` kernel ``fn`` compiled with the specialisation a launch with ``values`` (argument
    name -> a ``MockTensor`` or a scalar) gets, ``constants`` its constexpr arguments."""
    from triton._C.libtriton import native_specialize_impl

    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name], constexprs[name] = "constexpr", constants[name]
            continue
        ty, spec = native_specialize_impl(CUDABackend, values[name], False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = values[name]
        elif isinstance(spec, str):
            attrs[(i,)] = backend.parse_attr(spec)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    with _targeting(target):
        return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_combine(arch: int = 90, heads: int = 64):
    """The decode combine kernel as the plan launches it after a Hopper main kernel at batch 128, q_len 1:
    float32 partials, 16-row tiles of 128 columns, ``COMBINE_PIECES_MANY`` pieces a step (many requests), as
    a programmatic dependent."""
    from triton.runtime.jit import MockTensor

    from pagedmla.kernels.triton.decode import COMBINE_PIECES_MANY, _decode_combine_kernel

    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    values = dict(out_ptr=MockTensor(bf16), lse_ptr=MockTensor(f32), part_ptr=MockTensor(f32),
                  splits_ptr=MockTensor(i32), seqlens_ptr=MockTensor(i32), err_ptr=MockTensor(i32), B=128, H=heads,
                  Q_LEN=1, ROWS=heads, PARTS=132, CAPACITY=4096, stride_ob=heads * DV, stride_ot=heads * DV,
                  stride_oh=DV)
    constants = dict(DV=DV, BLOCK_R=16, BLOCK_D=128, PIECES=COMBINE_PIECES_MANY, PDL=True, OUT_TYPED=False)
    return _compile_jit(_decode_combine_kernel, values, constants, arch, 4, 3)


def report(kernel, arch: int = 90) -> dict:
    """Counts read off the compiled artefacts (see the module docstring)."""
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    out = {"shared_bytes": kernel.metadata.shared}
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        res = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{arch}a", path, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
        sass = subprocess.run([str(ptxas.with_name("nvdisasm")), os.path.join(tmp, "k.o")], capture_output=True,
                              text=True).stdout if res.returncode == 0 else ""
    opcodes = re.findall(r"(?m)^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    out["sass_instructions"] = len(opcodes)
    out["sass_r2ur"] = opcodes.count("R2UR")
    info = res.stderr
    regs = re.search(r"Used (\d+) registers", info)
    out["registers"] = int(regs.group(1)) if regs else None
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    out["spill_store_load_bytes"] = (int(spill.group(1)), int(spill.group(2))) if spill else None
    # Waits ptxas adds for registers it cannot prove free of an in-flight wgmma (its note C7517): each one
    # holds the warpgroup until every MMA issued so far is done (NOTES decode v25).
    out["ptxas_injected_waits"] = len(re.findall(r"\(C7517\) warpgroup\.wait is injected", info))
    out["mma_sync"] = dict(collections.Counter(re.findall(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    out["wgmma"] = dict(collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    out["wgmma_wait_depths"] = sorted(set(map(int, re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))))
    out["kv_buffers"] = sorted(set(map(int, re.findall(
        r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+xbf16", ttgir))))
    out["cp_async_wait_depths"] = sorted(set(map(int, re.findall(r"ttg\.async_wait .*?\{num = (\d+)", ttgir))))
    out["cp_async"] = len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx))
    out["tma_loads"] = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    # TMA loads given an evict-first policy in their own scope (``sm90.pipeline.tma_loads_evict_first``).
    out["evict_first_tma_loads"] = len(re.findall(
        r"createpolicy\.fractional\.L2::evict_first\.b64 (%\w+), 1\.0; (?:@!?%\w+\s+)?cp\.async\.bulk\.tensor"
        r"\.\d+d\.shared::\w+\.global[\w.:]*\.L2::cache_hint [^;]*, \1; }", ptx))
    out["ldmatrix_trans"] = len(re.findall(r"ldmatrix\.sync\.aligned\.[\w.]*trans", ptx))
    # fp8 word tiles converted by ``common._e4m3_pairs_ptx`` (its byte permute, one per two words).
    out["e4m3_pair_permutes"] = len(re.findall(r"prmt\.b32 \S+, \S+, \S+, 0x3120;", ptx))
    # Hardware conversions of two e4m3 values to fp16 (the Hopper FP8 decode's in-place widening).
    out["e4m3x2_converts"] = ptx.count("cvt.rn.f16x2.e4m3x2")
    # Barriers of both consumer warpgroups before an mbarrier wait in a depth-2 loop: Triton 3.6 puts one before
    # the ragged one-partition kernel's K wait in every key-loop iteration, which its PTX pass removes
    # (``sm90.varlen.drop_key_loop_barrier``, NOTES Prefill v12: 16-19% on long prompts).
    out["key_loop_wait_barriers"] = len(key_loop_wait_barriers(ptx))
    out["shared_byte_loads"] = len(re.findall(r"ld\.shared(?:\.v[24])?\.[ubs]8\b", ptx))
    out["setmaxnreg"] = sorted(set(map(int, re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))))
    # Global stores kept in L2 ahead of the streamed rows (``common.PARTIALS_EVICTION``: the split-KV partials).
    out["evict_last_stores"] = len(re.findall(r"st\.global\.L1::evict_last\.L2::cache_hint", ptx))
    out["global_stores"] = len(re.findall(r"\bst\.global\.", ptx))
    # Of those, stores of 2 or 4 elements per thread (8 or 16 bytes of fp32, 4 or 8 of bf16): the MMA layout's
    # pairs of adjacent columns, which a store of one element each would leave as half sectors.
    out["vector_global_stores"] = len(re.findall(r"\bst\.global(?:\.[\w:]+)*\.v[24]\.", ptx))
    # Partial stores of one 16-bit element: with 16-bit partials (``OUT_TYPED``) a pair is one 32-bit store.
    out["evict_last_b16_stores"] = len(re.findall(r"st\.global\.L1::evict_last\.L2::cache_hint\.b16", ptx))
    # A main kernel launched as its predecessor's programmatic dependent reads nothing before its
    # ``griddepcontrol.wait`` (``common.wait_prior_options``): the global accesses the PTX has ahead of it.
    first_wait = ptx.find("griddepcontrol.wait")
    out["prior_waits"] = ptx.count("griddepcontrol.wait")
    out["global_accesses_before_prior_wait"] = None if first_wait < 0 else len(re.findall(
        r"\b(?:ld|st|atom|red)\.global\.|\bcp\.async\.", ptx[:first_wait]))
    # The combine, the main kernel's programmatic dependent, reads the schedule and the lengths before its own
    # wait: safe only if no main program lets it start before the main kernel's wait for its predecessor.
    out["dependent_launches"] = ptx.count("griddepcontrol.launch_dependents")
    out["dependent_launches_before_prior_wait"] = None if first_wait < 0 else ptx[:first_wait].count(
        "griddepcontrol.launch_dependents")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", help="a config spec (repeatable); default: the shipped ones")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default: the config's rows)")
    ap.add_argument("--json", action="store_true", help="print one JSON list of the reports instead")
    ap.add_argument("--decode-seesaw", action="store_true", help="report the Hopper seesaw decode kernel instead")
    ap.add_argument("--combine", action="store_true", help="report the decode combine kernel instead")
    ap.add_argument("--decode-sm90-fp8", action="store_true",
                    help="report the Hopper FP8-cache decode kernel instead (--kv-format picks the format)")
    ap.add_argument("--paged-varlen-sm90", action="store_true", help="report the Hopper paged-prefill kernel instead")
    ap.add_argument("--varlen-sm90", action="store_true", help="report the Hopper ragged kernel (192/128) instead")
    ap.add_argument("--per-seq", action="store_true", help="with --varlen-sm90: the per-sequence tile numbering")
    ap.add_argument("--wg-partitions", action="store_true",
                    help="with --varlen-sm90: a consumer partition per warpgroup (prompts outside CTA_SEQLEN)")
    ap.add_argument("--narrow", type=int, choices=(16, 32), default=None,
                    help="with --decode-sm90-fp8: its narrow (transposed) form over Q tiles of this many rows")
    ap.add_argument("--kv-format", choices=("fp8_e4m3", "fp8_ds_mla"), default=None,
                    help="the portable decode kernel over an FP8 cache (default: bf16 rows); with "
                         "--decode-sm90-fp8 its format")
    args = ap.parse_args(argv)
    if args.decode_seesaw or args.combine or args.decode_sm90_fp8 or args.paged_varlen_sm90 or args.varlen_sm90:
        if args.decode_seesaw:
            kernel = compile_seesaw()
        elif args.combine:
            kernel = compile_combine()
        elif args.decode_sm90_fp8:
            kernel = compile_sm90_fp8(args.kv_format or "fp8_e4m3", rows=args.narrow or 64)
        elif args.paged_varlen_sm90:
            kernel = compile_paged_varlen_sm90()
        else:
            kernel = compile_varlen_sm90(per_seq=args.per_seq, cta=not args.wg_partitions)
        rep = report(kernel)
        print(json.dumps([rep]) if args.json else "\n".join(f"  {k}: {v}" for k, v in rep.items()))
        return 0
    try:
        if args.config:
            cases = [(args.heads or max(cfg.block_m, 16), cfg) for cfg in map(DecodeConfig.from_spec, args.config)]
        elif args.kv_format:
            cases = [(rows, default_config(rows, fp8=True)) for rows in (16, 32, 64)]
        else:
            cases = [(rows, default_config(rows)) for rows in (16, 32, 128)]
            cases.append((128, DecodeConfig(block_m=64, use_sm90=True)))
        if args.kv_format and any(cfg.use_sm90 for _, cfg in cases):
            raise ValueError(f"--kv-format: the Hopper kernels read bf16/fp16 caches, not {args.kv_format}")
    except ValueError as exc:
        ap.exit(2, f"compile_report: error: {exc}\n")
    reports = []
    for heads, cfg in cases:
        rep = report(compile_decode(cfg, heads, kv_format=args.kv_format))
        reports.append(rep)
        if not args.json:
            print(f"{cfg} (heads {heads}, q_len 1, page {PAGE}, bf16 q, {args.kv_format or 'bf16'} cache, sm_90a)",
                  flush=True)
            for key, value in rep.items():
                print(f"  {key}: {value}")
    if args.json:
        print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
