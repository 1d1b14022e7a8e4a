"""Test setup: on machines without CUDA, Triton kernels run under the interpreter (set before import)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
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
