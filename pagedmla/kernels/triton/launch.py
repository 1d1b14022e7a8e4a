"""Low-overhead launches of compiled Triton / Gluon kernels.

A decode step is a few microseconds of GPU work at small batch, and ``JITFunction.run`` spends tens of
microseconds per launch binding and specialising every argument. Two levels:

- ``CachedKernel`` goes through Triton's JIT on the first call with a given specialisation and launches
  the compiled kernel directly afterwards.
- ``CachedKernel.bind`` returns a ``BoundLaunch``: the compiled kernel with every argument but the tensor
  addresses fixed, for launchers that keep one per call shape (a plan). Its launch hands Triton's C
  launcher the addresses as integers (which skips the launcher's per-tensor ``data_ptr`` call and
  ``cuPointerGetAttribute``) and tensor maps it encoded once per address (Triton's Python wrapper encodes
  every host descriptor on every launch), so a launch costs a list copy and one C call.

Its key reproduces what Triton specialises on: constexpr parameters by value, tensor dtypes and 16-byte
alignment, integers equal to 1, divisible by 16 and their type (i32 / i64 / u64), booleans, tensor
descriptors' dtype, block shape and layout (descriptors themselves are re-encoded on every launch by
Triton's launcher), every launch option, and the runtime debug / instrumentation knobs. CUDA-graph capture
works as with the JIT path: the launch goes to the current stream of the tensors' device. It relies on
Triton 3.6's compiled-kernel interface; with a Triton without ``triton.knobs`` every call goes through the JIT.

A ``CachedKernel`` may carry a PTX pass (``ptx_pass``): a rewrite of the compiled PTX for what Gluon cannot
say (``sm90.pipeline.tma_loads_evict_first``). The kernel is compiled as usual, then again from the rewritten
text through Triton's ``ir_override`` option, whose file is named by the text's hash: the option is part of
Triton's cache key, so the on-disk cache never serves a kernel compiled from other text (a process with a warm
cache loads both from it). On a cold cache the first call of a specialisation compiles twice (the Hopper
decode kernels: ~3 -> ~5.5 s and ~4 -> ~11 s on the CPU machine). The kernel runs unrewritten without the
first compile's PTX (``TRITON_STORE_BINARY_ONLY``), under ``TRITON_KERNEL_OVERRIDE`` (Triton then ignores
``ir_override``) and, with a warning, when the rewritten text does not compile.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
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


def _raw_launcher(run: Any) -> Any:
    """Triton 3.6's C entry point behind a ``CudaLauncher`` (its ``launch``, or the function the tensor
    descriptor wrapper closes over), or None for another launcher structure."""
    launch = getattr(run, "launch", None)
    code = getattr(launch, "__code__", None)
    if code is None:
        return launch if callable(launch) else None
    cells = dict(zip(code.co_freevars, launch.__closure__ or ()))
    inner = cells.get("launcher")
    return None if inner is None else inner.cell_contents


class BoundLaunch:
    """One compiled kernel and one call shape: ``launch(grid, stream, ptrs, map_ptrs)`` with ``ptrs`` the
    data addresses of the tensor parameters, in signature order, and ``map_ptrs`` the base addresses of the
    host tensor descriptors, in signature order; every other argument is the one ``CachedKernel.bind`` saw.
    Tensor maps are encoded once per base address (their shape, strides and box are the bound call's)."""

    def __init__(self, compiled: Any, values: list[Any], raw: Any) -> None:
        run = compiled.run
        self.compiled = compiled
        self._raw = raw
        self._head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                      compiled.packed_metadata)
        tma_meta = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        self.template: list[Any] = []
        self.ptr_slots: list[int] = []
        self.map_slots: list[int] = []
        self._maps: list[dict[int, Any]] = []
        self._map_specs: list[tuple] = []
        fill = None
        for v in values:
            if isinstance(v, torch.Tensor):
                self.ptr_slots.append(len(self.template))
                self.template.append(0)
            elif type(v) in _descriptor_types:
                meta = tma_meta.pop(0) if tma_meta else None
                shape, strides = list(v.shape), list(v.strides)
                self.map_slots.append(len(self.template))
                self._maps.append({})
                if meta is None:  # lowered without TMA: base pointer, shape, strides, padding flag, again
                    self.template += [0, *shape, *strides, v.padding == "nan", *shape, *strides]
                    self._map_specs.append(None)
                else:
                    if fill is None:
                        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
                        from triton.runtime import driver

                        fill = driver.active.utils.fill_tma_descriptor
                    self.template += [None, *shape, *strides]
                    self._map_specs.append((fill, meta["swizzle"], meta["elem_size"],
                                            TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                                            shape, strides, 1 if v.padding == "nan" else 0))
            else:
                self.template.append(v)

    def _map(self, i: int, ptr: int) -> Any:
        spec = self._map_specs[i]
        if spec is None:
            return ptr
        maps = self._maps[i]
        m = maps.get(ptr)
        if m is None:
            fill, swizzle, elem_size, elem_type, block, shape, strides, padding = spec
            if len(maps) > 64:  # a few live tensors per slot (a cache per layer, this step's q): keep it small
                maps.clear()
            m = maps[ptr] = fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding)
        return m

    def launch(self, grid: tuple[int, int, int], stream: int, ptrs: tuple[int, ...],
               map_ptrs: tuple[int, ...] = ()) -> None:
        p = self.template.copy()
        for slot, v in zip(self.ptr_slots, ptrs):
            p[slot] = v
        for i, (slot, v) in enumerate(zip(self.map_slots, map_ptrs)):
            p[slot] = self._map(i, v)
        enter = knobs.runtime.launch_enter_hook
        metadata = None if enter is None else self.compiled.launch_metadata(grid, stream)
        self._raw(grid[0], grid[1], grid[2], stream, *self._head, metadata, enter, knobs.runtime.launch_exit_hook,
                  *p)


