"""Page allocator, request block tables and the per-layer latent cache: exact slot-level behaviour."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from oracle import assert_attention_close, dense_paged, gather_rows, gen

import pagedmla
from pagedmla import MLAKVCache, OutOfPagesError, PageAllocator, RequestTable


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# PageAllocator
# ----------------------------------------------------------------------------------------------------

def test_allocator_never_hands_out_page_zero():
    alloc = PageAllocator(9)
    assert alloc.num_free == 8 and alloc.num_used == 0
    got = alloc.allocate(3) + alloc.allocate(5)
    assert sorted(got) == list(range(1, 9))
    assert alloc.num_free == 0 and alloc.num_used == 8
    assert all(alloc.refcount(p) == 1 for p in got) and alloc.refcount(0) == 0
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    assert alloc.allocate(0) == []


def test_allocator_out_of_pages_takes_nothing():
    alloc = PageAllocator(6)
    first = alloc.allocate(2)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(4)
    assert alloc.num_free == 3 and alloc.num_used == 2
    rest = alloc.allocate(3)
    assert sorted(first + rest) == [1, 2, 3, 4, 5]


def test_allocator_reuses_freed_pages():
    alloc = PageAllocator(8)
    a = alloc.allocate(4)
    b = alloc.allocate(3)
    assert alloc.free(a[1:3]) == a[1:3]
    assert alloc.num_free == 2 and all(alloc.refcount(p) == 0 for p in a[1:3])
    # Only the freed pages are free: the next allocation must be exactly them.
    again = alloc.allocate(2)
    assert sorted(again) == sorted(a[1:3])
    assert not set(again) & (set(a[:1] + a[3:]) | set(b))
    # Most recently freed first.
    alloc.free([b[0]])
    alloc.free([a[0]])
    assert alloc.allocate(1) == [a[0]]
    assert alloc.allocate(1) == [b[0]]


def test_allocator_double_free_is_rejected_and_harmless():
    alloc = PageAllocator(5)
    pages = alloc.allocate(2)
    alloc.free([pages[0]])
    with pytest.raises(ValueError, match="pages"):
        alloc.free([pages[0]])
    with pytest.raises(ValueError, match="pages"):
        alloc.free([pages[1], pages[0]])  # one good, one double: nothing must change
    assert alloc.refcount(pages[1]) == 1 and alloc.num_free == 3
    # The page freed once is handed out once, not twice.
    got = alloc.allocate(3)
    assert len(set(got)) == 3 and pages[1] not in got


def test_allocator_share_and_refcounts():
    alloc = PageAllocator(6)
    prefix = alloc.allocate(2)
    alloc.share(prefix)
    alloc.share(prefix[:1])
    assert [alloc.refcount(p) for p in prefix] == [3, 2]
    assert alloc.free(prefix) == []  # still referenced
    assert [alloc.refcount(p) for p in prefix] == [2, 1]
    assert alloc.free(prefix) == [prefix[1]]
    assert alloc.free(prefix[:1]) == [prefix[0]]
    assert alloc.num_free == 5
    with pytest.raises(ValueError, match="pages"):
        alloc.share(prefix)  # no longer live


@pytest.mark.parametrize("seed", range(4))
def test_allocator_random_operations_against_a_model(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 5, 33])
    alloc = PageAllocator(n)
    refs = {}  # page -> count, the model
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            k = rng.randint(0, 4)
            free_now = n - 1 - len(refs)
            if k > free_now:
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(k)
                continue
            got = alloc.allocate(k)
            assert len(got) == k and not set(got) & set(refs) and 0 not in got
            refs.update({p: 1 for p in got})
        elif op < 0.6 and refs:
            p = rng.choice(sorted(refs))
            alloc.share([p])
            refs[p] += 1
        elif refs:
            pages = rng.sample(sorted(refs), rng.randint(1, min(3, len(refs))))
            released = alloc.free(pages)
            expect = []
            for p in pages:
                refs[p] -= 1
                if refs[p] == 0:
                    del refs[p]
                    expect.append(p)
            assert released == expect
        assert alloc.num_free == n - 1 - len(refs)
        assert all(alloc.refcount(p) == c for p, c in refs.items())


# ----------------------------------------------------------------------------------------------------
# RequestTable
# ----------------------------------------------------------------------------------------------------

def check_table(table: RequestTable) -> None:
    """Every open row lists its pages then zeros; every closed row is all zeros."""
    bt = table.block_table.tolist()
    for slot, row in enumerate(bt):
        pages = table.pages.get(slot, [])
        assert row[:len(pages)] == pages
        assert row[len(pages):] == [0] * (len(row) - len(pages))


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_request_table_rows_and_token_slots(page_size):
    alloc = PageAllocator(40)
    table = RequestTable(alloc, page_size, max_requests=3, max_pages_per_request=12)
    assert table.block_table.dtype == torch.int32 and tuple(table.block_table.shape) == (3, 12)
    a, b = table.add_request(), table.add_request()
    assert a != b
    lens = {a: 0, b: 0}
    rng = random.Random(page_size)
    for _ in range(10):
        s = rng.choice([a, b])
        new_len = min(lens[s] + rng.randint(0, 2 * page_size + 1), 12 * page_size)
        before = list(table.pages[s])
        added = table.ensure_capacity(s, new_len)
        assert table.pages[s] == before + added
        assert len(table.pages[s]) == -(-new_len // page_size)
        check_table(table)
        slots = table.token_slots(s, lens[s], new_len)
        assert slots.dtype == torch.int64
        expect = [table.pages[s][p // page_size] * page_size + p % page_size for p in range(lens[s], new_len)]
        assert slots.tolist() == expect
        lens[s] = new_len
    # All positions of both requests map to distinct slots, none on page 0.
    everything = table.token_slots(a, 0, lens[a]).tolist() + table.token_slots(b, 0, lens[b]).tolist()
    assert len(set(everything)) == len(everything)
    assert all(x >= page_size for x in everything)
    # Shrinking requests nothing.
    assert table.ensure_capacity(a, 0) == []


def test_request_table_free_request_releases_and_zeroes():
    alloc = PageAllocator(10)
    table = RequestTable(alloc, 4, max_requests=2, max_pages_per_request=5)
    a = table.add_request()
    table.ensure_capacity(a, 17)
    pages = list(table.pages[a])
    assert len(pages) == 5 and alloc.num_free == 4
    assert sorted(table.free_request(a)) == sorted(pages)
    assert alloc.num_free == 9 and (table.block_table[a] == 0).all()
    check_table(table)
    with pytest.raises(ValueError, match="slot"):
        table.token_slots(a, 0, 1)
    # The slot and the pages are reused.
    c = table.add_request()
    table.ensure_capacity(c, 20)
    assert sorted(table.pages[c]) == sorted(pages)
    check_table(table)


def test_request_table_shared_prefix_pages():
    alloc = PageAllocator(10)
    table = RequestTable(alloc, 4, max_requests=3, max_pages_per_request=4)
    a = table.add_request()
    table.ensure_capacity(a, 8)
    prefix = list(table.pages[a])
    b = table.add_request(shared_pages=prefix)
    assert table.pages[b] == prefix and all(alloc.refcount(p) == 2 for p in prefix)
    table.ensure_capacity(b, 10)
    assert table.pages[b][:2] == prefix and table.pages[b][2] not in prefix
    assert table.free_request(a) == []  # prefix still referenced by b
    assert all(alloc.refcount(p) == 1 for p in prefix)
    b_pages = list(table.pages[b])
    assert sorted(table.free_request(b)) == sorted(b_pages) and len(b_pages) == 3
    assert alloc.num_free == 9
    check_table(table)


def test_request_table_capacity_errors_take_nothing():
    alloc = PageAllocator(6)
    table = RequestTable(alloc, 4, max_requests=2, max_pages_per_request=3)
    a, b = table.add_request(), table.add_request()
    table.ensure_capacity(a, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        table.ensure_capacity(a, 13)
    assert len(table.pages[a]) == 2 and alloc.num_free == 3
    table.ensure_capacity(b, 12)  # takes the last 3 pages
    with pytest.raises(OutOfPagesError):
        table.ensure_capacity(a, 9)
    assert len(table.pages[a]) == 2 and alloc.num_free == 0
    check_table(table)
    with pytest.raises(OutOfPagesError):
        table.add_request()


# ----------------------------------------------------------------------------------------------------
# MLAKVCache
# ----------------------------------------------------------------------------------------------------

def filled_cache(dtype, page_size=4, num_pages=12, kv_dim=576, layers=3, key=()):
    cache = MLAKVCache(num_layers=layers, num_pages=num_pages, page_size=page_size, kv_dim=kv_dim, dtype=dtype)
    g = gen("fill", dtype, page_size, key)
    for buf in cache.buffers:
        buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float64).to(dtype))
    return cache


def slots_across_pages(page_size, num_pages, n, g):
    """n distinct slots off page 0, spread over random pages, crossing page boundaries."""
    all_slots = torch.randperm((num_pages - 1) * page_size, generator=g)[:n] + page_size
    return all_slots.to(torch.int64)


def check_only_rows_changed(cache, before, layer, slots, rows):
    """Rows at ``slots`` of ``layer`` equal ``rows`` (cast to the cache dtype); everything else is as before."""
    for i, (old, new) in enumerate(zip(before, cache.buffers)):
        flat_old, flat_new = old.view(cache.num_slots, -1), new.view(cache.num_slots, -1)
        if i != layer:
            assert digest(old) == digest(new), f"layer {i} changed"
            continue
        mask = torch.zeros(cache.num_slots, dtype=torch.bool)
        mask[slots] = True
        assert digest(flat_old[~mask]) == digest(flat_new[~mask]), "rows outside the written slots changed"
        assert torch.equal(flat_new[slots], rows.reshape(len(slots), -1).to(cache.dtype))


@pytest.mark.parametrize("shape3", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_kv_cache_write_full_rows(page_size, dtype, shape3):
    g = gen("write", page_size, dtype, shape3)
    cache = filled_cache(dtype, page_size, key=("write", shape3))
    slots = slots_across_pages(page_size, 12, min(9, 11 * page_size), g)
    rows = torch.randn(len(slots), 576, generator=g)  # float32 source, cast on write
    if shape3:
        rows = rows[:, None]
    before = [b.clone() for b in cache.buffers]
    cache.write(1, slots, rows)
    check_only_rows_changed(cache, before, 1, slots, rows)


@pytest.mark.parametrize("validate", [True, False])
def test_kv_cache_write_validate_flag_does_not_change_the_write(validate):
    g = gen("write_validate", validate)
    cache = filled_cache(torch.float32, 16, key=("validate",))
    slots = slots_across_pages(16, 12, 20, g)
    rows = torch.randn(20, 576, generator=g)
    before = [b.clone() for b in cache.buffers]
    cache.write(2, slots, rows, validate=validate)
    check_only_rows_changed(cache, before, 2, slots, rows)


@pytest.mark.parametrize("shape3", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_cache_write_split_rows(page_size, dtype, shape3):
    g = gen("write_split", page_size, dtype, shape3)
    cache = filled_cache(dtype, page_size, key=("split", shape3))
    slots = slots_across_pages(page_size, 12, 7, g)
    c_kv = torch.randn(7, 512, generator=g)
    k_pe = torch.randn(7, 64, generator=g)
    before = [b.clone() for b in cache.buffers]
    if shape3:
        cache.write_split(0, slots, c_kv[:, None], k_pe[:, None])
    else:
        cache.write_split(0, slots, c_kv, k_pe)
    check_only_rows_changed(cache, before, 0, slots, torch.cat([c_kv, k_pe], dim=1))


def test_kv_cache_write_split_equals_full_write():
    g = gen("split_vs_full")
    a = filled_cache(torch.bfloat16, 8, key=("svf",))
    b = filled_cache(torch.bfloat16, 8, key=("svf",))
    slots = slots_across_pages(8, 12, 13, g)
    rows = torch.randn(13, 576, generator=g)
    a.write(1, slots, rows)
    b.write_split(1, slots, rows[:, :512], rows[:, 512:])
    assert all(digest(x) == digest(y) for x, y in zip(a.buffers, b.buffers))


def test_kv_cache_empty_write_changes_nothing():
    cache = filled_cache(torch.float32, 4, key=("empty",))
    before = [digest(b) for b in cache.buffers]
    cache.write(0, torch.zeros(0, dtype=torch.int64), torch.randn(0, 576))
    cache.write_split(0, torch.zeros(0, dtype=torch.int64), torch.randn(0, 512), torch.randn(0, 64))
    assert [digest(b) for b in cache.buffers] == before
    assert tuple(cache.gather(0, torch.zeros(0, dtype=torch.int64)).shape) == (0, 576)


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_cache_gather_by_slot_list(page_size):
    g = gen("gather", page_size)
    cache = filled_cache(torch.float32, page_size, key=("gather",))
    slots = torch.randint(0, cache.num_slots, (25,), generator=g)  # any order, repeats allowed
    for layer in range(3):
        got = cache.gather(layer, slots)
        assert tuple(got.shape) == (25, 576)
        flat = cache.buffers[layer].view(cache.num_slots, 576)
        for i, s in enumerate(slots.tolist()):
            assert torch.equal(got[i], flat[s])


def test_kv_cache_paged_view_maps_slots_to_pages():
    cache = filled_cache(torch.float32, 4, key=("view",))
    view = cache.paged_view(1)
    assert tuple(view.shape) == (12, 4, 1, 576)
    assert view.data_ptr() == cache.buffers[1].data_ptr()
    flat = cache.buffers[1].view(cache.num_slots, 576)
    for slot in (0, 3, 4, 17, 47):
        assert torch.equal(view[slot // 4, slot % 4, 0], flat[slot])


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_table_and_decode_end_to_end(page_size):
    """Requests grow through RequestTable, their rows are written through MLAKVCache, and the paged decode
    over ``paged_view`` matches the dense oracle over each request's own history."""
    g = gen("e2e", page_size)
    alloc = PageAllocator(64)
    table = RequestTable(alloc, page_size, max_requests=4, max_pages_per_request=64 // page_size + 8)
    cache = MLAKVCache(num_layers=1, num_pages=64, page_size=page_size, kv_dim=576, dtype=torch.float64)
    cache.buffers[0].fill_(float("nan"))  # nothing unwritten may be read
    reqs = [table.add_request() for _ in range(3)]
    hist = {r: torch.zeros(0, 576, dtype=torch.float64) for r in reqs}
    for step in range(3):
        for r in reqs:
            n_new = int(torch.randint(1, 9, (1,), generator=g))
            start = hist[r].shape[0]
            table.ensure_capacity(r, start + n_new)
            rows = torch.randn(n_new, 576, generator=g, dtype=torch.float64)
            if step % 2:
                cache.write_split(0, table.token_slots(r, start, start + n_new), rows[:, :512], rows[:, 512:])
            else:
                cache.write(0, table.token_slots(r, start, start + n_new), rows)
            hist[r] = torch.cat([hist[r], rows])
        lens = [hist[r].shape[0] for r in reqs]
        bt = table.block_table[reqs]
        got_rows = gather_rows(cache.paged_view(0), bt, lens)
        assert all(torch.equal(x, hist[r]) for x, r in zip(got_rows, reqs))
        q = torch.randn(3, 2, 4, 576, generator=g, dtype=torch.float64)
        seqlens = torch.tensor(lens, dtype=torch.int32)
        meta, splits = pagedmla.get_mla_metadata(seqlens, 8, 1)
        out, lse = pagedmla.flash_mla_with_kvcache(q, cache.paged_view(0), bt, seqlens, 512, meta, splits,
                                                   causal=True, provider="torch")
        ref_out, ref_lse = dense_paged(q.reshape(6, 4, 576), [0, 2, 4, 6], [hist[r] for r in reqs], 576 ** -0.5,
                                       True, 512)
        assert_attention_close(out.reshape(6, 4, 512), lse.transpose(1, 2).reshape(6, 4), ref_out, ref_lse, 1e-10)
    for r in reqs:
        table.free_request(r)
    assert alloc.num_free == 63


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_fp8_cache_quantises_on_write_and_dequantises_on_gather(fmt):
    """Writes store exactly quantize_latent's bytes at their slots (nothing else changes, page 0 included), the
    split write equals the full one, a gather returns the dequantised rows (NaN for a slot outside), and the
    paged view over them decodes to what the oracle decodes from the bytes."""
    from oracle import decode_fp8_rows

    g = gen("fp8_cache", fmt)
    k_scale = 0.02 if fmt == "fp8_e4m3" else None
    cache = MLAKVCache(num_layers=2, num_pages=12, page_size=16, kv_dim=576, dtype=fmt, k_scale=k_scale)
    assert cache.kv_format == fmt and cache.row_width == (656 if fmt == "fp8_ds_mla" else 576)
    assert cache.paged_view(1).shape == (12, 16, 1, cache.row_width)
    for b in cache.buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    before = [b.view(torch.uint8).clone() for b in cache.buffers]
    slots = slots_across_pages(16, 12, 20, g)
    rows = torch.randn(20, 576, generator=g).bfloat16()
    cache.write(1, slots, rows)
    ks = cache.k_scale(1)
    want = pagedmla.quantize_latent(rows, fmt, k_scale=ks).view(torch.uint8)
    flat = cache.buffers[1].view(cache.num_slots, -1).view(torch.uint8)
    assert torch.equal(flat[slots], want)
    mask = torch.ones(cache.num_slots, dtype=torch.bool)
    mask[slots] = False
    assert torch.equal(flat[mask], before[1].view(cache.num_slots, -1)[mask])
    assert torch.equal(cache.buffers[0].view(torch.uint8), before[0])
    cache.write_split(0, slots, rows[:, :512], rows[:, 512:])
    assert torch.equal(cache.buffers[0].view(cache.num_slots, -1).view(torch.uint8)[slots], want)
    got = cache.gather(1, slots, dtype=torch.float64)
    decoded = decode_fp8_rows(want, fmt, None if ks is None else ks.item())
    assert got.dtype == torch.float64 and torch.equal(got, decoded)
    f32 = cache.gather(1, slots)
    assert f32.dtype == torch.float32 and torch.allclose(f32.double(), decoded, rtol=2 ** -24, atol=0)
    bad = cache.gather(1, torch.tensor([cache.num_slots, int(slots[0])]), validate=False)
    assert bad[0].isnan().all() and torch.equal(bad[1], f32[0])
    pages = cache.paged_view(1).view(-1, cache.row_width)
    assert torch.equal(pages.view(torch.uint8)[slots], want)
