"""CachedKernel: launches through the compiled handle must never reuse a kernel specialised differently."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pagedmla.kernels.triton.launch import CachedKernel, _spec


def test_spec_separates_what_triton_specialises_on():
    x = torch.zeros(64, dtype=torch.float16)
    assert _spec(x) == _spec(torch.zeros(8, dtype=torch.float16))
    assert _spec(x) != _spec(x[1:]), "16-byte alignment"
    assert _spec(x) != _spec(x.float())
    assert _spec(1) != _spec(2) and _spec(16) != _spec(17) and _spec(17) == _spec(19)
    assert _spec(2 ** 31 + 1) != _spec(17), "int64 values"
    assert _spec(True) != _spec(1) and _spec(0.5) == _spec(2.0) and _spec(None) is None
    assert _spec("ieee") != _spec("tf32")


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