def ptx_override(ptx: str) -> str:
    """The path of a file holding ``ptx`` (under Triton's cache directory, named by the text's SHA-256), for
    Triton's ``ir_override`` compile option; written once, atomically (threads and processes may compile the
    same text at once: each writes its own temporary file, and any of them may land it)."""
    folder = Path(knobs.cache.dir) / "pagedmla-ptx"
    path = folder / f"{hashlib.sha256(ptx.encode()).hexdigest()}.ptx"
    if path.exists():
        return str(path)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ptx)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(path)


def rewritten_ptx_file(ptx_pass: Callable[[str], str] | None, ptx: str | None) -> str | None:
    """The ``ir_override`` file (``ptx_override``) of ``ptx`` rewritten by ``ptx_pass``, or None where the
    kernel should run as first compiled: no pass, no PTX kept (``TRITON_STORE_BINARY_ONLY``), Triton's own
    override manager on (``TRITON_KERNEL_OVERRIDE``: Triton then ignores ``ir_override``), a pass that changes
    nothing, or no writable cache directory for the file (the passes are hints, not fixes)."""
    if ptx_pass is None or ptx is None or knobs.compilation.override:
        return None
    rewritten = ptx_pass(ptx)
    if rewritten == ptx:
        return None
    try:
        return ptx_override(rewritten)
    except OSError:
        return None


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream on ``device_index`` (what ``BoundLaunch.launch`` takes)."""
    return _raw_stream(device_index)


def unaligned_mask(ptrs: tuple[int, ...]) -> int:
    """Bit i set where ``ptrs[i]`` is not 16-byte aligned: the pattern a kernel's pointer parameters are
    specialised on (Triton marks each aligned one divisible by 16), so calls with one pattern can share one
    ``BoundLaunch`` and calls with another need their own."""
    mask = 0
    for i, p in enumerate(ptrs):
        if p & 15:
            mask |= 1 << i
    return mask


class CachedKernel:
    """Wraps a ``@triton.jit`` or ``@gluon.jit`` function: ``kernel.launch(device, grid, *args, **kwargs)`` with
    every kernel parameter given (positionally, then by name) and launch options (``num_warps``,
    ``num_stages``, ...) as keywords. Off CUDA (the interpreter) every call goes through the JIT. ``ptx_pass``:
    a rewrite of the compiled PTX (see the module docstring), applied to every specialisation."""

    def __init__(self, fn, ptx_pass: Callable[[str], str] | None = None) -> None:
        self.fn = fn
        self.ptx_pass = ptx_pass
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

    def _key(self, current: int, args: tuple, kwargs: dict) -> tuple[tuple, list[Any]]:
        values = list(args) + [kwargs[n] for n in self.names[len(args):]]
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.names))
        return (current, options, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                self.specialisation(values)), values

    def _compile(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> Any:
        """The compiled kernel for these arguments, from its PTX rewritten by ``ptx_pass`` when there is one
        and it changes the text."""
        kernel = self.fn.warmup(*args, grid=grid, **kwargs)
        path = rewritten_ptx_file(self.ptx_pass, kernel.asm.get("ptx"))
        if path is None:
            return kernel
        try:
            return self.fn.warmup(*args, grid=grid, ir_override=path, **kwargs)
        except Exception as exc:  # whatever ptxas or Triton raised: the pass is wrong, not the kernel
            warnings.warn(f"{self.fn.fn.__name__}: the PTX pass's text did not compile ({exc}); running the "
                          "kernel as compiled", RuntimeWarning, stacklevel=2)
            return kernel

    def bind(self, device: torch.device, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> BoundLaunch | None:
        """A ``BoundLaunch`` of the kernel compiled for these arguments (compiling it now if needed, without
        launching), or None where that path does not apply (off CUDA, another Triton, a kernel that needs
        scratch memory): launch through ``launch`` then."""
        if device.type != "cuda" or knobs is None:
            return None
        current = torch.cuda.current_device()
        if device.index is not None and device.index != current:
            with torch.cuda.device(device.index):
                return self.bind(device, grid, *args, **kwargs)
        key, values = self._key(current, args, kwargs)
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.compiled[key] = self._compile(grid, args, kwargs)
        run = kernel.run
        raw = _raw_launcher(run)
        if raw is None or getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
            return None
        return BoundLaunch(kernel, values, raw)

    def launch(self, device: torch.device, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if device.type != "cuda" or knobs is None:
            self.fn[grid](*args, **kwargs)
            return
        current = torch.cuda.current_device()
        if device.index is not None and device.index != current:
            with torch.cuda.device(device.index):  # launch where the tensors are, as a device guard would
                self.launch(device, grid, *args, **kwargs)
            return
        key, values = self._key(current, args, kwargs)
        kernel = self.compiled.get(key)
        if kernel is None:
            if self.ptx_pass is None:  # compile and launch through the JIT
                self.compiled[key] = self.fn[grid](*args, **kwargs)
                return
            kernel = self.compiled[key] = self._compile(grid, args, kwargs)
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream = _raw_stream(current)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        metadata = None if enter is None else kernel.launch_metadata(grid, stream, *values)
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter, exit_, *values)
