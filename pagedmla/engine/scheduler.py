"""Continuous-batching scheduler: admits waiting requests between steps, picks each step's batch.

Policy (nano-vllm's): a step prefills newly admitted requests (EXTEND) when any can be admitted,
otherwise every running request decodes one token (DECODE). With ``mixed=True`` new requests'
prefills and the running requests' decodes share one MIXED step instead. Admission reserves a
request's worst case (prompt + max_tokens) in pages, so a running request never runs out of pages
(preemption can replace this reservation later); pages themselves are allocated as tokens arrive
and freed when the request finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedmla.backend import ForwardMode
from pagedmla.cache import RequestTable
from pagedmla.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step: ``seqs`` in batch order; the first ``num_extends`` extend (prefill), the rest decode."""

    seqs: list[Sequence]
    mode: ForwardMode
    num_extends: int


class Scheduler:
    def __init__(self, table: RequestTable, *, max_batch_size: int, max_num_batched_tokens: int,
                 max_context_len: int, eos_token_ids: list[int], mixed: bool = False):
        for name, value in (("max_batch_size", max_batch_size), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_context_len", max_context_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.table = table
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_context_len = max_context_len
        self.eos_token_ids = set(eos_token_ids)
        self.mixed = mixed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reserved: dict[int, int] = {}
        self._capacity = table.allocator.num_pages - 1

    def _pages_needed(self, seq: Sequence) -> int:
        tokens = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_context_len)
        return -(-tokens // self.table.page_size)

    def add(self, seq: Sequence) -> None:
        """Queue a request; ValueError if it could never run with this cache."""
        if seq.num_prompt_tokens < 1:
            raise ValueError("prompts: a prompt needs at least one token")
        if seq.num_prompt_tokens >= self.max_context_len:
            raise ValueError(f"prompts: a prompt of {seq.num_prompt_tokens} tokens leaves no room to generate "
                             f"within max_context_len={self.max_context_len}")
        need = self._pages_needed(seq)
        if need > self._capacity:
            raise ValueError(f"num_pages: the request needs {need} pages (prompt + max_tokens) but the cache "
                             f"has {self._capacity}; raise num_pages or lower max_tokens")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None when there is nothing to run)."""
        admitted: list[Sequence] = []
        tokens = 0
        reserved = sum(self._reserved.values())
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            need = self._pages_needed(seq)
            if reserved + need > self._capacity:
                break
            if admitted and tokens + seq.num_new_tokens > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            seq.slot = self.table.add_request()
            self.table.ensure_capacity(seq.slot, len(seq))
            seq.status = SequenceStatus.RUNNING
            self._reserved[seq.seq_id] = need
            reserved += need
            tokens += seq.num_new_tokens
            admitted.append(seq)
        if admitted and not (self.mixed and self.running):
            self.running.extend(admitted)
            return ScheduledBatch(admitted, ForwardMode.EXTEND, len(admitted))
        decodes = list(self.running)
        for seq in decodes:
            self.table.ensure_capacity(seq.slot, len(seq))
        self.running.extend(admitted)
        if admitted:
            return ScheduledBatch(admitted + decodes, ForwardMode.MIXED, len(admitted))
        if decodes:
            return ScheduledBatch(decodes, ForwardMode.DECODE, 0)
        return None

    def postprocess(self, batch: ScheduledBatch, tokens: list[int]) -> list[Sequence]:
        """Append each request's new token, finish the ones that stop (freeing their pages); returns those."""
        finished = []
        for seq, token in zip(batch.seqs, tokens):
            seq.num_cached_tokens = len(seq)
            seq.token_ids.append(token)
            reason = None
            if token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos):
                reason = "stop"
            elif seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_context_len:
                reason = "length"
            if reason is not None:
                seq.finish_reason = reason
                seq.status = SequenceStatus.FINISHED
                self.table.free_request(seq.slot)
                seq.slot = None
                del self._reserved[seq.seq_id]
                self.running.remove(seq)
                finished.append(seq)
        return finished
