"""CachedKernel: launches through the compiled handle must never reuse a kernel specialised differently."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from pagedmla.kernels.triton.launch import CachedKernel, _spec, unaligned_mask


def test_spec_separates_what_triton_specialises_on():
    x = torch.zeros(64, dtype=torch.float16)
    assert _spec(x) == _spec(torch.zeros(8, dtype=torch.float16))
    assert _spec(x) != _spec(x[1:]), "16-byte alignment"
    assert _spec(x) != _spec(x.float())
    assert _spec(1) != _spec(2) and _spec(16) != _spec(17) and _spec(17) == _spec(19)
    assert _spec(2 ** 31 + 1) != _spec(17), "int64 values"
    assert _spec(True) != _spec(1) and _spec(0.5) == _spec(2.0) and _spec(None) is None
    assert _spec("ieee") != _spec("tf32")


def test_unaligned_mask_marks_each_pointer_off_16_bytes():
    """One bit per pointer not 16-byte aligned, in argument order: the alignment pattern bound launches are
    kept per (Triton specialises each pointer parameter on it)."""
    assert unaligned_mask(()) == 0
    assert unaligned_mask((0x1000, 0x2010, 0x30)) == 0
    assert unaligned_mask((0x1000, 0x2004, 0x30)) == 0b10
    assert unaligned_mask((0x1002, 0x2010, 0x38)) == 0b101


def test_spec_classes_match_triton():
    """Two values share a key exactly when Triton's own specialiser gives them the same type and attribute."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    base = torch.zeros(64, dtype=torch.float16)
    values = [0, 1, 2, 15, 16, 17, -1, -16, 2 ** 31 - 16, 2 ** 31, -(2 ** 31), -(2 ** 31) - 1, 2 ** 63 - 16,
              2 ** 63, 2 ** 63 + 16, base, base[1:], base[8:], base.float()]
    for a in values:
        for b in values:
            same_triton = native(BaseBackend, a, False, True, True) == native(BaseBackend, b, False, True, True)
            assert (_spec(a) == _spec(b)) == same_triton, (a if not isinstance(a, torch.Tensor) else "tensor", b
                                                            if not isinstance(b, torch.Tensor) else "tensor")


def test_fast_key_paths_equal_the_general_one():
    """``specialisation``'s inline cases give exactly the key ``_spec`` gives, for every kind of value."""

    class Descriptor:  # shaped like a host tensor descriptor
        def __init__(self, base, block_shape, layout):
            self.base, self.block_shape, self.layout = base, block_shape, layout

    x = torch.zeros(64, dtype=torch.float16)
    layout_a, layout_b = ("swizzle", 128), ("swizzle", 64)
    values = [0, 1, 16, 17, -16, 2 ** 31 - 1, 2 ** 31, -(2 ** 31), -(2 ** 31) - 1, 2 ** 63, True, False, 0.5, None,
              x, x[1:], x.float(), torch.nn.Parameter(x.float()), Descriptor(x, [16, 64], layout_a),
              Descriptor(x, [16, 64], layout_b), Descriptor(x.float(), [16, 64], layout_a), "ieee"]
    kernel = CachedKernel(_scaled_copy)
    for v in values:
        for _ in range(2):  # the second pass takes the descriptor fast path once the type is known
            assert kernel.specialisation([v, x, 64, 1.0, 128]) == (_spec(v),) + kernel.specialisation(
                [x, x, 64, 1.0, 128])[1:], v
    keys = {_spec(v) for v in values[-4:-1]}
    assert len(keys) == 3, "layout and dtype separate descriptors"


def test_constexpr_parameters_are_keyed_by_value():
    kernel = CachedKernel(_scaled_copy)
    x = torch.zeros(64)
    assert kernel.specialisation([x, x, 64, 1.0, 128]) != kernel.specialisation([x, x, 64, 1.0, 256])
    assert kernel.specialisation([x, x, 64, 1.0, 128]) == kernel.specialisation([x, x, 80, 2.0, 128])


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


@pytest.mark.gpu
def test_cached_launches_match_the_jit_and_respecialise():
    kernel = CachedKernel(_scaled_copy)
    dev = torch.device("cuda")
    base = torch.randn(4099, device=dev)
    for x, n in ((base[:4096], 4096), (base[1:4096], 4095), (base[:4096], 4096), (base[3:4099], 4096)):
        y = torch.full_like(x, float("nan"))
        for scale in (2.0, -0.5):
            kernel.launch(dev, (triton.cdiv(n, 256),), x, y, n, scale, BLOCK=256, num_warps=4)
            torch.testing.assert_close(y, x * scale)
    # aligned/n % 16 == 0, unaligned/n odd, unaligned/n % 16 == 0: three specialisations, each compiled once.
    assert len(kernel.compiled) == 3
    for block in (128, 512):  # a constexpr compiles its own kernel
        y = torch.full_like(base, float("nan"))
        kernel.launch(dev, (triton.cdiv(4099, block),), base, y, 4099, 3.0, BLOCK=block, num_warps=4)
        torch.testing.assert_close(y, base * 3.0)
    assert len(kernel.compiled) == 5


