"""Bad values only the device sees (pagedmla.errors): every kernel, fed bad page ids, negative and oversized
lengths, bad index arrays and schedules, stays inside its tensors, gives the bad request NaN rows, leaves
every other request bit-identical to a clean run and sets the error bit; ``PAGEDMLA_VALIDATE`` selects the
host checks that raise the named ValueError instead.

On CPU the Triton kernels run under the interpreter with every load, store and atomic checked against the
launch's tensors (``bounds.checked_accesses``) and the caller's tensors surrounded by sentinel margins
(``bounds.guarded``). fp32 keeps the interpreter exact; the same cases run compiled on the GPU (bf16) in
test_guards_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from bounds import checked_accesses, guarded, margins_intact
from oracle import gen, make_paged_cache

import pagedmla
from pagedmla import errors
from pagedmla.cache import MLAKVCache
from pagedmla.rows import poison_bad_lengths, select_requests

D, DV = 48, 32  # a small MLA geometry the portable kernels take: 32 value columns + 16 rope columns
PAGE = 16


@pytest.fixture
def device_values(monkeypatch):
    """Value checks off on the host (as on CUDA by default): the kernels' guards are what is tested."""
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "shapes")
    errors.device_errors("cpu")  # start from a clear word
    yield
    errors.device_errors("cpu")


def _rows(lse: torch.Tensor, out: torch.Tensor, idx) -> tuple[torch.Tensor, torch.Tensor]:
    return out[idx], lse[idx]


def _decode_case(lens, seed, heads=4, q_len=2):
    g = gen("guards", "decode", seed)
    cache = make_paged_cache(lens, PAGE, D, torch.float32, generator=g, extra_pages=2)
    q = torch.randn(len(lens), q_len, heads, D, generator=g)
    return q, cache.k_cache, cache.block_table


def _decode(q, k_cache, table, lens, parts=None):
    meta, splits = pagedmla.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1, num_sm_parts=parts)
    with checked_accesses() as log:
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, lens, DV, meta, splits, causal=True,
                                                   provider="triton")
    assert log.launches >= 2 and not log.violations, log.violations
    return out, lse


@pytest.mark.parametrize("parts", [1, 3, 8])
@pytest.mark.parametrize("bad", ["page_beyond", "page_negative"])
def test_decode_bad_page_ids(device_values, bad, parts):
    """A page id outside the cache among the pages request 1 reads: request 1 is NaN, the others are
    bit-identical (same lengths, so the same schedule, whether requests are split or not)."""
    lens_list = [70, 90, 33, 129]
    q, k_cache, table = _decode_case(lens_list, 0)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    k_cache, table = guarded(k_cache), guarded(table)
    clean_out, clean_lse = _decode(q, k_cache, table, lens, parts)
    assert errors.device_errors("cpu") == 0 and torch.isfinite(clean_lse).all()
    table[1, 3] = 10 ** 6 if bad == "page_beyond" else -5
    out, lse = _decode(q, k_cache, table, lens, parts)
    assert out[1].isnan().all() and lse[1].isnan().all()
    keep = [0, 2, 3]
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
    assert errors.device_errors("cpu") == errors.BLOCK_TABLE
    assert margins_intact(k_cache, table)


@pytest.mark.parametrize("bad_len, bit", [(-3, errors.NEGATIVE_LENGTH), (10 ** 9, errors.LENGTH_BEYOND_TABLE),
                                          (2 ** 31 - 1, errors.LENGTH_BEYOND_TABLE)])
def test_decode_bad_lengths(device_values, bad_len, bit):
    """A negative length, or one beyond the block-table row (also int32's largest, whose block count the
    schedule must not overflow on): that request is NaN, the loop stays within the row's pages, the others
    are bit-identical to a run where the request is short (one part: every request unsplit either way)."""
    lens_list = [70, 90, 33]
    q, k_cache, table = _decode_case(lens_list, 1)
    k_cache, table = guarded(k_cache), guarded(table)
    clean_out, clean_lse = _decode(q, k_cache, table, torch.tensor(lens_list, dtype=torch.int32), parts=1)
    lens = torch.tensor([70, bad_len, 33], dtype=torch.int32)
    out, lse = _decode(q, k_cache, table, lens, parts=1)
    assert out[1].isnan().all() and lse[1].isnan().all()
    assert torch.equal(out[[0, 2]], clean_out[[0, 2]]) and torch.equal(lse[[0, 2]], clean_lse[[0, 2]])
    assert errors.device_errors("cpu") == bit
    assert margins_intact(k_cache, table)


