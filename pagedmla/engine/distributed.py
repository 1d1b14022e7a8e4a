"""The engine over several devices: one process per device, rank 0 schedules, every rank runs the model.

Launch (``start``). A process that ``torchrun`` (or any launcher setting RANK / WORLD_SIZE / LOCAL_RANK and
MASTER_ADDR / MASTER_PORT) started is the rank those say; otherwise the process creating the ``LLM`` becomes
rank 0 and spawns ranks 1..N-1 with ``torch.multiprocessing`` (start method "spawn"), each of which builds
the same ``LLM`` from the same arguments. Ranks use NCCL on CUDA (device ``cuda:LOCAL_RANK``; NVLink
multicast is kept off, ``NCCL_NVLS_ENABLE=0``) and gloo on the CPU; the step descriptions travel over a
gloo group in both cases, so they never touch a device.

Groups. The tensor-parallel group is every rank. Decode context parallelism groups ``dcp_size``
consecutive ranks (ranks ``g * D .. g * D + D - 1``), which hold different heads and share the latent cache
by token interleave (``pagedmla.context_parallel``).

Steps (``StepChannel``). Before each step rank 0 broadcasts its ``StepPlan`` (mode, request slots, first
positions, tokens) and the block-table rows that changed since it last sent them; every other rank copies
those rows into its own table (it allocates nothing itself) and runs the same plan, so every rank runs the
same collectives in the same order, CUDA-graph replays included. Only rank 0 samples: the LM head's
all-gather gives every rank the logits, the others drop them.

Building an engine is collective: a rank that fails (say, while loading its slice) makes every rank fail
(``Parallel.agree``), rank 0 with that rank's error. ``Parallel.shutdown`` (``LLM.shutdown``, or rank 0's
exit) sends the other ranks home: a worker's ``LLM(...)`` returns then (an inert engine whose
``is_driver`` is False), and spawned workers exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedmla.backend import ForwardMode
from pagedmla.cache import RequestTable
from pagedmla.device import to_device
from pagedmla.engine.model_runner import ModelRunner, StepPlan
from pagedmla.parallel import Group

# How long a rank waits for the others to join a group or a collective before failing.
TIMEOUT = timedelta(seconds=300)
# How long the other ranks wait on the step channel for rank 0's next step: an engine may sit idle between
# requests for any time (a rank that exits closes its sockets, which ends the wait at once).
IDLE_TIMEOUT = timedelta(days=7)
_MODES = list(ForwardMode)
_STEP, _SHUTDOWN = 1, 2
_HEADER = 8  # [command, mode, num_extends, requests, tokens, flags, changed rows, row ints]
_ALL_LOGITS, _EAGER = 1, 2

# Set in a process spawned by ``start``: (rank, world size, init method) for the LLM it then builds.
_spawned: tuple[int, int, str] | None = None


@dataclass
class Parallel:
    """This process's place in a tensor-parallel engine.

    tp: the tensor-parallel group (every rank); dcp: this rank's decode-context-parallel group; cpu: a gloo
    group of every rank for host values; device: this rank's device; workers: the processes rank 0 spawned;
    owns_default_group: whether ``shutdown`` destroys the default process group (it created it)."""

    tp: Group
    dcp: Group
    cpu: dist.ProcessGroup
    device: torch.device
    workers: list = field(default_factory=list)
    owns_default_group: bool = True
    channel: StepChannel | None = None
    closed: bool = False

    @property
    def is_driver(self) -> bool:
        return self.tp.rank == 0

    def agree(self, error: BaseException | None) -> None:
        """Every rank calls this once its engine is built (``error``: why it could not be); raises on every
        rank when any failed: rank 0 its own exception, or a RuntimeError with the first failed rank's."""
        report = None if error is None else "".join(traceback.format_exception_only(type(error), error)).strip()
        reports: list[str | None] = [None] * self.tp.size
        dist.all_gather_object(reports, report, group=self.cpu)
        failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
        if not failed:
            return
        self.close()
        if error is not None:
            raise error
        rank, message = failed[0]
        raise RuntimeError(f"tensor_parallel_size: rank {rank} of {self.tp.size} could not build its engine: {message}")

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to stop, then leave the groups (idempotent)."""
        if self.closed:
            return
        if self.is_driver and self.channel is not None:
            self.channel.send_shutdown()
        self.close()

    def close(self) -> None:
        """Leave the process groups and wait for spawned workers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            if self.owns_default_group:
                dist.destroy_process_group()
            else:
                for group in {self.cpu, self.dcp.group} - {None}:
                    dist.destroy_process_group(group)
        for proc in self.workers:
            proc.join(timeout=TIMEOUT.total_seconds())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str) -> int:
    value = os.environ[name]
    if not value.isdigit():
        raise ValueError(f"tensor_parallel_size: the launcher set {name}={value!r}, not a rank number")
    return int(value)


