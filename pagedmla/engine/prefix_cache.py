"""Prefix cache: full pages of finished or running sequences, found again by the tokens they hold.

A full page is named by a hash chained over every token up to its end, so equal names mean equal whole
prefixes (not just equal pages). The cache holds one reference on each page it names, so a cached page
outlives the request that wrote it; a page referenced by nobody else is evictable, least recently used
first, when the allocator runs short (it calls ``reclaim``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from pagedmla.cache import PageAllocator


def page_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Chained hash of each full page of ``tokens``: hash i covers tokens[: (i + 1) * page_size]."""
    return extend_page_hashes([], tokens, page_size)


def extend_page_hashes(chain: list[bytes], tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Append to ``chain`` (the ``page_hashes`` of a prefix of ``tokens``) the hashes of the full pages of
    ``tokens`` it lacks, and return it: each page is hashed once however often its sequence grows."""
    prev = chain[-1] if chain else b""
    for start in range(len(chain) * page_size, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[start: start + page_size]))
        prev = h.digest()
        chain.append(prev)
    return chain


class PrefixCache:
    """Maps chained page hashes to page ids, holding a reference on each cached page."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # LRU order: oldest first
        self._names: dict[int, bytes] = {}
        allocator.reclaim = self.evict
        allocator.reclaimable = lambda: self.num_evictable

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, tokens: Sequence[int], hashes: Sequence[bytes] | None = None) -> list[int]:
        """Pages holding the longest cached prefix of ``tokens``, leaving at least one token uncached
        (its logits are needed). The caller takes its own reference (``RequestTable.add_request``).
        hashes: ``page_hashes`` of ``tokens`` (or of a longer sequence they start), already computed."""
        usable = max(0, len(tokens) - 1) // self.page_size
        if hashes is None:
            hashes = page_hashes(tokens[: usable * self.page_size], self.page_size)
        names = []
        for name in hashes[:usable]:
            if name not in self._pages:
                break
            names.append(name)
        self._touch(names)
        return [self._pages[name] for name in names]

    def insert(self, tokens: Sequence[int], pages: Sequence[int], hashes: Sequence[bytes] | None = None) -> None:
        """Register the full pages of a sequence whose first ``len(tokens)`` tokens are written.
        hashes: ``page_hashes`` of ``tokens`` (or of a longer sequence they start), already computed."""
        full = len(tokens) // self.page_size
        if hashes is None:
            hashes = page_hashes(tokens, self.page_size)
        names = []
        for name, page in zip(hashes[:full], pages):
            names.append(name)
            if name in self._pages or page in self._names:
                # Already cached (or the page already names another prefix: it holds one at a time).
                continue
            self.allocator.share([page])
            self._pages[name] = page
            self._names[page] = name
        self._touch([n for n in names if n in self._pages])

    def _touch(self, names: list[bytes]) -> None:
        # Deepest page first, so that eviction takes a prefix's tail before its head (a head page
        # evicted first would strand the tail pages behind it, unreachable by chained names).
        for name in reversed(names):
            self._pages.move_to_end(name)

    def cached_pages(self) -> list[int]:
        """The pages the cache holds a reference on."""
        return list(self._pages.values())

    @property
    def num_evictable(self) -> int:
        return sum(1 for p in self._pages.values() if self.allocator.refcount(p) == 1)

    def evict(self, n: int) -> int:
        """Drop up to ``n`` pages that only the cache references, least recently used first."""
        victims = [name for name, p in self._pages.items() if self.allocator.refcount(p) == 1][:n]
        for name in victims:
            page = self._pages.pop(name)
            del self._names[page]
            self.allocator.free([page])
        return len(victims)

    def clear(self) -> None:
        """Drop every cached page (references held by requests stay)."""
        for page in self._pages.values():
            self.allocator.free([page])
        self._pages.clear()
        self._names.clear()