@pytest.mark.parametrize("bad_len, bit", [(-3, errors.NEGATIVE_LENGTH), (10 ** 9, errors.LENGTH_BEYOND_TABLE)])
def test_decode_bad_lengths_under_a_split_schedule(device_values, bad_len, bit):
    """Under a split schedule (8 parts, planned from every device length) a bad length moves the others' split
    points (README): that request is NaN and the others equal the clean run's to rounding, their pieces merged
    in another order; nothing is read or written outside the tensors."""
    lens_list = [300, 190, 233]
    q, k_cache, table = _decode_case(lens_list, 3)
    k_cache, table = guarded(k_cache), guarded(table)
    clean_out, clean_lse = _decode(q, k_cache, table, torch.tensor(lens_list, dtype=torch.int32), parts=8)
    out, lse = _decode(q, k_cache, table, torch.tensor([300, bad_len, 233], dtype=torch.int32), parts=8)
    assert out[1].isnan().all() and lse[1].isnan().all()
    torch.testing.assert_close(out[[0, 2]], clean_out[[0, 2]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[[0, 2]], clean_lse[[0, 2]], rtol=1e-5, atol=1e-6)
    assert errors.device_errors("cpu") == bit
    assert margins_intact(k_cache, table)


@pytest.mark.parametrize("how", ["other_lengths", "other_parts", "splits_of_other_call"])
def test_decode_schedule_of_other_lengths_poisons_the_call(device_values, how):
    """Metadata and num_splits that get_mla_metadata made for other lengths (or another part count, or a
    num_splits from another call) cannot be trusted for any request: every row is NaN, nothing is read or
    written outside the tensors, and the schedule bit is set."""
    lens_list = [70, 90, 33, 129]
    q, k_cache, table = _decode_case(lens_list, 2)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    rows = q.shape[1] * q.shape[2]
    meta, splits = pagedmla.get_mla_metadata(lens, rows, 1, num_sm_parts=6)
    other = torch.tensor([129, 33, 90, 70], dtype=torch.int32)
    if how == "other_lengths":
        meta, splits = pagedmla.get_mla_metadata(other, rows, 1, num_sm_parts=6)
    elif how == "other_parts":
        meta, _ = pagedmla.get_mla_metadata(lens, rows, 1, num_sm_parts=5)
    else:
        _, splits = pagedmla.get_mla_metadata(lens, rows, 1, num_sm_parts=3)
    with checked_accesses() as log:
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, lens, DV, meta, splits, causal=True,
                                                   provider="triton")
    assert not log.violations, log.violations
    assert out.isnan().all() and lse.isnan().all()
    assert errors.device_errors("cpu") & errors.SCHEDULE


def test_decode_garbage_metadata_stays_in_bounds(device_values):
    """Metadata full of random integers (far outside the batch): nothing outside the tensors, all NaN."""
    lens_list = [70, 90, 33]
    q, k_cache, table = _decode_case(lens_list, 3)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    g = gen("garbage metadata")
    meta = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, 8), dtype=torch.int64, generator=g).to(torch.int32)
    meta[:, 2] = meta[:, 0].abs() % 5  # keep each part's request loop short (the clamps bound it anyway)
    splits = torch.randint(-50, 50, (4,), generator=g).to(torch.int32)
    with checked_accesses() as log:
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, lens, DV, meta, splits, causal=True,
                                                   provider="triton")
    assert not log.violations, log.violations
    assert out.isnan().all() and lse.isnan().all()


def _paged_case(q_lens, kv_lens, seed, heads=3):
    g = gen("guards", "paged", seed)
    cache = make_paged_cache(kv_lens, PAGE, D, torch.float32, generator=g, extra_pages=2)
    q = torch.randn(sum(q_lens), heads, D, generator=g)
    qo = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return q, cache.k_cache, cache.block_table, qo


def _paged(q, k_cache, table, lens, qo):
    with checked_accesses() as log:
        out, lse = pagedmla.flash_mla_varlen_with_kvcache(q, k_cache, table, lens, qo, DV, provider="triton")
    assert log.launches >= 1 and not log.violations, log.violations
    return out, lse


