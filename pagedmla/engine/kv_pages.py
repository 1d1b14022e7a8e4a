"""A request's pages through its life: opened with pages for its first chunk (from a cached prefix when
there is one), grown on demand, trimmed after rejected draft tokens, offered to the prefix cache as pages
fill, and released.

The allocator's books are checkable at any time (``audit``): every page is free, or referenced exactly
once by each running request that lists it plus once by the prefix cache when the cache names it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagedmla.cache import OutOfPagesError, RequestTable
from pagedmla.engine.prefix_cache import PrefixCache, extend_page_hashes
from pagedmla.engine.sequence import Sequence


class PageBookError(AssertionError):
    """The page allocator's reference counts disagree with the pages' owners."""


class KVPages:
    """table: the RequestTable the model runner reads; prefix_cache: None disables prefix caching.

    recompute_last_cached_page: a request that finds a cached prefix of n pages reuses n - 1 and recomputes
    the last. An MTP draft model needs that: the draft's row at a position pairs the target's hidden state
    there with the next token, so the last row of the last shared page belongs to the token after it,
    which the request that wrote the page may not share; the target's hidden states of the recomputed page
    let the draft write those rows for this request's own tokens."""

    def __init__(self, table: RequestTable, prefix_cache: PrefixCache | None = None, *,
                 recompute_last_cached_page: bool = False):
        self.table = table
        self.recompute_last_cached_page = recompute_last_cached_page
        self.allocator = table.allocator
        self.page_size = table.page_size
        self.prefix_cache = prefix_cache
        # Counted per admission that got its pages (a refused attempt is retried later and counts then):
        # tokens whose prefill a cached prefix saved, admissions that looked up the cache, and those
        # that found at least one page.
        self.cached_prefix_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def capacity(self) -> int:
        """Pages one request could ever hold (all but the reserved page 0)."""
        return self.allocator.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def open(self, seq: Sequence, max_tokens: int) -> int:
        """Give ``seq`` a request slot, starting from its longest cached full-page prefix, with pages for
        its next chunk: up to ``max_tokens`` of its uncached tokens. Returns the chunk's length.

        OutOfPagesError when the pages are short, for the chunk or for all of ``seq``'s uncached tokens
        (free plus evictable pages must cover them, though only the chunk's are taken now: a request is
        admitted when its whole prefill fits, so a preempted one does not come back only to be preempted
        again a chunk later): the slot is closed again and nothing is kept or counted."""
        shared = []
        if self.prefix_cache is not None:
            shared = self.prefix_cache.match(seq.token_ids, self._hashes(seq))
            if self.recompute_last_cached_page:
                shared = shared[:-1]
        seq.slot = self.table.add_request(shared)
        seq.num_cached_tokens = len(shared) * self.page_size
        seq.num_committed_pages = len(shared)
        n = min(seq.num_new_tokens, max_tokens)
        try:
            need = self.pages_for(len(seq)) - len(shared)
            if need > self.allocator.num_available:
                raise OutOfPagesError(f"request {seq.seq_id} needs {need} more pages, "
                                      f"{self.allocator.num_available} are free or evictable")
            self.grow(seq, seq.num_cached_tokens + n)
        except OutOfPagesError:
            self.release(seq)
            seq.num_cached_tokens = 0
            seq.num_committed_pages = 0
            raise
        if self.prefix_cache is not None:
            self.cached_prefix_tokens += seq.num_cached_tokens
            self.prefix_queries += 1
            self.prefix_hits += bool(shared)
        return n

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s pages cover ``num_tokens`` tokens (OutOfPagesError taking nothing if they cannot)."""
        self.table.ensure_capacity(seq.slot, num_tokens)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages beyond the first ``num_tokens`` tokens (slots of rejected draft tokens)."""
        pages = self.table.pages[seq.slot]
        keep = self.pages_for(num_tokens)
        if keep >= len(pages):
            return
        tail = pages[keep:]
        del pages[keep:]
        # The row's entries past the last page hold the reserved page 0, as RequestTable keeps them.
        self.table.block_table[seq.slot, keep:keep + len(tail)] = 0
        self.allocator.free(tail)

    def commit(self, seq: Sequence) -> None:
        """Offer the prefix cache the pages ``seq`` has completely written since the last commit."""
        if self.prefix_cache is None:
            return
        full = seq.num_cached_tokens // self.page_size
        if full > seq.num_committed_pages:
            # Every full page is offered again (the cache refreshes their recency), but only the new
            # ones are hashed: the sequence keeps its chain.
            self.prefix_cache.insert(seq.token_ids[: full * self.page_size], self.table.pages[seq.slot][:full],
                                     self._hashes(seq))
            seq.num_committed_pages = full

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """``seq``'s chain of page hashes, extended over the full pages its tokens gained since last time."""
        return extend_page_hashes(seq.page_hashes, seq.token_ids, self.page_size)

    def release(self, seq: Sequence) -> None:
        """Close ``seq``'s slot (its pages lose one reference; cached ones stay with the cache)."""
        self.table.free_request(seq.slot)
        seq.slot = None

    def audit(self, running: Iterable[Sequence]) -> None:
        """Raise PageBookError unless every page's reference count equals its owners (the running requests
        listing it, plus the prefix cache) and the free pages are exactly those with no owner."""
        owners: Counter[int] = Counter()
        slots = set()
        for seq in running:
            if seq.slot is None or seq.slot not in self.table.pages:
                raise PageBookError(f"running request {seq.seq_id} has no open slot")
            slots.add(seq.slot)
            pages = self.table.pages[seq.slot]
            if len(set(pages)) != len(pages):
                raise PageBookError(f"request {seq.seq_id} lists a page twice: {pages}")
            owners.update(pages)
            row = self.table.block_table[seq.slot].tolist()
            if row[: len(pages)] != pages or any(row[len(pages):]):
                raise PageBookError(f"request {seq.seq_id}: block-table row {row} disagrees with pages {pages}")
        if slots != set(self.table.pages):
            raise PageBookError(f"open slots {sorted(self.table.pages)} are not the running requests' {sorted(slots)}")
        if self.prefix_cache is not None:
            owners.update(self.prefix_cache.cached_pages())
        free = 0
        for page in range(1, self.allocator.num_pages):
            refs = self.allocator.refcount(page)
            if refs != owners[page]:
                raise PageBookError(f"page {page} has {refs} references but {owners[page]} owners")
            free += refs == 0
        if free != self.allocator.num_free:
            raise PageBookError(f"{free} pages have no owner but the allocator lists {self.allocator.num_free} free")
