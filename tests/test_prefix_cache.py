"""Prefix cache bookkeeping and the n-gram drafter."""

import pytest

from pagedmla.cache import OutOfPagesError, PageAllocator, RequestTable
from pagedmla.engine.drafter import NgramDrafter
from pagedmla.engine.prefix_cache import PrefixCache, extend_page_hashes, page_hashes


def test_hashes_name_whole_prefixes():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = page_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3
    # Same second page contents behind a different first page: a different name.
    assert a[1] != b[1]
    assert page_hashes([1, 2, 3, 4], 2) == a[:2]


def test_match_share_and_evict_lru():
    alloc = PageAllocator(9)
    table = RequestTable(alloc, 4, 4, 8)
    cache = PrefixCache(alloc, 4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full pages
    r = table.add_request()
    table.ensure_capacity(r, len(prompt))
    cache.insert(prompt, table.pages[r])
    assert len(cache) == 3
    # At least one token stays uncached: a 12-token prompt reuses 2 pages, not 3.
    assert cache.match(prompt[:12]) == table.pages[r][:2]
    assert cache.match(prompt + [99]) == table.pages[r][:3]
    shared = cache.match(prompt)
    r2 = table.add_request(shared)
    assert all(alloc.refcount(p) == 3 for p in shared)
    table.free_request(r)
    table.free_request(r2)
    assert alloc.num_free == 8 - 3 and cache.num_evictable == 3  # the partial 4th page went back
    # Allocating more than the free list holds evicts cached pages, oldest first.
    cache.match([50, 51, 52, 53, 54])  # a miss touches nothing
    pages = alloc.allocate(6)
    assert len(pages) == 6 and len(cache) == 2
    assert cache.match(prompt) == shared[:2], "the least recently used page (the third) goes first"
    # An allocation that eviction cannot satisfy fails without evicting anything.
    with pytest.raises(OutOfPagesError):
        alloc.allocate(3)
    assert len(cache) == 2 and alloc.num_free == 0
    assert alloc.allocate(2) and len(cache) == 0
    alloc.free(pages)
    assert alloc.num_free == 6


def test_drafter_proposes_continuations():
    d = NgramDrafter(k=3, max_n=3)
    assert d.propose([5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5]
    assert d.propose([1, 2, 3]) == []
    # The longest matching suffix wins over a more recent shorter one.
    assert d.propose([1, 2, 3, 4, 9, 3, 7, 2, 3]) == [4, 9, 3]
    with pytest.raises(ValueError, match="k"):
        NgramDrafter(k=0)


def test_hash_chain_grows_incrementally():
    tokens = list(range(100, 140))
    chain: list[bytes] = []
    for n in range(len(tokens) + 1):
        before = list(chain)
        assert extend_page_hashes(chain, tokens[:n], 4) is chain
        assert chain == page_hashes(tokens[:n], 4) and chain[: len(before)] == before


def test_precomputed_hashes_match_and_insert_like_tokens():
    alloc = PageAllocator(9)
    table = RequestTable(alloc, 4, 4, 8)
    cache = PrefixCache(alloc, 4)
    prompt = list(range(1, 14))
    r = table.add_request()
    table.ensure_capacity(r, len(prompt))
    longer = page_hashes(prompt + [20, 21, 22], 4)  # a chain reaching past the written tokens
    cache.insert(prompt[:8], table.pages[r], longer)
    assert len(cache) == 2  # only the pages of the tokens given
    assert cache.match(prompt, longer) == cache.match(prompt) == table.pages[r][:2]
    assert cache.match(prompt[:8], longer) == cache.match(prompt[:8]) == table.pages[r][:1]
