"""Provider registry: which implementation runs each op.

Ops: ``paged_decode`` (uniform q_len, FlashMLA layout), ``paged_varlen`` (per-request q lengths),
``varlen`` (ragged MHA/GQA), ``merge``. Providers: ``torch`` (the reference, everywhere), ``triton``
(pagedmla's kernels: default on CUDA, on CPU only under ``TRITON_INTERPRET=1`` and when asked for),
``flashmla`` (an adapter to FlashMLA's decode, when ``sgl-flash-mla`` is installed).

Selection for one call: the ``provider=`` argument, else ``PAGEDMLA_PROVIDER`` (ignored for ops that
provider does not implement), else the best one registered for the tensors' device.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from pagedmla.device import triton_interpreting

PROVIDERS = ("torch", "triton", "flashmla")
OPS = ("paged_decode", "paged_varlen", "varlen", "merge")
_PREFERENCE_CUDA = ("triton", "torch")

_impls: dict[str, dict[str, Callable]] = {op: {} for op in OPS}
_loaded: set[str] = set()
# Modules that register a provider's implementations when imported; a missing library leaves it out.
_PROVIDER_MODULES = {
    "torch": ("pagedmla.ops.torch_provider",),
    "triton": ("pagedmla.ops.triton_provider",),
    "flashmla": ("pagedmla.ops.flashmla_provider",),
}


def register_impl(op: str, provider: str, fn: Callable) -> None:
    """Register ``fn`` as ``provider``'s implementation of ``op``."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {OPS}")
    if provider not in PROVIDERS:
        raise ValueError(f"provider: unknown provider {provider!r}; expected one of {PROVIDERS}")
    _impls[op][provider] = fn


def _load(provider: str) -> None:
    if provider in _loaded:
        return
    _loaded.add(provider)
    for module in _PROVIDER_MODULES[provider]:
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def available_providers(op: str) -> list[str]:
    """Providers that implement ``op`` in this installation, in ``PROVIDERS`` order.

    op: one of ``OPS``: ``"paged_decode"`` (``flash_mla_with_kvcache``), ``"paged_varlen"``
    (``flash_mla_varlen_with_kvcache``), ``"varlen"`` (``flash_attn_varlen_func``) or ``"merge"``
    (``merge_state``); anything else raises ValueError listing them."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {', '.join(OPS)}")
    for p in PROVIDERS:
        _load(p)
    return [p for p in PROVIDERS if p in _impls[op]]


def resolve(op: str, device: torch.device, provider: str | None = None) -> tuple[str, Callable]:
    """Pick the provider for one call of ``op`` on ``device``; returns (name, implementation)."""
    if provider is not None:
        if provider not in PROVIDERS:
            raise ValueError(f"provider: unknown provider {provider!r}; expected one of {PROVIDERS}")
        _load(provider)
        if provider not in _impls[op]:
            raise ValueError(f"provider: {provider!r} does not implement {op} in this installation "
                             f"(available: {available_providers(op)})")
        if provider == "triton" and device.type != "cuda" and not triton_interpreting():
            raise ValueError("provider: 'triton' on CPU tensors needs TRITON_INTERPRET=1")
        return provider, _impls[op][provider]
    env = os.environ.get("PAGEDMLA_PROVIDER")
    if env:
        if env not in PROVIDERS:
            raise ValueError(f"PAGEDMLA_PROVIDER: unknown provider {env!r}; expected one of {PROVIDERS}")
        _load(env)
        usable = device.type == "cuda" or env == "torch" or (env == "triton" and triton_interpreting())
        if env in _impls[op] and usable:
            return env, _impls[op][env]
    if device.type == "cuda":
        for p in _PREFERENCE_CUDA:
            _load(p)
            if p in _impls[op]:
                return p, _impls[op][p]
    _load("torch")
    return "torch", _impls[op]["torch"]
