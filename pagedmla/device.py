"""What this process can run (the Triton interpreter switch, the Hopper (sm_90) capability probes) and how
host values reach it without a synchronisation (``to_device``).

A leaf module (torch and the standard library only), so that the split plan, the kernels and the public ops
all ask the same questions the same way without importing each other. Triton itself is imported only when
``gluon_available`` is first asked, so ``import pagedmla`` stays free of it.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

# The Gluon modules the Hopper kernels use; a Triton without any of them runs the portable kernels instead.
_GLUON_MODULES = (
    "triton.experimental.gluon",
    "triton.experimental.gluon.language",
    "triton.experimental.gluon.language.nvidia.hopper",
    "triton.experimental.gluon.nvidia.hopper",
)


def triton_interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (``TRITON_INTERPRET`` set and not 0: the CPU path)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def gluon_available() -> bool:
    """Whether the installed Triton has the Gluon Hopper API the sm_90 kernels are written in."""
    try:
        for name in _GLUON_MODULES:
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA ``device`` (no index: the current device)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm90_available(device: torch.device) -> bool:
    """Whether ``device`` runs the Gluon sm_90 kernels: a CUDA device of capability 9.0 and Triton's Gluon."""
    if device.type != "cuda" or not gluon_available():
        return False
    return _capability(device) == (9, 0)


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on ``device`` may launch as programmatic dependents (PDL, ``griddepcontrol``): an NVIDIA
    GPU of capability 9.0 or above, compiled (the interpreter runs no PTX); not ROCm, whose capabilities count
    differently."""
    if device.type != "cuda" or torch.version.hip is not None or triton_interpreting():
        return False
    return _capability(device)[0] >= 9


@functools.cache
def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def to_device(values: list[int] | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host integers (a list or a CPU tensor) on ``device`` without a host synchronisation: on CUDA through
    pinned staging memory (the caching host allocator keeps it until the copy has run) and a non-blocking
    copy; a copy from pageable memory would make the host wait for the GPU queue."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        if device.type == "cuda":
            host = host.pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