def start(tp_size: int, dcp_size: int, device_type: str, settings: dict[str, Any],
          build: Callable[[dict[str, Any]], object]) -> Parallel:
    """Join (or spawn) the ``tp_size`` ranks of an engine and set up its groups; a spawned rank calls
    ``build(settings)`` (a module-level function, so that it pickles; ``settings`` must pickle too) to build
    its engine, which serves rank 0's steps. ValueError naming tensor_parallel_size when the launcher's
    world or the devices do not fit."""
    global _spawned
    workers = []
    if _spawned is not None:
        rank, world, init_method = _spawned
        _spawned = None
        local_rank = rank
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
        init_method = "env://"
    else:
        world, rank, local_rank = tp_size, 0, 0
        init_method = None
    if world != tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size}, but the launcher started {world} ranks (WORLD_SIZE)")
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size: rank {rank} would use cuda:{local_rank}, but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NVLink multicast (NVLS) stays off for every NCCL communicator this process creates.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    else:
        device = torch.device("cpu")
    if init_method is None:
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process already belongs to a torch.distributed group "
                             "(another tensor-parallel LLM?); shut that down first or launch with torchrun")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        worker_settings = dict(settings, tokenizer=None)  # only rank 0 detokenizes
        for r in range(1, world):
            proc = ctx.Process(target=_worker_main, args=(r, world, init_method, worker_settings, build),
                               daemon=True)
            proc.start()
            workers.append(proc)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT,
                                **extra)
    elif dist.get_world_size() != tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size}, but the process group has {dist.get_world_size()} ranks")
    cpu = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    dcp_group = None
    if 1 < dcp_size < world:
        # new_group is collective: every rank creates every DCP group, and keeps its own.
        for first in range(0, world, dcp_size):
            group = dist.new_group(list(range(first, first + dcp_size)), timeout=TIMEOUT)
            if first <= rank < first + dcp_size:
                dcp_group = group
    dcp = Group.of(dcp_group) if dcp_size > 1 else Group(None, 0, 1)
    return Parallel(tp=Group.of(None), dcp=dcp, cpu=cpu, device=device, workers=workers, owns_default_group=owns)


def _worker_main(rank: int, world: int, init_method: str, settings: dict[str, Any],
                 build: Callable[[dict[str, Any]], object]) -> None:
    """A spawned rank: build the same engine (which serves rank 0's steps until it shuts down)."""
    global _spawned
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    _spawned = (rank, world, init_method)
    build(settings)


class StepChannel:
    """Rank 0 -> every rank: each step's plan and the block-table rows it reads that changed (gloo)."""

    def __init__(self, parallel: Parallel, table: RequestTable):
        self.group = parallel.cpu
        self.table = table
        self._sent: dict[int, list[int]] = {}  # rank 0: each slot's pages as last sent

    def _broadcast(self, values: torch.Tensor) -> None:
        dist.broadcast(values, src=0, group=self.group)

    def send(self, plan: StepPlan) -> None:
        """Rank 0: broadcast ``plan`` (``ModelRunner.step_hook``)."""
        rows, n_rows = [], 0
        for slot in plan.slots:
            pages = self.table.pages[slot]
            if self._sent.get(slot) != pages:
                self._sent[slot] = list(pages)
                rows += [slot, len(pages), *pages]
                n_rows += 1
        counts = [len(t) for t in plan.tokens]
        flags = _ALL_LOGITS * plan.all_logits | _EAGER * plan.eager
        header = [_STEP, _MODES.index(plan.mode), plan.num_extends, len(plan.slots), sum(counts), flags, n_rows,
                  len(rows)]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        payload = plan.slots + plan.starts + counts + [t for step in plan.tokens for t in step] + rows
        self._broadcast(torch.tensor(payload, dtype=torch.int64))

    def send_shutdown(self) -> None:
        self._broadcast(torch.tensor([_SHUTDOWN] + [0] * (_HEADER - 1), dtype=torch.int64))

    def receive(self) -> StepPlan | None:
        """The other ranks: the next step's plan (its rows already in the table), or None at shutdown."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._broadcast(header)
        command, mode, num_extends, bs, total, flags, n_rows, row_ints = header.tolist()
        if command == _SHUTDOWN:
            return None
        payload = torch.empty(3 * bs + total + row_ints, dtype=torch.int64)
        self._broadcast(payload)
        values = payload.tolist()
        slots, starts, counts = values[:bs], values[bs:2 * bs], values[2 * bs:3 * bs]
        flat = values[3 * bs:3 * bs + total]
        tokens, at = [], 0
        for n in counts:
            tokens.append(flat[at:at + n])
            at += n
        self._apply_rows(values[3 * bs + total:], n_rows)
        return StepPlan(_MODES[mode], num_extends, slots, starts, tokens, bool(flags & _ALL_LOGITS),
                        bool(flags & _EAGER))

    def _apply_rows(self, rows: list[int], n_rows: int) -> None:
        """Copy rank 0's changed rows (slot, page count, pages...) into this rank's table, in one copy."""
        if not n_rows:
            return
        table = self.table
        host = torch.zeros(n_rows, table.block_table.shape[1], dtype=torch.int32)
        slots, at = [], 0
        for i in range(n_rows):
            slot, n = rows[at], rows[at + 1]
            pages = rows[at + 2:at + 2 + n]
            table.pages[slot] = pages
            host[i, :n] = torch.tensor(pages, dtype=torch.int32)
            slots.append(slot)
            at += 2 + n
        device = table.block_table.device
        table.block_table.index_copy_(0, to_device(slots, torch.int64, device), to_device(host, torch.int32, device))


def serve(runner: ModelRunner, channel: StepChannel) -> None:
    """The other ranks' loop: run rank 0's steps until it shuts down."""
    while (plan := channel.receive()) is not None:
        runner.execute(plan)


@contextlib.contextmanager
def building(parallel: Parallel | None) -> Iterator[None]:
    """Around the building of one rank's engine: ``Parallel.agree`` on how it went (nothing for None)."""
    if parallel is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        parallel.agree(exc)
        raise  # agree raises already; a context manager must never swallow the build's error
    parallel.agree(None)
