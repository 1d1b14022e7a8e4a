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
from typing import Any

import torch

try:
    from triton import knobs
except ImportError:  # Triton < 3.4
    knobs = None


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
    if isinstance(base, torch.Tensor):  # a host tensor descriptor (layouts are hashable dataclasses)
        return ("d", base.dtype, tuple(v.block_shape), getattr(v, "layout", None))
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
        return tuple(("c", v) if const else _spec(v) for v, const in zip(values, self.constexpr, strict=True))

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
        stream = torch.cuda.current_stream(current).cuda_stream
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *values), enter, exit_, *values)
