"""Low-overhead launches of compiled Triton / Gluon kernels.

A decode step is a few microseconds of GPU work at small batch, and ``JITFunction.run`` spends tens of
microseconds per launch binding and specialising every argument. ``CachedKernel`` goes through Triton's
JIT on the first call with a given specialisation and launches the compiled kernel directly afterwards.
Its key reproduces what Triton specialises on: constexpr parameters by value, tensor dtypes and 16-byte
alignment, integers equal to 1, divisible by 16 and their type (i32 / i64 / u64), booleans, tensor
descriptors' dtype, block shape and layout (descriptors themselves are re-encoded on every launch by
Triton's launcher), every launch option, and the runtime debug / instrumentation knobs. CUDA-graph capture
works as with the JIT path: the launch goes to the current stream of the tensors' device. It relies on
Triton 3.6's compiled-kernel interface; with a Triton without ``triton.knobs`` every call goes through the JIT.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch

try:
    from triton import knobs
except ImportError:  # Triton < 3.4
    knobs = None

try:  # the raw stream handle, as Triton's own launcher gets it (no torch Stream object per launch)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # torch builds without CUDA (launches never get this far there)
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


_I32_MIN, _I32_END = -(2 ** 31), 2 ** 31
# id(layout) -> (layout, token). Holding the layout keeps its id from being reused by another object, so a
# descriptor's layout enters keys as a small int instead of a dataclass hashed field by field on every launch
# (the launchers cache their layouts, so this table stays a handful of entries).
_layout_tokens: dict[int, tuple[Any, int]] = {}
_next_token = itertools.count()  # next() is atomic under the GIL: two threads never share a token


def _layout_token(layout: Any) -> int:
    entry = _layout_tokens.get(id(layout))
    if entry is None:
        entry = _layout_tokens.setdefault(id(layout), (layout, next(_next_token)))
    return entry[1]


_descriptor_types: set[type] = set()


def _descriptor_spec(v: Any) -> tuple:
    return ("d", v.base.dtype, tuple(v.block_shape), _layout_token(getattr(v, "layout", None)))


def _spec(v: Any) -> Any:
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        width = "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64" if -(2 ** 63) <= v < 2 ** 63 else "u64"
        return (width, v == 1, v % 16 == 0)
    if isinstance(v, float):
        return "f"
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if v is None:
        return None
    base = getattr(v, "base", None)
    if isinstance(base, torch.Tensor):  # a host tensor descriptor
        _descriptor_types.add(type(v))
        return _descriptor_spec(v)
    return ("c", v)


class CachedKernel:
    """Wraps a ``@triton.jit`` or ``@gluon.jit`` function: ``kernel.launch(device, grid, *args, **kwargs)`` with
    every kernel parameter given (positionally, then by name) and launch options (``num_warps``,
    ``num_stages``, ...) as keywords. Off CUDA (the interpreter) every call goes through the JIT."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = inspect.signature(fn.fn).parameters
        self.names = list(params)
        # Triton's own test (KernelParam.is_constexpr); read from the signature so that it also works on the
        # interpreter's function objects.
        self.constexpr = ["constexpr" in str(p.annotation) for p in params.values()]
        self.compiled: dict[tuple, Any] = {}

    def specialisation(self, values: list[Any]) -> tuple:
        """What Triton compiles one kernel per: ``values`` are all parameters in signature order."""
        if len(values) != len(self.constexpr):
            raise TypeError(f"{self.names}: expected {len(self.constexpr)} values, got {len(values)}")
        key = []
        add = key.append
        # Inline fast paths for the common int32 and plain-tensor cases (a launch's host time is mostly this
        # loop); everything else, and every value's exact class, goes through _spec.
        for v, const in zip(values, self.constexpr):
            t = type(v)
            if const:
                add(("c", v))
            elif t is int and _I32_MIN <= v < _I32_END:
                add(("i32", v == 1, v % 16 == 0))
            elif t is torch.Tensor:
                add((v.dtype, v.data_ptr() % 16 == 0))
            elif t in _descriptor_types:
                add(_descriptor_spec(v))
            else:
                add(_spec(v))
        return tuple(key)

    def launch(self, device: torch.device, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if device.type != "cuda" or knobs is None:
            self.fn[grid](*args, **kwargs)
            return
        current = torch.cuda.current_device()
        if device.index is not None and device.index != current:
            with torch.cuda.device(device.index):  # launch where the tensors are, as a device guard would
                self.launch(device, grid, *args, **kwargs)
            return
        values = list(args) + [kwargs[n] for n in self.names[len(args):]]
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.names))
        key = (current, options, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
               self.specialisation(values))
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            self.compiled[key] = kernel
            return
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream = _raw_stream(current)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        metadata = None if enter is None else kernel.launch_metadata(grid, stream, *values)
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter, exit_, *values)
