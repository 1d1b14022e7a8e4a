"""Continuous-batching scheduler: admits waiting requests between steps, picks each step's batch and
hands out pages on demand.

Per step a request runs a chunk of its uncached tokens: a prompt (or, after preemption, prompt plus
generated tokens) longer than what is left of the ``max_num_batched_tokens`` budget is split across
steps; a request whose prompt is done decodes one token (1 + k with speculative decoding). Policy:

* ``mixed=False`` (nano-vllm's): a step prefills (EXTEND: unfinished prompts first, then new requests)
  whenever there is prefill work that fits, otherwise every running request decodes (DECODE, or a
  verify step with speculative decoding).
* ``mixed=True``: running decodes come first, prompt chunks fill the rest of the budget, and both share
  one MIXED step (extends first, as the backend expects).

Pages are allocated as a step needs them: for the tokens an EXTEND step or chunk writes, and for one
decode row, or with speculative decoding for the 1 + k rows of a verify step. Speculative decode steps
reserve those k draft rows before the drafts exist, so a step that ends up a plain decode (no request
had a proposal) leaves them allocated for the next one; after a verify step the pages past the kept
tokens go back. When pages run out (after the prefix cache has given back what only it holds), the
youngest running requests are preempted: their pages are freed and they return to the front of the
waiting queue to be recomputed later. A request that could not fit even alone is refused at ``add``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedmla.backend import ForwardMode
from pagedmla.cache import OutOfPagesError
from pagedmla.engine.kv_pages import KVPages
from pagedmla.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step: ``seqs`` in batch order; the first ``num_extends`` extend (prefill chunks of
    ``num_tokens[i]`` tokens), the rest decode. ``speculative``: a decode step whose requests may
    verify draft tokens (the engine picks DECODE or TARGET_VERIFY once it has the drafts)."""

    seqs: list[Sequence]
    mode: ForwardMode
    num_extends: int
    num_tokens: list[int] = field(default_factory=list)
    speculative: bool = False

    def samples(self, i: int) -> bool:
        """Whether request i's step ends at its last token (so its logits give the next token)."""
        seq = self.seqs[i]
        return i >= self.num_extends or seq.num_cached_tokens + self.num_tokens[i] == len(seq)


