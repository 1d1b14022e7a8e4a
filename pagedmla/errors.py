"""Bad values that only the device sees: what the kernels do with them and how the caller learns of them.

Shape, dtype and device checks run on the host on every call and raise ``ValueError``/``TypeError`` naming
the argument. Checks of tensor *values* (page ids, lengths, index arrays, schedule metadata) would need the
values on the host: a synchronisation per call. By default on CUDA they are not read back; instead every
kernel guards each value-dependent address and gives a request whose values are bad a defined result:

- its output rows and LSE are NaN (so the corruption cannot pass for data) and nothing it reads or writes
  lies outside the tensors the call was given;
- every other request's output is computed from its own values alone: bit-identical to a run without the
  bad request's values where the decode split schedule is the same (the schedule is planned from every
  device length, so a bad length may move other requests' split points: a change of rounding only);
- the kernel sets a bit in the device's error word (one int32 per device, see ``error_word``), which the
  caller reads when it synchronises anyway (``device_errors`` / ``raise_device_errors``), e.g. after a step.

Where a value describes the whole call rather than one request (schedule metadata computed for other
lengths, a ``qo_indptr`` / ``cu_seqlens_q`` that is not a partition of the query rows) every request of the
call is affected and every output row is NaN.

``PAGEDMLA_VALIDATE`` selects the host checks instead: ``all`` reads the values back on every call (one
synchronisation) and raises the ``ValueError`` naming the argument before any kernel runs; ``shapes`` skips
them on every device; unset (``auto``), CPU tensors are checked on the host (free there) and CUDA tensors by
the kernels' guards. During a CUDA-graph capture the host never reads values.
"""

from __future__ import annotations

import os
import threading

import torch

# One bit per kind of bad value; the message names the arguments that carry it in the public calls and the
# backend (``ForwardBatch`` fields).
BLOCK_TABLE = 1 << 0
NEGATIVE_LENGTH = 1 << 1
LENGTH_BEYOND_TABLE = 1 << 2
SCHEDULE = 1 << 3
QUERY_INDPTR = 1 << 4
KEY_INDPTR = 1 << 5
MAX_SEQLEN = 1 << 6
CACHE_SLOT = 1 << 7
REQUEST_SLOT = 1 << 8
PAGE_LAYOUT = 1 << 9

MESSAGES = {
    BLOCK_TABLE: "block_table: a page id among the pages a request reads is outside the cache's 0..num_pages-1",
    NEGATIVE_LENGTH: "cache_seqlens/seq_lens: a length is negative",
    LENGTH_BEYOND_TABLE: "cache_seqlens/seq_lens: a length exceeds its block-table row's pages x page_size",
    SCHEDULE: "tile_scheduler_metadata/num_splits: not what get_mla_metadata returns for these cache_seqlens",
    QUERY_INDPTR: "qo_indptr/cu_seqlens_q: not a partition of the query rows (0 first, non-decreasing, "
                  "total rows last)",
    KEY_INDPTR: "cu_seqlens_k: a sequence's key range lies outside k (0 <= start <= end <= total keys)",
    MAX_SEQLEN: "max_seqlen_q/max_q_len: a query length exceeds it",
    CACHE_SLOT: "out_cache_loc/slots: a cache slot is outside 0..num_slots-1",
    REQUEST_SLOT: "req_pool_indices: a request slot is outside the block table's rows",
    PAGE_LAYOUT: "kv_page_indptr/seq_lens: not a partition of the num_kv_pages pages (0 first, non-decreasing, "
                 "num_kv_pages last), or a length reads past the pages its request spans or (the backend's MHA "
                 "forms) differs from seq_lens_cpu",
}

VALIDATE_MODES = ("auto", "all", "shapes")

_words: dict[int, torch.Tensor] = {}
_lock = threading.Lock()


class DeviceInputError(ValueError):
    """Bad argument values that kernels met and reported through the device's error word; ``bits`` says
    which kinds (the module's constants), the message names the arguments."""

    def __init__(self, bits: int):
        self.bits = bits
        super().__init__("; ".join(messages(bits)))


def validate_mode() -> str:
    """``PAGEDMLA_VALIDATE``: ``auto`` (default), ``all`` or ``shapes`` (see the module docstring)."""
    mode = os.environ.get("PAGEDMLA_VALIDATE", "auto") or "auto"
    if mode not in VALIDATE_MODES:
        raise ValueError(f"PAGEDMLA_VALIDATE: expected one of {VALIDATE_MODES}, got {mode!r}")
    return mode


def host_value_checks(device: torch.device) -> bool:
    """Whether the public calls read argument values back to the host for this call's ``device``."""
    mode = validate_mode()
    if mode == "shapes":
        return False
    if device.type == "cuda":
        return mode == "all" and not torch.cuda.is_current_stream_capturing()
    return True


def error_word(device: torch.device) -> torch.Tensor:
    """The int32 [1] word the kernels on ``device`` OR their error bits into, created (zeroed) on first use.

    Create it before capturing CUDA graphs (any eager pagedmla call on the device does, and so does
    ``MLABackend.init_cuda_graph_state``): created during a capture, the zeroing would be part of the graph."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else -1)
    word = _words.get(index)
    if word is None:
        with _lock:
            word = _words.get(index)
            if word is None:
                # A normal tensor even when first asked for under torch.inference_mode (an engine's step):
                # the word is updated in place outside it too.
                with torch.inference_mode(False):
                    word = torch.zeros(1, dtype=torch.int32, device=device)
                _words[index] = word
    return word


def messages(bits: int) -> list[str]:
    return [text for bit, text in MESSAGES.items() if bits & bit] or [f"unknown error bits {bits:#x}"]


def device_errors(device: torch.device | str | None = None, *, clear: bool = True) -> int:
    """The error bits the kernels on ``device`` (default: the current CUDA device, else the CPU) have set
    since the last clear; reads the word back (a synchronisation) and, with ``clear``, zeroes it."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    word = error_word(torch.device(device))
    bits = int(word.item())
    if clear and bits:
        word.zero_()
    return bits


def raise_device_errors(device: torch.device | str | None = None) -> None:
    """Raise ``DeviceInputError`` naming the arguments if the kernels on ``device`` met bad values since the
    last check (clearing the word), else return. One synchronisation: call it where the caller syncs anyway."""
    bits = device_errors(device)
    if bits:
        raise DeviceInputError(bits)
