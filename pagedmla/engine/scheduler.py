"""Continuous-batching scheduler: admits waiting requests between steps, picks each step's batch and
hands out pages on demand.

Per step a request runs a chunk of its uncached tokens: a prompt (or, after preemption, prompt plus
generated tokens) longer than what is left of the ``max_num_batched_tokens`` budget is split across
steps; a request whose prompt is done decodes one token (1 + k with speculative decoding). Policy:

* ``mixed=False`` (nano-vllm's): a step prefills (EXTEND: unfinished prompts first, then new requests)
  whenever there is prefill work that fits, otherwise every running request decodes (DECODE, or a
  verify step with speculative decoding); but never two EXTEND steps in a row while the oldest running
  request waits to decode.
* ``mixed=True``: running decodes come first, prompt chunks fill the rest of the budget, and both share
  one MIXED step (extends first, as the backend expects); the oldest running request's chunk gets a
  token even when decodes would fill the budget.

Pages are allocated as a step needs them: for the tokens an EXTEND step or chunk writes, and for one
decode row, or with speculative decoding for the 1 + k rows of a verify step. Speculative decode steps
reserve those k draft rows before the drafts exist, so a step that ends up a plain decode (no request
had a proposal) leaves them allocated for the next one; after a verify step the pages past the kept
tokens go back.

Progress under page pressure. ``seq_id`` is a request's age. Every step reserves pages oldest request
first, and when pages run out (after the prefix cache has given back what only it holds) the youngest
running request is preempted: its pages are freed and it returns to the front of the waiting queue to be
recomputed later. So the running requests are always older than the waiting ones, and the oldest running
request is never preempted (it fits alone: ``check`` refuses at ``add`` a request that could not). A
waiting request is admitted only when the free (and evictable) pages cover all its uncached tokens, not
just its first chunk, so a preempted request does not come back to be preempted again by the growth of
the request that displaced it. With ``mixed=False`` a step that prefills while the oldest running
request waits to decode is followed by a decode step. Together: the oldest unfinished request advances in
at least every other step (by a prompt chunk that has the budget first, or by one or more decoded tokens;
with ``mixed=True`` in every step, by at least one token), so it finishes within a number of steps
proportional to its prompt and max_tokens, and the engine drains within the sum of that over its
requests (``drain_bound``).
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
        # Set by an EXTEND step (mixed=False) that left the oldest running request waiting to decode.
        self._decode_due = False

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

    def drain_bound(self, seqs: list[Sequence]) -> int:
        """Steps within which ``seqs`` (every unfinished request, and no more arriving) all finish (the
        module's progress argument). Per request of P prompt tokens and max_tokens M, whose longest
        recomputation is P + M tokens: with ``mixed=False``, two steps per prompt chunk of that and per
        output token; with ``mixed=True`` one step per token of both (the oldest request's chunk shrinks to
        one token when decodes fill the budget)."""
        budget = self.max_num_batched_tokens
        if self.mixed:
            return sum(s.num_prompt_tokens + 2 * s.params.max_tokens for s in seqs)
        return sum(2 * (-(-(s.num_prompt_tokens + s.params.max_tokens) // budget) + s.params.max_tokens)
                   for s in seqs)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None when there is nothing to run)."""
        scheduled: set[int] = set()
        preempted = self.num_preemptions
        if self.mixed:
            extends, decodes = self._schedule_running(scheduled, decode=True, extend=True)
            budget = self.max_num_batched_tokens - len(decodes) - sum(n for _, n in extends)
            extends += self._admit(scheduled, budget, preempted)
            if not extends and not decodes:
                return None
            mode = ForwardMode.MIXED if extends and decodes else \
                (ForwardMode.EXTEND if extends else ForwardMode.DECODE)
            return ScheduledBatch([s for s, _ in extends] + decodes, mode, len(extends),
                                  [n for _, n in extends] + [1] * len(decodes))
        if self._decode_due:
            self._decode_due = False
            batch = self._decode_batch(scheduled)
            if batch is not None:
                return batch
        extends, _ = self._schedule_running(scheduled, decode=False, extend=True)
        extends += self._admit(scheduled, self.max_num_batched_tokens - sum(n for _, n in extends), preempted)
        if extends:
            oldest = min(self.running, key=lambda s: s.seq_id)
            self._decode_due = oldest.seq_id not in scheduled and _decodes(oldest)
            return ScheduledBatch([s for s, _ in extends], ForwardMode.EXTEND, len(extends), [n for _, n in extends])
        return self._decode_batch(scheduled)

    def _decode_batch(self, scheduled: set[int]) -> ScheduledBatch | None:
        """A DECODE (or speculative) step of every running request past its prompt that gets its pages."""
        _, decodes = self._schedule_running(scheduled, decode=True, extend=False)
        if not decodes:
            return None
        return ScheduledBatch(decodes, ForwardMode.DECODE, 0, [1] * len(decodes),
                              speculative=self.num_speculative_tokens > 0)

    def _schedule_running(self, scheduled: set[int], *, decode: bool,
                          extend: bool) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Pages for the running requests' work this step, oldest first (so a shortage preempts the
        youngest): prompt chunks (``extend``) within the step's budget, and decode (or verify) rows
        (``decode``). With both, decodes keep their priority on the budget: a chunk leaves a token for
        each younger decode, except that the oldest request's chunk always gets at least one. Returns
        (chunks, decodes), each oldest first."""
        extends: list[tuple[Sequence, int]] = []
        decodes: list[Sequence] = []
        budget = self.max_num_batched_tokens
        order = sorted(self.running, key=lambda s: s.seq_id)
        is_decode = [_decodes(s) for s in order]
        younger_decodes = sum(is_decode) if decode else 0
        for rank, (seq, decoding) in enumerate(zip(order, is_decode)):
            if decoding and decode:
                younger_decodes -= 1
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this pass
            if decoding:
                if decode and budget > 0 and self._reserve(seq, len(seq) + self.num_speculative_tokens, scheduled):
                    scheduled.add(seq.seq_id)
                    decodes.append(seq)
                    budget -= 1
                continue
            room = budget - younger_decodes if rank else max(1, budget - younger_decodes)
            if extend and room > 0:
                n = min(seq.num_new_tokens, room)
                if self._reserve(seq, seq.num_cached_tokens + n, scheduled):
                    scheduled.add(seq.seq_id)
                    extends.append((seq, n))
                    budget -= n
        return extends, decodes

    def _admit(self, scheduled: set[int], budget: int, preempted: int) -> list[tuple[Sequence, int]]:
        """Newly admitted requests' first chunks within ``budget`` tokens, oldest waiting first, while
        slots last and the pages cover each one's whole uncached length (``KVPages.open``); none in a step
        that had to preempt (``num_preemptions`` moved past ``preempted``: the pages are short already)."""
        out: list[tuple[Sequence, int]] = []
        if self.num_preemptions != preempted:
            return out
        while budget > 0 and self.waiting and len(self.running) < self.max_batch_size:
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
        while pages are short; False (``seq`` itself preempted) when even that is not enough. Callers go
        oldest first, so every scheduled request is older than ``seq`` and the victim is the youngest
        running request."""
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
                    now: float = 0.0, errors: dict[int, str] | None = None) -> list[Sequence]:
        """Advance each request past its step: ``new_tokens[i]`` are the tokens request i produced (none
        for a prompt chunk that is not the last; 1 + accepted drafts for a verify step, ``verified``).
        Finishes the requests that stop (freeing their pages) and returns them.

        errors: batch row -> message for requests whose step failed (no token, or no log-probabilities,
        could be had): they finish with reason "error" instead, as does a request whose own advance
        raises; the others are unaffected."""
        finished = []
        errors = errors or {}
        for i, (seq, tokens) in enumerate(zip(batch.seqs, new_tokens)):
            if i in errors:
                self.fail(seq, errors[i])
                finished.append(seq)
                continue
            try:
                reason = self._advance(seq, tokens, batch.num_tokens[i], verified, now)
            except Exception as exc:  # one request's failure must not take the step's others with it
                reason = None
                self.fail(seq, f"post-processing raised {type(exc).__name__}: {exc}")
            if seq.is_finished:
                finished.append(seq)
            elif reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif verified:
                self.pages.trim(seq, len(seq))
        return finished

    def _advance(self, seq: Sequence, tokens: list[int], num_tokens: int, verified: bool,
                 now: float) -> str | None:
        """Append ``tokens`` to ``seq`` up to a stop, count the rows its step wrote as cached and offer its
        full pages to the prefix cache; returns the stop reason (None: it goes on)."""
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
        seq.num_cached_tokens += appended if verified else num_tokens
        self.pages.commit(seq)
        return reason

    def fail(self, seq: Sequence, message: str) -> None:
        """End ``seq`` (running, waiting or already finished) with reason "error"; ``message`` says why."""
        seq.error = message
        self.finish(seq, "error")

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos):
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_context_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (finished, failed or aborted): give back its pages and take it off the queues."""
        if seq.status == SequenceStatus.RUNNING:
            self.pages.release(seq)
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED


def _decodes(seq: Sequence) -> bool:
    """Whether ``seq``'s next step is a decode (its prompt, or recomputation, is done)."""
    return seq.num_new_tokens == 1