_TMA_OP = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"


def test_tma_loads_evict_first_rewrites_every_load_or_none():
    """Every TMA load gets the policy in a scope of its own with its predicate (plain, negated or none) inside;
    a load in a form the pass does not know leaves the whole text as it was (no half-hinted kernel)."""
    from pagedmla.kernels.triton.sm90.pipeline import tma_loads_evict_first

    loads = [f"\t@%p10 {_TMA_OP} [%r1], [%rd2, {{%r3, %r4}}], [%r5];",
             f"@!%p2\t{_TMA_OP} [%r6], [%rd2, {{%r7, %r4}}], [%r5];",
             f"  {_TMA_OP} [%r8], [%rd9, {{%r3, %r4}}], [%r5];"]
    ptx = "\n".join(["mov.u32 %r1, 0;", *loads, "st.global.b32 [%rd1], %r1;"])
    hinted = tma_loads_evict_first(ptx).splitlines()
    assert hinted[0] == "mov.u32 %r1, 0;" and hinted[-1] == "st.global.b32 [%rd1], %r1;"
    for line, indent, pred in zip(hinted[1:4], ("\t", "", "  "), ("@%p10 ", "@!%p2\t", "")):
        assert line.startswith(f"{indent}{{ .reg .b64 %l2pol; createpolicy.fractional.L2::evict_first.b64 %l2pol, "
                               f"1.0; {pred}{_TMA_OP}.L2::cache_hint [%r"), line
        assert line.endswith("], [%r5], %l2pol; }"), line
    # Loads it does not know leave the text as it was: one operand more (already hinted), a CTA-local
    # destination, a multicast.
    for odd in (f"{_TMA_OP} [%r8], [%rd9, {{%r3, %r4}}], [%r5], %rd11;",
                f"{_TMA_OP.replace('shared::cluster', 'shared::cta')} [%r8], [%rd9, {{%r3, %r4}}], [%r5];",
                f"{_TMA_OP}.multicast::cluster [%r8], [%rd9, {{%r3, %r4}}], [%r5], %rs1;"):
        assert tma_loads_evict_first(ptx + "\n" + odd) == ptx + "\n" + odd, odd
    assert tma_loads_evict_first("ret;") == "ret;"


class _FakeCompiled:
    def __init__(self, ptx: str | None) -> None:
        self.asm = {} if ptx is None else {"ptx": ptx}


class _FakeJit:
    """Stands in for a JITFunction: records each warmup's keywords and compiles "from" an override file."""

    def __init__(self, ptx: str | None) -> None:
        self.fn, self.ptx, self.calls = _scaled_copy.fn, ptx, []

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(kwargs)
        override = kwargs.get("ir_override")
        return _FakeCompiled(self.ptx if override is None else open(override).read())