@pytest.mark.parametrize("bad", ["page", "negative", "beyond"])
def test_paged_prefill_bad_request(device_values, bad):
    """Request 1 of a prefill over cached prefixes reads a bad page id, has a negative length or one beyond
    its row: its rows are NaN, every other row bit-identical to a clean run, the bit set."""
    q_lens, kv_lens = [5, 7, 3], [40, 50, 20]
    q, k_cache, table, qo = _paged_case(q_lens, kv_lens, 0)
    k_cache, table = guarded(k_cache), guarded(table)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    clean_out, clean_lse = _paged(q, k_cache, table, lens, qo)
    bit = {"page": errors.BLOCK_TABLE, "negative": errors.NEGATIVE_LENGTH, "beyond": errors.LENGTH_BEYOND_TABLE}[bad]
    if bad == "page":
        table[1, 2] = 10 ** 6
    else:
        lens[1] = -9 if bad == "negative" else 10 ** 8
    out, lse = _paged(q, k_cache, table, lens, qo)
    mine = slice(5, 12)
    assert out[mine].isnan().all() and lse[mine].isnan().all()
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[mine] = False
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
    assert errors.device_errors("cpu") == bit
    assert margins_intact(k_cache, table)


@pytest.mark.parametrize("qo_list", [[0, 5, 3, 15], [0, 5, 12, 14], [1, 5, 12, 15], [0, 5, 12, 99]])
def test_paged_prefill_qo_indptr_not_a_partition(device_values, qo_list):
    """qo_indptr decreasing, ending short of or past the rows, or not starting at 0: no row can be assigned
    to one request, so every row is NaN and nothing is written elsewhere."""
    q, k_cache, table, _ = _paged_case([5, 7, 3], [40, 50, 20], 1)
    out, lse = _paged(q, k_cache, table, torch.tensor([40, 50, 20], dtype=torch.int32),
                      torch.tensor(qo_list, dtype=torch.int32))
    assert out.isnan().all() and lse.isnan().all()
    assert errors.device_errors("cpu") == errors.QUERY_INDPTR


def _varlen(q, k, v, cu_q, cu_k, max_q):
    with checked_accesses() as log:
        out, lse, _ = pagedmla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, 64, causal=True,
                                                      return_attn_probs=True, provider="triton")
    assert log.launches == 1 and not log.violations, log.violations
    return out, lse.T


def _varlen_case(seed, lens=(9, 20, 6), heads=2):
    g = gen("guards", "varlen", seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, heads, 24, generator=g), torch.randn(t, heads, 24, generator=g),
               torch.randn(t, heads, 16, generator=g))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("bad", ["keys_past_end", "keys_negative", "keys_reversed", "longer_than_max"])
def test_varlen_bad_sequence(device_values, bad):
    """A key range outside k (past its end, negative, reversed) or sequence 1's length above max_seqlen_q:
    the sequences concerned get NaN rows, the others are bit-identical to the clean run."""
    q, k, v, cu = _varlen_case(0)
    q, k, v = guarded(q), guarded(k), guarded(v)
    clean_out, clean_lse = _varlen(q, k, v, cu, cu.clone(), 20)
    cu_k, max_q = cu.clone(), 20
    if bad == "keys_past_end":
        cu_k[3] = 10 ** 6
    elif bad == "keys_negative":
        cu_k[0] = -4
    elif bad == "keys_reversed":
        cu_k[3] = cu_k[2] - 1
    else:
        max_q = 19
    bit = errors.MAX_SEQLEN if bad == "longer_than_max" else errors.KEY_INDPTR
    out, lse = _varlen(q, k, v, cu, cu_k, max_q)
    # An entry of cu_seqlens_k ends one sequence's keys and starts the next one's: both can be bad.
    ck = cu_k.tolist()
    bad_seqs = {b for b in range(3) if not 0 <= ck[b] <= ck[b + 1] <= k.shape[0]} or {1}
    assert len(bad_seqs) == 1
    rows = torch.zeros(q.shape[0], dtype=torch.bool)
    for b in bad_seqs:
        rows[int(cu[b]): int(cu[b + 1])] = True
    assert out[rows].isnan().all() and lse[rows].isnan().all()
    assert torch.equal(out[~rows], clean_out[~rows]) and torch.equal(lse[~rows], clean_lse[~rows])
    assert errors.device_errors("cpu") == bit
    assert margins_intact(q, k, v)


