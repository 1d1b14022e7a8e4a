"""Will it fit? Memory a device has available, and a refusal naming the field that makes an allocation too
large, given before anything is allocated (a config.json of 10**9 layers or a vocabulary of 10**12
should be one line, not a hang or an allocator traceback)."""

from __future__ import annotations

import torch

_CGROUP = "/sys/fs/cgroup/"


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` could take now: free CUDA memory; on the host the kernel's
    MemAvailable, lowered to what the cgroup (container) limit leaves; None where it cannot be told (no
    check is made then)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    meminfo = _read("/proc/meminfo")
    if meminfo is None:
        return None
    avail = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")),
                 None)
    limit, used = _read(_CGROUP + "memory.max"), _read(_CGROUP + "memory.current")
    if avail is not None and limit is not None and used is not None and limit.strip().isdigit():
        avail = min(avail, int(limit) - int(used))
    return avail


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def check_fits(need: int, field: str, value: object, device: torch.device, what: str, where: str = "",
               error: type[ValueError] = ValueError) -> None:
    """``error`` naming ``field`` (set to ``value``, the setting that makes the allocation large) when
    ``need`` bytes exceed the memory ``device`` has available; ``what`` names the allocation ("the model's
    weights"), ``where`` ends the line (" (in PATH)")."""
    avail = available_bytes(device)
    if avail is not None and need > avail:
        raise error(f"{field}: {what} need about {_gib(need)} ({field}={value}), but only {_gib(avail)} of "
                         f"{device.type} memory are available{where}")


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g} GiB"
