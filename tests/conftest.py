"""Test setup: on machines without CUDA, Triton kernels run under the interpreter (set before import); the
trained MTP checkpoint that several test files serve."""

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


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory):
    """A directory holding the tiny model with a trained MTP layer (``trained_tiny.write_trained_mtp_checkpoint``),
    trained once per test run: under xdist the first worker to ask trains it into the run's shared temporary
    directory while the others wait on a file lock (the training is a minute of CPU time; eight GPU workers
    each training it would contend for the cores the kernels' compiles need)."""
    from filelock import FileLock
    from trained_tiny import write_trained_mtp_checkpoint

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    directory = shared / "mtp_checkpoint"
    with FileLock(str(directory) + ".lock"):
        if not directory.exists():
            # Written aside and renamed into place: a worker that dies while training leaves no directory
            # that another would take for a finished one.
            partial = shared / f"mtp_checkpoint.partial.{os.getpid()}"
            figures = write_trained_mtp_checkpoint(partial)
            os.replace(partial, directory)
            print(f"trained MTP checkpoint: {figures}")
    return directory
