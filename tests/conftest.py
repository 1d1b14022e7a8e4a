"""Test setup: on machines without CUDA, Triton kernels run under the interpreter (set before import)."""

import os

import pytest
import torch


def _fix_triton_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a run-time scalar into a Python int with int() on a 1-element array,
    which NumPy >= 2.4 rejects, so any loop with a run-time bound fails (triton-lang/triton#9171, fixed
    upstream by #9172). Apply the same fix here until a Triton release carries it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagedmla_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedmla_fixed = True
    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _fix_triton_interpreter_scalars()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each xdist worker gets one core; torch's own threads would only contend with the other worker.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