@pytest.mark.parametrize("cu_list", [[0, 9, 5, 35], [0, 9, 29, 30], [0, 9, 29, 40], [2, 9, 29, 35]])
def test_varlen_cu_seqlens_q_not_a_partition(device_values, cu_list):
    q, k, v, cu = _varlen_case(1)
    out, lse = _varlen(q, k, v, torch.tensor(cu_list, dtype=torch.int32), cu, 64)
    assert out.isnan().all() and lse.isnan().all()
    assert errors.device_errors("cpu") == errors.QUERY_INDPTR


def test_nan_query_propagates(device_values):
    """A NaN in a query is corruption, never an empty row: its row's output and LSE are NaN (torch and
    Triton alike); the other rows are finite."""
    lens_list = [70, 33]
    q, k_cache, table = _decode_case(lens_list, 4)
    q[1, 0, 2, 5] = float("nan")
    lens = torch.tensor(lens_list, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1, num_sm_parts=3)
    for provider in ("torch", "triton"):
        out, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, table, lens, DV, meta, splits, causal=True,
                                                   provider=provider)
        assert out[1, 0, 2].isnan().all() and lse[1, 2, 0].isnan(), provider
        assert torch.isfinite(lse[0]).all() and torch.isfinite(out[0]).all(), provider


# ---------------------------------------------------------------------------------------------------------
# Row kernels: cache stores and gathers, the backend's request rows
# ---------------------------------------------------------------------------------------------------------

def test_store_rows_drops_bad_slots():
    """A cache store with slots outside the cache writes the good rows only (the Triton kernel under the
    interpreter and MLAKVCache's torch path alike), sets the slot bit, touches nothing else."""
    from pagedmla.kernels.triton.rows import store_rows

    g = gen("store rows")
    buf = guarded(torch.randn(40, 24, generator=g))
    rows = torch.randn(5, 24, generator=g)
    slots = torch.tensor([3, -1, 39, 40, 7], dtype=torch.int64)
    want = buf.clone()
    for r, s in enumerate(slots.tolist()):
        if 0 <= s < 40:
            want[s] = rows[r]
    errors.device_errors("cpu")
    with checked_accesses() as log:
        store_rows(buf, slots, rows)
    assert not log.violations, log.violations
    assert torch.equal(buf, want) and margins_intact(buf)
    assert errors.device_errors("cpu") == errors.CACHE_SLOT


@pytest.mark.parametrize("path", ["triton", "cache"])
def test_gather_rows_nan_for_bad_slots(device_values, path):
    from pagedmla.kernels.triton.rows import gather_rows

    cache = MLAKVCache(1, 4, PAGE, 24, dtype=torch.float32)
    cache.buffers[0].copy_(torch.randn(cache.buffers[0].shape, generator=gen("gather")))
    flat = cache.buffers[0].view(-1, 24)
    slots = torch.tensor([5, 64, -2, 63], dtype=torch.int64)
    with checked_accesses() as log:
        got = gather_rows(flat, slots) if path == "triton" else cache.gather(0, slots, validate=False)
    assert not log.violations
    assert torch.equal(got[[0, 3]], flat[[5, 63]]) and got[[1, 2]].isnan().all()
    assert errors.device_errors("cpu") == errors.CACHE_SLOT