@pytest.mark.parametrize("ptx", ["mul.f32 %f1, %f2, %f3;", None])
def test_ptx_pass_compiles_again_from_the_rewritten_text(ptx, tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    fake = _FakeJit(ptx)
    kernel = CachedKernel(fake, ptx_pass=lambda text: text.replace("mul", "add"))
    compiled = kernel._compile((1,), (1, 2), {"num_warps": 4})
    if ptx is None:  # no PTX kept (TRITON_STORE_BINARY_ONLY): the kernel as compiled
        assert fake.calls == [{"num_warps": 4}]
        return
    assert compiled.asm["ptx"] == "add.f32 %f1, %f2, %f3;"
    first, second = fake.calls
    assert first == {"num_warps": 4} and second["num_warps"] == 4
    path = second["ir_override"]
    assert path.endswith(".ptx") and path.startswith(str(tmp_path))
    # Named by the text: the same text maps to the same file (and Triton cache entry), other text elsewhere.
    assert CachedKernel(_FakeJit(ptx), ptx_pass=lambda text: text.replace("mul", "add"))._compile(
        (1,), (), {}).asm["ptx"] == "add.f32 %f1, %f2, %f3;"
    assert len(list(tmp_path.glob("pagedmla-ptx/*.ptx"))) == 1
    unchanged = _FakeJit(ptx)
    CachedKernel(unchanged, ptx_pass=lambda text: text)._compile((1,), (), {})
    assert len(unchanged.calls) == 1  # a pass that changes nothing compiles once
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setattr(knobs.cache, "dir", str(blocked))
    stuck = _FakeJit(ptx)
    assert CachedKernel(stuck, ptx_pass=lambda text: text + " ")._compile((1,), (), {}).asm["ptx"] == ptx
    assert len(stuck.calls) == 1  # nowhere to write the file: the kernel as first compiled
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(knobs.compilation, "override", True)  # Triton would ignore ir_override: do not ask
    overridden = _FakeJit(ptx)
    assert CachedKernel(overridden, ptx_pass=lambda text: text + " ")._compile((1,), (), {}).asm["ptx"] == ptx
    assert len(overridden.calls) == 1


def test_ptx_pass_whose_text_does_not_compile_falls_back_with_a_warning(tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))

    class Broken(_FakeJit):
        def warmup(self, *args, grid, **kwargs):
            if "ir_override" in kwargs:
                raise RuntimeError("ptxas: syntax error")
            return super().warmup(*args, grid=grid, **kwargs)

    with pytest.warns(RuntimeWarning, match="_scaled_copy: the PTX pass's text did not compile"):
        compiled = CachedKernel(Broken("mul.f32;"), ptx_pass=lambda t: t + " ")._compile((1,), (), {})
    assert compiled.asm["ptx"] == "mul.f32;"


def test_ptx_override_files_are_landed_whole_by_concurrent_writers(tmp_path, monkeypatch):
    """Threads writing the same text each use their own temporary file; the file ends whole and alone."""
    from concurrent.futures import ThreadPoolExecutor

    from triton import knobs

    from pagedmla.kernels.triton.launch import ptx_override

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    text = "add.f32 %f1, %f2, %f3;\n" * 20000
    with ThreadPoolExecutor(8) as pool:
        paths = set(pool.map(lambda _: ptx_override(text), range(32)))
    (path,) = paths
    assert open(path).read() == text
    assert [p.name for p in (tmp_path / "pagedmla-ptx").iterdir()] == [os.path.basename(path)]


@pytest.mark.gpu
def test_gpu_ptx_pass_runs_the_rewritten_kernel():
    """The kernel a ``ptx_pass`` rewrote is the one that runs, through both launch paths: turning the scale's
    multiply into an add turns y = x * s into y = x + s."""
    import re

    def to_add(ptx: str) -> str:
        return re.sub(r"\bmul(\.rn)?\.f32\b", "add.f32", ptx)

    dev = torch.device("cuda")
    x = torch.randn(4096, device=dev)
    for bind in (False, True):
        kernel = CachedKernel(_scaled_copy, ptx_pass=to_add)
        y = torch.full_like(x, float("nan"))
        if bind:
            launch = kernel.bind(dev, (16,), x, y, 4096, 2.0, BLOCK=256, num_warps=4)
            assert launch is not None
            launch.launch((16, 1, 1), torch.cuda.current_stream().cuda_stream, (x.data_ptr(), y.data_ptr()))
        else:
            kernel.launch(dev, (16,), x, y, 4096, 2.0, BLOCK=256, num_warps=4)
        torch.testing.assert_close(y, x + 2.0)
        (compiled,) = kernel.compiled.values()
        assert compiled.metadata.ir_override.endswith(".ptx") and "add.f32" in compiled.asm["ptx"]


def test_drop_key_loop_barrier_removes_exactly_one():
    """The ragged kernel's PTX pass drops the consumer's barrier before a wait in a depth-2 loop block, and
    leaves the text alone unless there is exactly one such barrier."""
    from pagedmla.kernels.triton.sm90.varlen import drop_key_loop_barrier

    wait = ("\t// begin inline asm\n\t\n{\n\t.reg .pred complete;\n\twaitLoop:\n"
            "\tmbarrier.try_wait.parity.shared.b64 x;\n")
    loop = "$L__BB0_7:  // in Loop: Header=BB0_5 Depth=2\n\tadd.s32 %r1, %r2, 1;\n\tbar.sync \t0, 256;\n" + wait
    outer = "$L__BB0_3:  // in Loop: Header=BB0_2 Depth=1\n\tbar.sync \t0, 256;\n" + wait
    assert drop_key_loop_barrier(outer + loop) == outer + loop.replace("\tbar.sync \t0, 256;\n", "")
    assert drop_key_loop_barrier(outer) == outer
    assert drop_key_loop_barrier(outer + loop + loop) == outer + loop + loop