class Scheduler:
    """pages: the request page manager; num_speculative_tokens: draft tokens per verify step (0: off; an
    int >= 0, which ``LLM`` checks before it sizes the model runner for it)."""

    def __init__(self, pages: KVPages, *, max_batch_size: int, max_num_batched_tokens: int, max_context_len: int,
                 eos_token_ids: list[int], mixed: bool = False, num_speculative_tokens: int = 0):
        for name, value in (("max_batch_size", max_batch_size), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_context_len", max_context_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if mixed and num_speculative_tokens:
            raise ValueError("mixed_batching: verify steps cannot share a step with prefills; "
                             "turn off mixed batching or speculative decoding")
        self.pages = pages
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_context_len = max_context_len
        self.eos_token_ids = set(eos_token_ids)
        self.mixed = mixed
        self.num_speculative_tokens = num_speculative_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def max_pages_needed(self, seq: Sequence) -> int:
        """Pages ``seq`` holds at its longest: every token but the last has a cache row, plus the draft
        slots of a verify step."""
        tokens = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_context_len)
        return self.pages.pages_for(tokens - 1 + self.num_speculative_tokens)

    def add(self, seq: Sequence) -> None:
        """Queue a request; ValueError if it could never run with this cache (``check``)."""
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """ValueError if ``seq`` could never run: an empty prompt, one that fills the context, or one whose
        longest form needs more pages than the cache has. Queues nothing."""
        if seq.num_prompt_tokens < 1:
            raise ValueError("prompts: a prompt needs at least one token")
        if seq.num_prompt_tokens >= self.max_context_len:
            raise ValueError(f"prompts: a prompt of {seq.num_prompt_tokens} tokens leaves no room to generate "
                             f"within max_context_len={self.max_context_len}")
        need = self.max_pages_needed(seq)
        if need > self.pages.capacity:
            raise ValueError(f"num_pages: the request needs {need} pages (prompt + max_tokens) but the cache "
                             f"has {self.pages.capacity}; raise num_pages or lower max_tokens")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None when there is nothing to run)."""
        scheduled: set[int] = set()
        if self.mixed:
            decodes = self._schedule_decodes(scheduled, self.max_num_batched_tokens)
            budget = self.max_num_batched_tokens - len(decodes)
            extends = self._schedule_extends(scheduled, budget)
            if not extends and not decodes:
                return None
            mode = ForwardMode.MIXED if extends and decodes else \
                (ForwardMode.EXTEND if extends else ForwardMode.DECODE)
            return ScheduledBatch([s for s, _ in extends] + decodes, mode, len(extends),
                                  [n for _, n in extends] + [1] * len(decodes))
        extends = self._schedule_extends(scheduled, self.max_num_batched_tokens)
        if extends:
            return ScheduledBatch([s for s, _ in extends], ForwardMode.EXTEND, len(extends), [n for _, n in extends])
        decodes = self._schedule_decodes(scheduled, None)
        if not decodes:
            return None
        return ScheduledBatch(decodes, ForwardMode.DECODE, 0, [1] * len(decodes),
                              speculative=self.num_speculative_tokens > 0)

    def _schedule_decodes(self, scheduled: set[int], budget: int | None) -> list[Sequence]:
        """Running requests past their prompt, oldest first, with pages for their decode (or verify) rows."""
        out = []
        extra = self.num_speculative_tokens
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if seq.num_new_tokens != 1 or seq.status != SequenceStatus.RUNNING:
                continue
            if budget is not None and len(out) >= budget:
                break
            if self._reserve(seq, len(seq) + extra, scheduled):
                scheduled.add(seq.seq_id)
                out.append(seq)
        return out

    def _schedule_extends(self, scheduled: set[int], budget: int) -> list[tuple[Sequence, int]]:
        """Prompt chunks within ``budget`` tokens: unfinished prompts of running requests (oldest first),
        then newly admitted requests while slots, budget and pages last."""
        out: list[tuple[Sequence, int]] = []
        preempted = self.num_preemptions
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if budget <= 0:
                break
            if seq.num_new_tokens <= 1 or seq.seq_id in scheduled or seq.status != SequenceStatus.RUNNING:
                continue
            n = min(seq.num_new_tokens, budget)
            if self._reserve(seq, seq.num_cached_tokens + n, scheduled):
                scheduled.add(seq.seq_id)
                out.append((seq, n))
                budget -= n
        # No admissions in a step that had to preempt: the pages are short already.
        while budget > 0 and self.waiting and len(self.running) < self.max_batch_size \
                and self.num_preemptions == preempted:
            seq = self.waiting[0]
            try:
                n = self.pages.open(seq, budget)
            except OutOfPagesError:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.add(seq.seq_id)
            out.append((seq, n))
            budget -= n
        return out

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Grow ``seq`` to ``num_tokens`` tokens, preempting the youngest unscheduled running requests
        while pages are short; False (``seq`` itself preempted) when even that is not enough."""
        while True:
            try:
                self.pages.grow(seq, num_tokens)
                return True
            except OutOfPagesError:
                candidates = [s for s in self.running if s.seq_id not in scheduled]
                victim = max(candidates, key=lambda s: s.seq_id)
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and queue it first for recomputation (prompt + generated tokens)."""
        self.pages.release(seq)
        seq.num_cached_tokens = 0
        seq.num_committed_pages = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ after the step
    def postprocess(self, batch: ScheduledBatch, new_tokens: list[list[int]], verified: bool = False,
                    now: float = 0.0) -> list[Sequence]:
        """Advance each request past its step: ``new_tokens[i]`` are the tokens request i produced (none
        for a prompt chunk that is not the last; 1 + accepted drafts for a verify step, ``verified``).
        Finishes the requests that stop (freeing their pages) and returns them."""
        finished = []
        for i, (seq, tokens) in enumerate(zip(batch.seqs, new_tokens)):
            reason = None
            appended = 0
            for token in tokens:
                seq.token_ids.append(token)
                seq.token_times.append(now)
                appended += 1
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            # Rows written this step that stay valid: the whole chunk; in a verify step the last token's
            # and those of the drafts now in the sequence, the newest token excepted (it has no row in
            # plain decoding either); the rejected drafts' rows are dropped.
            seq.num_cached_tokens += appended if verified else batch.num_tokens[i]
            self.pages.commit(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif verified:
                self.pages.trim(seq, len(seq))
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos):
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_context_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (finished or aborted): give back its pages and take it off the queues."""
        if seq.status == SequenceStatus.RUNNING:
            self.pages.release(seq)
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
