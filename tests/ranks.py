"""Run a function in several CPU processes joined by a gloo process group (the CI form of multi-GPU runs)."""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Wall-clock bound on one multi-process run: a rank that hangs (a collective the others never join) fails
# the test instead of the suite.
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, results, args: tuple, init_group: bool) -> None:
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))
        else:  # what torchrun sets
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        results.put((rank, None, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args, world_size: int = 2, init_group: bool = True) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with the default process group
    (gloo) set up, or with ``init_group=False`` the environment torchrun gives its ranks instead; returns
    their results by rank (which must pickle). A rank's exception fails the call with its traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args, init_group), daemon=True)
             for rank in range(world_size)]
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if env is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env
    out: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, error, value = results.get(timeout=TIMEOUT_S)
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            out[rank] = value
    except queue.Empty:
        missing = sorted(set(range(world_size)) - set(out))
        raise AssertionError(f"ranks {missing} gave no result in {TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