def test_cache_write_drops_bad_slots_on_the_torch_path(device_values):
    cache = MLAKVCache(1, 4, PAGE, 24, dtype=torch.float32)
    cache.buffers[0].fill_(3.0)
    rows = torch.randn(3, 24, generator=gen("write"))
    cache.write(0, torch.tensor([17, 64, 20]), rows, validate=False)
    flat = cache.buffers[0].view(-1, 24)
    assert torch.equal(flat[17], rows[0]) and torch.equal(flat[20], rows[2])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[[17, 20]] = False
    assert (flat[untouched] == 3.0).all()
    assert errors.device_errors("cpu") == errors.CACHE_SLOT


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("out_width", [4, 8])
def test_select_requests_bad_slot_and_length(path, out_width):
    """A request slot outside the block table: page-0 row, length -1 (NaN rows in attention), bit set. Out rows
    narrower than the table (a step reading fewer pages) take its first columns; wider ones (a CUDA graph's
    buffers over an engine's table of 5 columns) take all of them and page 0 after. A length beyond the copied
    pages (4 tokens a page here) becomes one beyond the out rows' pages too, whatever page 0 holds."""
    from pagedmla.kernels.triton.rows import select_requests as kernel

    table = guarded(torch.randint(1, 9, (6, 5), generator=gen("select"), dtype=torch.int64).to(torch.int32))
    index = torch.tensor([2, 6, -1, 0, 4], dtype=torch.int32)
    copied = min(out_width, 5)
    lens = torch.tensor([10, 11, 12, 4 * copied, 4 * copied + 1], dtype=torch.int32)
    out_t = torch.full((5, out_width), -9, dtype=torch.int32)
    out_l = torch.full((5,), -9, dtype=torch.int32)
    errors.device_errors("cpu")
    with checked_accesses() as log:
        (kernel if path == "triton" else select_requests)(table, index, lens, out_t, out_l, 4)
    assert not log.violations
    for i, slot in ((0, 2), (3, 0), (4, 4)):
        assert torch.equal(out_t[i, :copied], table[slot, :copied]) and (out_t[i, copied:] == 0).all()
    assert (out_t[1:3] == 0).all() and out_l.tolist() == [10, -1, -1, 4 * copied, 4 * out_width + 1]
    assert errors.device_errors("cpu") == errors.REQUEST_SLOT and margins_intact(table)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_poison_bad_lengths(path):
    """The MHA forms' length check (the Triton kernel under the interpreter, the backend's torch path): NaN rows
    for the requests whose device length is negative, beyond the capacity or other than the planned one (one of
    them without rows; one with more rows than the kernel's programs per request), every other row untouched,
    each bit set, nothing outside the tensors touched."""
    from pagedmla.kernels.triton.rows import poison_bad_lengths as kernel

    out = guarded(torch.randn(50, 40, generator=gen("poison lengths")))
    clean = out.clone()
    indptr = torch.tensor([0, 3, 5, 45, 45, 50, 50], dtype=torch.int32)
    planned = torch.tensor([7, 20, 43, 2, 12, 0], dtype=torch.int32)
    lens = torch.tensor([7, -1, 49, 3, 12, 0], dtype=torch.int32)
    errors.device_errors("cpu")
    with checked_accesses() as log:
        (kernel if path == "triton" else poison_bad_lengths)(out, indptr, lens, planned, 48, 40)
    assert not log.violations
    bad = torch.zeros(50, dtype=torch.bool)
    bad[3:45] = True
    assert out[bad].isnan().all() and torch.equal(out[~bad], clean[~bad]) and margins_intact(out)
    assert errors.device_errors("cpu") == errors.NEGATIVE_LENGTH | errors.LENGTH_BEYOND_TABLE | errors.PAGE_LAYOUT

# ---------------------------------------------------------------------------------------------------------
# Host checks and the error report
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "all"])
def test_host_checks_raise_the_named_error(monkeypatch, mode):
    """With host value checks (CPU by default, any device with PAGEDMLA_VALIDATE=all) the same bad values
    raise the ValueError naming the argument before any kernel runs."""
    monkeypatch.setenv("PAGEDMLA_VALIDATE", mode)
    lens_list = [70, 90]
    q, k_cache, table = _decode_case(lens_list, 5)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    meta, splits = pagedmla.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1)
    table[1, 2] = 10 ** 6
    with pytest.raises(ValueError, match=r"^block_table: page id 1000000"):
        pagedmla.flash_mla_with_kvcache(q, k_cache, table, lens, DV, meta, splits, provider="triton")
    table[1, 2] = 1
    with pytest.raises(ValueError, match=r"^cache_seqlens: lengths must be >= 0"):
        pagedmla.flash_mla_with_kvcache(q, k_cache, table, torch.tensor([70, -1], dtype=torch.int32), DV, meta,
                                        splits, provider="triton")


def test_validate_mode_is_checked(monkeypatch):
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "sometimes")
    with pytest.raises(ValueError, match="^PAGEDMLA_VALIDATE: expected one of"):
        errors.validate_mode()


def test_device_errors_report_names_the_arguments():
    errors.device_errors("cpu")
    errors.error_word(torch.device("cpu")).fill_(errors.BLOCK_TABLE | errors.SCHEDULE)
    with pytest.raises(errors.DeviceInputError, match=r"^block_table: .*; tile_scheduler_metadata/num_splits: "):
        errors.raise_device_errors("cpu")
    errors.raise_device_errors("cpu")  # cleared by the first report
    assert issubclass(errors.DeviceInputError, ValueError)
