"""MLABackend on the torch provider: every mode against a dense float64 computation over each request's
full history, kept outside the cache (a shadow), with NaN-poisoned unused slots and permuted pages."""

from __future__ import annotations

import contextlib
import hashlib
import random

import pytest
import torch
from oracle import decode_fp8_rows, dense_absorbed, dense_mha

import pagedmla
from pagedmla import MLAConfig, MLAKVCache, PageAllocator, RequestTable, errors
from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend, available_backends, create_backend, register_backend

ROPE = 64
LORA = 512
NOPE = 128
VDIM = 128


class Harness:
    """Backend + cache + allocator + request table, and a float64 shadow of every request's latent rows."""

    def __init__(self, heads=4, page_size=16, num_pages=96, max_context=512, num_draft_tokens=0, is_draft=False,
                 extend_prefix_mode="auto", capacity=32768, seed=0, max_bs=16, device="cpu", dtype=torch.float32,
                 provider="torch", tol=1e-5, disable_ragged=False, kv_cache_dtype=None, kv_cache_scale=None):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.device = torch.device(device)
        self.dtype = dtype
        self.tol = tol
        self.cfg = MLAConfig(num_heads=heads, page_size=page_size, dtype=dtype, max_context_len=max_context,
                             max_batch_size=max_bs, num_draft_tokens=num_draft_tokens, is_draft=is_draft,
                             extend_prefix_mode=extend_prefix_mode, chunked_prefix_capacity=capacity,
                             disable_ragged=disable_ragged, kv_cache_dtype=kv_cache_dtype,
                             kv_cache_scale=kv_cache_scale)
        self.backend = MLABackend(self.cfg, device=device, provider=provider)
        self.cache = MLAKVCache(1, num_pages, page_size, LORA + ROPE, self.cfg.kv_cache_dtype, device,
                                k_scale=self.cfg.kv_cache_scale)
        # NaN in every unused slot (all-0xFF bytes: NaN in every field of the FP8 formats too).
        self.cache.buffers[0].view(torch.uint8).fill_(0xFF)
        self.alloc = PageAllocator(num_pages)
        # Shuffle the free list so that requests get scattered, non-monotone pages.
        self.rng.shuffle(self.alloc._free)
        self.table = RequestTable(self.alloc, page_size, max_bs, self.cfg.max_pages_per_request, device)
        self.hist: dict[int, torch.Tensor] = {}
        self.w_kv = torch.randn(LORA, heads, NOPE + VDIM, generator=self.gen, dtype=torch.float64) / LORA ** 0.5
        self._w_kv = {self.device.type: self.w_kv.to(self.device), "cpu": self.w_kv}  # no copy inside a step

    @property
    def heads(self) -> int:
        return self.cfg.num_local_heads

    def add(self) -> int:
        slot = self.table.add_request()
        self.hist[slot] = torch.zeros(0, LORA + ROPE, dtype=torch.float64)
        return slot

    def remove(self, slot: int) -> None:
        self.table.free_request(slot)
        del self.hist[slot]

    def rand(self, *shape) -> torch.Tensor:
        """float64 values that the run dtype represents exactly, so the oracle sees the kernel's inputs."""
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64).to(self.dtype).double()

    def dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype)

    def decompress(self, rows: torch.Tensor):
        kv = torch.einsum("nc,chd->nhd", rows[:, :LORA].to(torch.float64), self._w_kv[rows.device.type])
        k = torch.cat([kv[..., :NOPE], rows[:, None, LORA:].to(torch.float64).expand(-1, self.heads, -1)], -1)
        return k.to(rows.dtype), kv[..., NOPE:].to(rows.dtype)

    def live_hashes(self, exclude: torch.Tensor) -> dict[int, str]:
        """Hash of each live request's cached rows, leaving out the slots this step writes."""
        skip = set(exclude.tolist())
        flat = self._bytes()
        out = {}
        for slot, hist in self.hist.items():
            slots = [s for s in self.table.token_slots(slot, 0, hist.shape[0]).tolist() if s not in skip]
            out[slot] = hashlib.sha1(flat[slots].cpu().numpy().tobytes()).hexdigest()
        return out

    def _bytes(self) -> torch.Tensor:
        """The layer's rows as bytes [num_slots, row bytes]."""
        return self.cache.buffers[0].view(self.cache.num_slots, -1).view(torch.uint8)

    def stored(self, loc: torch.Tensor) -> torch.Tensor:
        """float64 values the cache holds at slots ``loc`` (FP8 rows decoded from their bytes by the oracle)."""
        rows = self.cache.buffers[0].view(self.cache.num_slots, -1)[loc].cpu()
        fmt = self.cfg.kv_format
        if fmt is None:
            return rows.double()
        return decode_fp8_rows(rows, fmt, self.cache.k_scale(0).item() if fmt == "fp8_e4m3" else None)

    def step(self, mode: ForwardMode, slots: list[int], new: list[int], num_extends: int = 0, form_check=None,
             around=contextlib.nullcontext):
        """Run one step in which request slots[i] appends new[i] tokens; checks output and cache safety.
        ``around()`` is entered for the planning and the forward alone (e.g. a sync-debug mode)."""
        pre = [self.hist[s].shape[0] for s in slots]
        seq = [p + n for p, n in zip(pre, new)]
        locs = []
        for s, p, n in zip(slots, pre, new):
            self.table.ensure_capacity(s, p + n)
            locs.append(self.table.token_slots(s, p, p + n))
        loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=self.device)
        before = self.live_hashes(loc)
        batch = ForwardBatch(mode, torch.tensor(slots, dtype=torch.int64, device=self.device),
                             torch.tensor(seq, dtype=torch.int32, device=self.device),
                             self.table.block_table, seq_lens_cpu=seq,
                             extend_seq_lens_cpu=new[:num_extends] if mode == ForwardMode.MIXED else new,
                             extend_prefix_lens_cpu=pre[:num_extends] if mode == ForwardMode.MIXED else pre,
                             num_extends=num_extends)
        self.backend.init_forward_metadata(batch)  # once outside ``around`` to learn the form
        form = self.backend.attention_form
        if form_check is not None:
            assert form == form_check
        T = sum(new)
        latent = self.rand(T, LORA + ROPE)
        if form == "absorbed":
            q = self.rand(T, self.heads, LORA + ROPE)
            q_dev, lat_dev = self.dev(q), self.dev(latent)[:, None]
            with around():
                self.backend.init_forward_metadata(batch)
                out = self.backend.forward(q_dev, lat_dev, None, 0, loc, self.cache)
            self._append(slots, new, loc)
            out = out.view(T, self.heads, LORA).double().cpu()
            refs = [dense_absorbed(qr, self.hist[s], self.cfg.softmax_scale, True, LORA)[0]
                    for s, qr in zip(slots, q.split(new))]
        else:
            q = self.rand(T, self.heads, NOPE + ROPE)
            k, v = self.decompress(self.dev(latent))
            q_dev, lat_dev = self.dev(q), self.dev(latent)
            with around():
                self.backend.init_forward_metadata(batch)
                out = self.backend.forward(q_dev, k, v, 0, loc, self.cache, latent=lat_dev,
                                           kv_decompress=self.decompress)
            self._append(slots, new, loc)
            out = out.view(T, self.heads, VDIM).double().cpu()
            refs = []
            for s, qr, rows in zip(slots, q.split(new), latent.split(new)):
                # The kernel sees k/v rounded to the run dtype; so does the oracle. The new tokens attend in their
                # MHA form, unquantised; the prefix as the cache holds it.
                full = torch.cat([self.hist[s][: self.hist[s].shape[0] - rows.shape[0]], rows])
                kh, vh = self.decompress(self.dev(full))
                refs.append(dense_mha(qr, kh.double().cpu(), vh.double().cpu(), self.cfg.softmax_scale, True)[0])
        ref = torch.cat(refs) if refs else out
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < self.tol, f"{mode} {form}: relative error {err}"
        after = self.live_hashes(loc)
        assert {s: before[s] for s in before if s in after} == {s: after[s] for s in before if s in after}
        stored = self.dev(latent) if self.cfg.kv_format is None else pagedmla.quantize_latent(
            self.dev(latent), self.cfg.kv_format, k_scale=self.cache.k_scale(0))
        assert torch.equal(self._bytes()[loc], stored.reshape(T, -1).view(torch.uint8))
        return form

    def _append(self, slots: list[int], new: list[int], loc: torch.Tensor) -> None:
        """Each request's shadow grows by the rows the step stored (as the cache holds them)."""
        for s, rows in zip(slots, self.stored(loc).split(new)):
            self.hist[s] = torch.cat([self.hist[s], rows])


@pytest.mark.parametrize("heads", [1, 3, 16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_each_mode_against_dense(heads, page_size):
    h = Harness(heads=heads, page_size=page_size, num_pages=4096 // page_size + 8, num_draft_tokens=3,
                seed=heads * 1000 + page_size)
    lens = [1, page_size - 1 if page_size > 1 else 2, page_size, page_size + 1, h.rng.randint(2, 90)]
    slots = [h.add() for _ in lens]
    assert h.step(ForwardMode.EXTEND, slots, lens) == "mha"
    h.step(ForwardMode.DECODE, slots, [1] * len(slots))
    h.step(ForwardMode.TARGET_VERIFY, slots, [3] * len(slots))
    h.backend.config.extend_prefix_mode = "absorbed"
    assert h.step(ForwardMode.EXTEND, slots, [h.rng.randint(1, 4) for _ in slots]) == "absorbed"
    assert h.backend.metadata.kv_page_indptr is None  # a 16-bit cache is read in place: no page layout
    h.backend.config.extend_prefix_mode = "chunked"
    assert h.step(ForwardMode.EXTEND, slots, [h.rng.randint(1, 4) for _ in slots]) == "chunked"
    h.step(ForwardMode.MIXED, slots, [5, 2, 1, 1, 1], num_extends=2)


@pytest.mark.parametrize("provider,dtype,tol,kv_cache_dtype", [
    ("torch", torch.float32, 1e-5, None), ("triton", torch.float16, 5e-3, None),
    ("torch", torch.float32, 1e-5, "fp8_e4m3"), ("triton", torch.float16, 5e-3, "fp8_ds_mla")])
@pytest.mark.parametrize("kernel", ["decode", "varlen", "auto"])
def test_mixed_steps_split_their_decodes(provider, dtype, tol, kv_cache_dtype, kernel):
    """MIXED steps with mixed_decode_kernel="decode": the trailing decodes run the decode kernel under their
    own schedule and the extends the varlen kernel over qo_indptr of the extends alone; with no extend, or no
    decode, one kernel runs. "varlen" (and "auto" on a CPU) runs one varlen launch for every request. Each
    against the oracle (an FP8 cache: on the rows decoded from its bytes), with the other requests' cache rows
    checked intact."""
    h = Harness(heads=16, page_size=16, num_pages=200, seed=31, dtype=dtype, provider=provider, tol=tol,
                kv_cache_dtype=kv_cache_dtype, kv_cache_scale=6 / 448 if kv_cache_dtype == "fp8_e4m3" else None)
    h.backend.config.mixed_decode_kernel = kernel
    split = kernel == "decode"
    slots = [h.add() for _ in range(5)]
    h.step(ForwardMode.EXTEND, slots, [40, 3, 17, 64, 1])
    for new, n_ext in (([6, 2, 1, 1, 1], 2), ([1, 1, 1, 1, 1], 0), ([3, 5, 2, 4, 7], 5), ([9, 1, 1, 1, 1], 1)):
        h.step(ForwardMode.MIXED, slots, new, num_extends=n_ext)
        meta = h.backend.metadata
        n_dec = len(slots) - n_ext if split else 0
        assert meta.split_decodes == n_dec
        assert (meta.decode_plan is not None) == (n_dec > 0)
        if n_dec:  # the decodes' own rows and lengths, at addresses the decode kernel's bound launch takes
            table, lens = meta.decode_plan[:2]
            assert torch.equal(table, meta.block_table[-n_dec:]) and torch.equal(lens, meta.seq_lens[-n_dec:])
            assert table.data_ptr() % 16 == 0 and lens.data_ptr() % 16 == 0
        assert meta.num_tokens == sum(new)
        assert meta.qo_indptr.tolist() == [sum(new[:i]) for i in range(len(slots) - n_dec + 1)]


def test_decode_tail_rule():
    """mixed_decode_kernel="auto"'s count: 8 decodes of 16384 keys (256 key tiles) or 32 of 4096 (64 key tiles, 2.75
    times the step's 3072 tiles per SM) beside a 512-token chunk at 16 heads (128 row tiles x 8 key tiles) are the
    tail on 132 SMs; 128 of 1024 beside a 2048-token chunk, or 32 of 4096 at 128 heads, are not; the factor
    MIXED_SPLIT_TAIL sits exactly at the boundary."""
    from pagedmla.backend import MIXED_SPLIT_TAIL, decode_tail

    assert decode_tail([512] + [1] * 8, [512] + [16384] * 8, 1, 16, 132)
    assert decode_tail([512] + [1] * 32, [512] + [4096] * 32, 1, 16, 132)
    assert not decode_tail([512] + [1] * 32, [512] + [4096] * 32, 1, 128, 132)
    assert not decode_tail([2048] + [1] * 128, [2048] + [1024] * 128, 1, 16, 132)
    tiles = 128 * 8 + 8 * 256  # the first step's tiles: the chunk's and the decodes'
    sms = -(-MIXED_SPLIT_TAIL * tiles // 256)
    assert decode_tail([512] + [1] * 8, [512] + [16384] * 8, 1, 16, sms)
    assert not decode_tail([512] + [1] * 8, [512] + [16384] * 8, 1, 16, sms - 1)
    assert not decode_tail([4], [4], 1, 16, 132)  # no decode
    assert not decode_tail([1, 1], [0, 0], 0, 16, 132)  # nothing to attend


def test_dequant_split_rule():
    """Over an FP8 cache on sm_90: memory-bound decodes (16 or 32 rows) split off from MIXED_DEQUANT_TOKENS cached
    tokens across them, not below it, and compute-bound ones (64-128 rows) never by this rule."""
    from pagedmla.backend import MIXED_DEQUANT_TOKENS, dequant_split

    half = MIXED_DEQUANT_TOKENS // 2
    assert dequant_split([600, half, half], 1, 16)
    assert dequant_split([600, half, half], 1, 32)
    assert not dequant_split([600, half, half - 1], 1, 16)
    assert not dequant_split([half, half, 1], 1, 16)  # the extend's own tokens do not count
    assert not dequant_split([600, 4 * half, 4 * half], 1, 64)


@pytest.mark.parametrize("provider,page,kv_cache_dtype,splits", [
    ("triton", 64, "fp8_e4m3", True), ("triton", 128, "fp8_ds_mla", True), ("triton", 16, "fp8_e4m3", False),
    ("torch", 64, "fp8_e4m3", False), ("triton", 64, None, False)])
def test_dequant_split_only_where_extends_dequantise_first(monkeypatch, provider, page, kv_cache_dtype, splits):
    """"auto" applies dequant_split only where the one varlen launch would dequantise the step's pages first (the
    triton provider on sm_90, an FP8 cache, pages a multiple of 64 keys): as if on sm_90, 16-row decodes over
    80000 cached tokens split there and nowhere else (no decode is the tail: auto_sms is 0 off CUDA)."""
    monkeypatch.setattr(pagedmla.backend, "sm90_available", lambda device: True)
    cfg = MLAConfig(num_heads=16, page_size=page, dtype=torch.float16, kv_cache_dtype=kv_cache_dtype, num_layers=1,
                    max_batch_size=4, max_context_len=65536)
    backend = MLABackend(cfg, device="cpu", provider=provider)
    assert backend._split_decodes([600, 1, 1], [600, 40000, 40000], 1) == (2 if splits else 0)


def test_auto_splits_where_a_decode_is_the_tail(monkeypatch):
    """mixed_decode_kernel="auto" as on a GPU of 132 SMs (``auto_sms``): a 4-token extend beside two decodes of
    640 keys (10 key tiles each, 21 tiles in all: 10 x 132 >= 2 x 21) splits; the next step on 2 SMs (11 x 2 <
    2 x 23) does not; both against the oracle."""
    h = Harness(heads=16, page_size=16, num_pages=120, max_context=1024, seed=37)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [1, 639, 639])
    for sms, split in ((132, 2), (2, 0)):
        monkeypatch.setattr(pagedmla.backend, "auto_sms", lambda device, sms=sms: sms)
        h.step(ForwardMode.MIXED, slots, [4 if split else 1, 1, 1], num_extends=1)
        assert h.backend.metadata.split_decodes == split


@pytest.mark.parametrize("q_len", [2, 3, 4])
def test_target_verify_uses_configured_draft_tokens(q_len):
    h = Harness(heads=16, num_draft_tokens=q_len, seed=q_len)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [5, 17, 33])
    h.step(ForwardMode.TARGET_VERIFY, slots, [q_len] * 3)
    assert h.backend.metadata.q_len == q_len
    # A q sized for another draft count is rejected instead of silently misread.
    with pytest.raises(ValueError, match="q"):
        h.backend.forward_decode(torch.randn(3 * (q_len + 1), 16, 576), torch.randn(3 * (q_len + 1), 1, 576),
                                 None, 0, torch.zeros(3 * (q_len + 1), dtype=torch.int64), h.cache, 3)


def test_chunked_prefix_uses_token_slots_and_many_loops():
    # A capacity of 24 tokens over 3 extends gives 8-token chunks: a 70-token prefix takes 9 loops.
    h = Harness(heads=4, page_size=16, extend_prefix_mode="chunked", capacity=24, seed=7)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [70, 0, 9])
    h.step(ForwardMode.EXTEND, slots, [6, 4, 3], form_check="chunked")
    chunks = h.backend.prefix_chunks
    assert len(chunks) == 9
    gathered = torch.cat([c.slots for c in chunks])
    for i, s in enumerate(slots):
        prefix = h.hist[s].shape[0] - [6, 4, 3][i]
        expect = h.table.token_slots(s, 0, prefix)
        got = torch.cat([c.slots[c.cu_seqlens[i]:c.cu_seqlens[i + 1]] for c in chunks])
        assert torch.equal(got, expect), "chunk lists must hold token slots, not page ids"
    assert gathered.numel() == 70 + 0 + 9


def test_zero_length_and_idle_batches():
    h = Harness(seed=3)
    h.backend.init_forward_metadata(ForwardBatch(ForwardMode.IDLE, torch.zeros(0, dtype=torch.int64),
                                                 torch.zeros(0, dtype=torch.int32), h.table.block_table))
    out = h.backend.forward_extend(torch.zeros(0, 4, 576), None, None, 0, torch.zeros(0, dtype=torch.int64), h.cache)
    assert out.shape == (0, 4 * 512)
    slots = [h.add() for _ in range(2)]
    # A request with no new tokens inside an extend batch (its prefix is simply cached).
    h.step(ForwardMode.EXTEND, slots, [4, 0])
    h.step(ForwardMode.EXTEND, slots, [0, 6])


def test_sequence_of_steps_with_requests_coming_and_going():
    h = Harness(heads=16, page_size=16, num_pages=40, num_draft_tokens=2, seed=11)
    rng = h.rng
    live: list[int] = []
    used_pages: set[int] = set()
    reused = False
    for step in range(24):
        if len(live) < 4 or rng.random() < 0.3:
            new_slots = [h.add() for _ in range(rng.randint(1, 2))]
            h.step(ForwardMode.EXTEND, new_slots, [rng.randint(1, 40) for _ in new_slots])
            for s in new_slots:
                pages = set(h.table.pages[s])
                reused |= bool(pages & used_pages)
            live += new_slots
        kind = step % 4
        if kind == 2:
            h.step(ForwardMode.TARGET_VERIFY, live, [2] * len(live))
        elif kind == 3 and len(live) > 1:
            h.step(ForwardMode.MIXED, live, [rng.randint(1, 5)] + [1] * (len(live) - 1), num_extends=1)
        else:
            h.step(ForwardMode.DECODE, live, [1] * len(live))
        if len(live) > 3:
            victim = live.pop(rng.randrange(len(live)))
            used_pages |= set(h.table.pages[victim])
            h.remove(victim)
    assert reused, "freed pages were expected to be handed to later requests"
    owned = [p for s in h.table.pages for p in h.table.pages[s]]
    assert len(owned) == len(set(owned)) == h.alloc.num_used


def test_cuda_graph_replay_equals_eager_and_reuses_buffers():
    h = Harness(heads=16, page_size=16, num_pages=64, num_draft_tokens=2, seed=5, max_bs=8)
    slots = [h.add() for _ in range(5)]
    h.step(ForwardMode.EXTEND, slots, [3, 20, 33, 16, 1])
    be = h.backend
    be.init_cuda_graph_state(max_bs=8)
    g = be._graph
    buffers = [g.seq_lens.data_ptr(), g.block_table.data_ptr(), g.tile_scheduler_metadata.data_ptr(),
               g.num_splits.data_ptr()]
    fill = be.get_cuda_graph_seq_len_fill_value()
    be.init_forward_metadata_capture_cuda_graph(8, torch.zeros(8, dtype=torch.int64),
                                                torch.full((8,), fill, dtype=torch.int32), ForwardMode.DECODE)
    be.init_forward_metadata_capture_cuda_graph(4, torch.zeros(4, dtype=torch.int64),
                                                torch.full((4,), fill, dtype=torch.int32), ForwardMode.TARGET_VERIFY)
    for mode, bs, q_len in ((ForwardMode.DECODE, 8, 1), (ForwardMode.TARGET_VERIFY, 4, 2)):
        # Fewer real rows on the second replay: rows that were real before must become padding.
        for real in (slots[:bs], slots[:2]):
            raw = len(real)
            pre = [h.hist[s].shape[0] for s in real]
            seq = [p + q_len for p in pre]
            for s, n in zip(real, seq):
                h.table.ensure_capacity(s, n)
            loc = torch.cat([h.table.token_slots(s, p, p + q_len) for s, p in zip(real, pre)])
            # Padded rows write their rows to slot 0 of the reserved page.
            loc_padded = torch.cat([loc, torch.zeros((bs - raw) * q_len, dtype=torch.int64)])
            q = h.rand(bs * q_len, 16, 576).float()
            lat = h.rand(bs * q_len, 576).float()
            before = h.live_hashes(loc)
            # The engine's block table may be narrower than the graph buffers: copy what it has.
            narrow = h.table.block_table[:, :20].clone()
            be.init_forward_metadata_replay_cuda_graph(bs, torch.tensor(real), torch.tensor(seq, dtype=torch.int32),
                                                       mode, block_table=narrow, raw_bs=raw)
            graph_out = be.forward(q, lat[:, None], None, 0, loc_padded, h.cache)[: raw * q_len]
            assert [g.seq_lens.data_ptr(), g.block_table.data_ptr(), g.tile_scheduler_metadata.data_ptr(),
                    g.num_splits.data_ptr()] == buffers
            assert (g.block_table[raw:bs] == 0).all() and (g.seq_lens[raw:bs] == fill).all()
            after = h.live_hashes(loc)
            assert before == after, "padded rows must not touch live requests' pages"
            eager = ForwardBatch(mode, torch.tensor(real), torch.tensor(seq, dtype=torch.int32), h.table.block_table,
                                 seq_lens_cpu=seq)
            be.init_forward_metadata(eager)
            eager_out = be.forward(q[: raw * q_len], lat[: raw * q_len, None], None, 0, loc, h.cache)
            assert torch.allclose(graph_out, eager_out, rtol=1e-6, atol=1e-6)
            for s, rows in zip(real, lat[: raw * q_len].double().split(q_len)):
                h.hist[s] = torch.cat([h.hist[s], rows])
            ref = torch.cat([dense_absorbed(qr.double(), h.hist[s], h.cfg.softmax_scale, True, LORA)[0]
                             for s, qr in zip(real, q[: raw * q_len].split(q_len))])
            rel = (eager_out.view_as(ref).double() - ref).norm() / ref.norm()
            assert rel < 1e-5


def test_decode_planning_never_synchronises(monkeypatch):
    h = Harness(heads=16, num_draft_tokens=2, seed=9)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [5, 9, 40])
    for s in slots:
        h.table.ensure_capacity(s, h.hist[s].shape[0] + 2)
    seq = torch.tensor([h.hist[s].shape[0] + 2 for s in slots], dtype=torch.int32)
    h.backend.init_cuda_graph_state(4)
    h.backend.init_forward_metadata_capture_cuda_graph(4, torch.zeros(4, dtype=torch.int64),
                                                       torch.ones(4, dtype=torch.int32), ForwardMode.TARGET_VERIFY)

    def no_sync(*args, **kwargs):
        raise AssertionError("host synchronisation during planning")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    batch = ForwardBatch(ForwardMode.TARGET_VERIFY, torch.tensor(slots), seq, h.table.block_table)
    h.backend.init_forward_metadata(batch)
    h.backend.init_forward_metadata_replay_cuda_graph(4, torch.tensor(slots), seq, ForwardMode.TARGET_VERIFY,
                                                      block_table=h.table.block_table, raw_bs=3)


def test_override_num_extends():
    h = Harness(seed=13)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [4, 5, 6])
    pre = [h.hist[s].shape[0] for s in slots]
    seq = [p + n for p, n in zip(pre, [3, 2, 1])]
    batch = ForwardBatch(ForwardMode.MIXED, torch.tensor(slots), torch.tensor(seq, dtype=torch.int32),
                         h.table.block_table, seq_lens_cpu=seq, extend_seq_lens_cpu=[3, 2],
                         extend_prefix_lens_cpu=pre[:2], num_extends=0)
    with h.backend.override_num_extends(2):
        h.backend.init_forward_metadata(batch)
    assert h.backend.metadata.qo_indptr.tolist() == [0, 3, 5, 6]
    with pytest.raises(ValueError, match="extend_seq_lens_cpu"):
        h.backend.init_forward_metadata(batch)


def test_registry_and_construction_errors():
    cfg = MLAConfig(num_heads=8, dtype="float32")
    assert "pagedmla" in available_backends()
    assert isinstance(create_backend("pagedmla", cfg, provider="torch"), MLABackend)

    class Custom(MLABackend):
        pass

    register_backend("custom-test", Custom)
    assert isinstance(create_backend("custom-test", cfg), Custom)
    with pytest.raises(ValueError, match="name"):
        create_backend("nope", cfg)
    with pytest.raises(TypeError, match="cls"):
        register_backend("bad", object)
    with pytest.raises(TypeError, match="config"):
        MLABackend({"num_heads": 8})
    with pytest.raises(ValueError, match="provider"):
        MLABackend(cfg, provider="nonexistent")


def test_plan_rejects_inconsistent_batches():
    h = Harness(seed=17)
    slots = [h.add() for _ in range(2)]
    for s in slots:
        h.table.ensure_capacity(s, 40)
    bt = h.table.block_table
    idx = torch.tensor(slots)
    lens = torch.tensor([10, 40], dtype=torch.int32)
    be = h.backend
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        be.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, idx, lens, bt))
    with pytest.raises(ValueError, match="extend_seq_lens_cpu"):
        be.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, idx, lens, bt, [10, 40], [10, 30], [0, 0]))
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        be.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, idx, lens, bt, [10, 10_000], [10, 10_000], [0, 0]))
    with pytest.raises(ValueError, match="seq_lens"):
        be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, idx, lens.long(), bt))
    with pytest.raises(ValueError, match="TARGET_VERIFY"):
        be.init_forward_metadata(ForwardBatch(ForwardMode.TARGET_VERIFY, idx, lens, bt))
    with pytest.raises(ValueError, match="DRAFT_EXTEND"):
        be.init_forward_metadata(ForwardBatch(ForwardMode.DRAFT_EXTEND, idx, lens, bt, [10, 40], [1, 1]))
    be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, idx, lens, bt))
    with pytest.raises(ValueError, match="q"):
        be.forward_decode(torch.randn(2, 5, 576), torch.randn(2, 1, 576), None, 0,
                          torch.zeros(2, dtype=torch.int64), h.cache, 2)
    with pytest.raises(ValueError, match="bs"):
        be.forward_decode(torch.randn(2, 4, 576), torch.randn(2, 1, 576), None, 0,
                          torch.zeros(2, dtype=torch.int64), h.cache, 3)


def test_draft_extend_on_a_draft_backend():
    h = Harness(heads=8, num_draft_tokens=3, is_draft=True, seed=19)
    slots = [h.add() for _ in range(3)]
    h.step(ForwardMode.EXTEND, slots, [9, 17, 2])
    h.step(ForwardMode.DRAFT_EXTEND, slots, [1, 3, 2])
    h.step(ForwardMode.DECODE, slots, [1, 1, 1])


@pytest.mark.parametrize("heads,page_size", [(3, 16), (16, 1)])
def test_every_mode_on_the_triton_provider(heads, page_size):
    """The backend on pagedmla's own kernels (the Triton interpreter on CPU, fp16; bf16 runs on the GPU)."""
    h = Harness(heads=heads, page_size=page_size, num_pages=600, num_draft_tokens=3, seed=heads + page_size,
                dtype=torch.float16, provider="triton", tol=5e-3)
    slots = [h.add() for _ in range(5)]
    assert h.step(ForwardMode.EXTEND, slots, [1, 15, 16, 17, 40]) == "mha"
    h.step(ForwardMode.DECODE, slots, [1] * 5)
    h.step(ForwardMode.TARGET_VERIFY, slots, [3] * 5)
    h.backend.config.extend_prefix_mode = "absorbed"
    assert h.step(ForwardMode.EXTEND, slots, [3, 1, 2, 0, 5]) == "absorbed"
    h.backend.config.extend_prefix_mode = "chunked"
    h.backend.config.chunked_prefix_capacity = 24
    assert h.step(ForwardMode.EXTEND, slots, [3, 1, 2, 0, 5]) == "chunked"
    h.step(ForwardMode.MIXED, slots, [4, 2, 1, 1, 1], num_extends=2)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED])
def test_batches_with_no_requests(mode):
    h = Harness(seed=23)
    empty_i, empty_l = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    h.backend.init_forward_metadata(ForwardBatch(mode, empty_i, empty_l, h.table.block_table, [], [], []))
    before = h.cache.buffers[0].clone()
    out = h.backend.forward(torch.zeros(0, 4, 576), torch.zeros(0, 1, 576), None, 0, empty_i, h.cache)
    assert out.shape == (0, 4 * 512)
    assert torch.equal(before.isnan(), h.cache.buffers[0].isnan())
    h.cache.write(0, empty_i, torch.zeros(0, 1, 576))


def test_draft_extend_through_forward_decode():
    h = Harness(heads=8, num_draft_tokens=2, is_draft=True, seed=29)
    slots = [h.add() for _ in range(2)]
    h.step(ForwardMode.EXTEND, slots, [7, 3])
    pre = [h.hist[s].shape[0] for s in slots]
    seq = [p + n for p, n in zip(pre, [2, 1])]
    for s, n in zip(slots, seq):
        h.table.ensure_capacity(s, n)
    loc = torch.cat([h.table.token_slots(s, p, n) for s, p, n in zip(slots, pre, seq)])
    batch = ForwardBatch(ForwardMode.DRAFT_EXTEND, torch.tensor(slots), torch.tensor(seq, dtype=torch.int32),
                         h.table.block_table, seq_lens_cpu=seq, extend_seq_lens_cpu=[2, 1])
    h.backend.init_forward_metadata(batch)
    q, lat = h.rand(3, 8, 576), h.rand(3, 576)
    out = h.backend.forward_decode(q.float(), lat.float()[:, None], None, 0, loc, h.cache, 2)
    for s, rows in zip(slots, lat.split([2, 1])):
        h.hist[s] = torch.cat([h.hist[s], rows])
    ref = torch.cat([dense_absorbed(qr, h.hist[s], h.cfg.softmax_scale, True, LORA)[0]
                     for s, qr in zip(slots, q.split([2, 1]))])
    assert ((out.view_as(ref).double() - ref).norm() / ref.norm()) < 1e-5


def test_planning_rejects_more_new_tokens_than_the_sequence_holds():
    h = Harness(heads=8, num_draft_tokens=2, is_draft=True, seed=31)
    slots = [h.add() for _ in range(2)]
    for s in slots:
        h.table.ensure_capacity(s, 8)
    batch = ForwardBatch(ForwardMode.DRAFT_EXTEND, torch.tensor(slots), torch.tensor([2, 5], dtype=torch.int32),
                         h.table.block_table, seq_lens_cpu=[2, 5], extend_seq_lens_cpu=[4, 1])
    with pytest.raises(ValueError, match="extend_seq_lens_cpu"):
        h.backend.init_forward_metadata(batch)


def test_replay_rejects_a_block_table_wider_than_the_graph_buffers():
    h = Harness(seed=37, max_bs=4)
    h.backend.init_cuda_graph_state(4)
    h.backend.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                       torch.ones(2, dtype=torch.int32), ForwardMode.DECODE)
    wide = torch.zeros(4, h.cfg.max_pages_per_request + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        h.backend.init_forward_metadata_replay_cuda_graph(2, torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32),
                                                          ForwardMode.DECODE, block_table=wide)


@pytest.mark.parametrize("bad,named", [("short index", "req_pool_indices"), ("short lens", "seq_lens"),
                                       ("float index", "req_pool_indices"), ("int64 table", "block_table"),
                                       ("1-D table", "block_table"), ("list lens", "seq_lens"),
                                       ("no table rows", "block_table")])
def test_replay_checks_its_tensors(bad, named):
    """Replay planning checks what eager planning does, on the host: a 1-entry req_pool_indices or seq_lens for
    raw_bs 2 would give request 1 request 0's row or length on CPU, and be read past its end on CUDA."""
    h = Harness(seed=38, max_bs=4)
    h.backend.init_cuda_graph_state(4)
    h.backend.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                       torch.ones(2, dtype=torch.int32), ForwardMode.DECODE)
    args = {"req": torch.tensor([0, 1]), "lens": torch.ones(2, dtype=torch.int32),
            "table": torch.zeros(4, 3, dtype=torch.int32)}
    key, value = {"short index": ("req", torch.tensor([0])), "short lens": ("lens", torch.ones(1, dtype=torch.int32)),
                  "float index": ("req", torch.tensor([0.0, 1.0])),
                  "int64 table": ("table", torch.zeros(4, 3, dtype=torch.int64)),
                  "1-D table": ("table", torch.zeros(3, dtype=torch.int32)), "list lens": ("lens", [1, 1]),
                  "no table rows": ("table", torch.zeros(0, 3, dtype=torch.int32))}[bad]
    args[key] = value
    with pytest.raises(ValueError, match=f"^{named}: "):
        h.backend.init_forward_metadata_replay_cuda_graph(2, args["req"], args["lens"], ForwardMode.DECODE,
                                                          block_table=args["table"], raw_bs=2)


@pytest.mark.parametrize("bad,named", [("list index", "batch.req_pool_indices"),
                                       ("0-d index", "batch.req_pool_indices"), ("no table rows", "batch.block_table")])
def test_planning_checks_tensors_before_reading_them(bad, named):
    h = Harness(seed=39, max_bs=4)
    index = {"list index": [0, 1], "0-d index": torch.tensor(0)}.get(bad, torch.tensor([0, 1]))
    table = torch.zeros(0, 3, dtype=torch.int32) if bad == "no table rows" else h.table.block_table
    batch = ForwardBatch(ForwardMode.DECODE, index, torch.ones(2, dtype=torch.int32), table, seq_lens_cpu=[1, 1])
    with pytest.raises(ValueError, match=f"^{named}: "):
        h.backend.init_forward_metadata(batch)
    with pytest.raises(TypeError, match="^batch.forward_mode: "):
        h.backend.init_forward_metadata(ForwardBatch("decode", torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32),
                                                     h.table.block_table))


@pytest.mark.parametrize("provider,dtype", [("torch", torch.float32), ("triton", torch.float16)])
def test_replay_length_beyond_a_narrower_engine_table(monkeypatch, provider, dtype):
    """The graph buffers are wider than the engine's table (2 pages of 8 tokens a request here): a device length
    beyond the engine's row gets NaN rows (and LENGTH_BEYOND_TABLE from the Triton kernels), as it does eagerly,
    instead of attending over the buffers' page-0 columns; the other request equals its clean replay."""
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "shapes")
    h = Harness(heads=2, page_size=8, num_pages=64, max_context=128, seed=40, max_bs=4, provider=provider,
                dtype=dtype, tol=1e-5 if dtype == torch.float32 else 5e-3)
    slots = [h.add(), h.add()]
    h.step(ForwardMode.EXTEND, slots, [15, 10])
    h.cache.store(0, torch.arange(8), h.dev(h.rand(8, LORA + ROPE)))  # page 0 holds finite rows, as in an engine
    be = h.backend
    be.init_cuda_graph_state(max_bs=2)
    be.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                torch.ones(2, dtype=torch.int32), ForwardMode.DECODE)
    seq = [16, 11]
    for s, n in zip(slots, seq):
        h.table.ensure_capacity(s, n)
    loc = torch.cat([h.table.token_slots(s, n - 1, n) for s, n in zip(slots, seq)])
    narrow = h.table.block_table[:, :2].clone()
    q, lat = h.dev(h.rand(2, 2, LORA + ROPE)), h.dev(h.rand(2, 1, LORA + ROPE))

    def replay(lens):
        be.init_forward_metadata_replay_cuda_graph(2, torch.tensor(slots), torch.tensor(lens, dtype=torch.int32),
                                                   ForwardMode.DECODE, block_table=narrow, raw_bs=2)
        return be.forward(q, lat, None, 0, loc, h.cache)

    errors.device_errors("cpu")
    clean = replay(seq)
    assert torch.isfinite(clean).all() and errors.device_errors("cpu") == 0
    out = replay([20, seq[1]])
    assert out[0].isnan().all() and torch.equal(out[1], clean[1])
    assert errors.device_errors("cpu") == (errors.LENGTH_BEYOND_TABLE if provider == "triton" else 0)


@pytest.mark.parametrize("bad", ["cache none", "cache kv_dim", "cache page size", "q dtype", "k dtype",
                                 "decompress width", "decompress dtype", "graph pages", "lens strings",
                                 "lens floats"])
def test_forward_host_mistakes_are_named_errors(bad):
    """Host-side mistakes a caller can make around a step raise the ValueError / TypeError naming the argument,
    not an error from inside torch or a kernel (or silence: a cache of another page size)."""
    h = Harness(heads=2, page_size=16, num_pages=64, seed=41, extend_prefix_mode="chunked")
    slots = [h.add(), h.add()]
    h.step(ForwardMode.EXTEND, slots, [20, 30])
    be = h.backend
    named = {"cache none": (TypeError, "cache"), "cache kv_dim": (ValueError, "cache"),
             "cache page size": (ValueError, "cache"), "q dtype": (ValueError, "q"), "k dtype": (ValueError, "k"),
             "decompress width": (ValueError, r"kv_decompress\(rows\)\[0\]"),
             "decompress dtype": (ValueError, r"kv_decompress\(rows\)\[1\]"),
             "graph pages": (ValueError, "max_pages_per_request"), "lens strings": (ValueError, "seq_lens_cpu"),
             "lens floats": (ValueError, "seq_lens_cpu")}[bad]
    with pytest.raises(named[0], match=f"^{named[1]}: "):
        if bad == "graph pages":
            be.init_cuda_graph_state(2, max_pages_per_request=-1)
        elif bad.startswith("lens"):
            host = ["25", "35"] if bad == "lens strings" else [25.0, 35.0]
            be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, torch.tensor(slots),
                                                  torch.tensor([25, 35], dtype=torch.int32), h.table.block_table,
                                                  seq_lens_cpu=host))
        elif bad.startswith("cache") or bad == "q dtype":
            be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, torch.tensor(slots),
                                                  torch.tensor([21, 31], dtype=torch.int32), h.table.block_table,
                                                  seq_lens_cpu=[21, 31]))
            cache = {"cache none": None, "cache kv_dim": MLAKVCache(1, 64, 16, 512, h.cfg.dtype),
                     "cache page size": MLAKVCache(1, 32, 32, 576, h.cfg.dtype)}.get(bad, h.cache)
            q = h.rand(2, 2, LORA + ROPE).to(torch.float64 if bad == "q dtype" else h.cfg.dtype)
            be.forward(q, h.dev(h.rand(2, 1, LORA + ROPE)), None, 0, torch.tensor([20, 30]), cache)
        else:
            new = [5, 5]
            be.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, torch.tensor(slots),
                                                  torch.tensor([25, 35], dtype=torch.int32), h.table.block_table,
                                                  seq_lens_cpu=[25, 35], extend_seq_lens_cpu=new,
                                                  extend_prefix_lens_cpu=[20, 30]))
            assert be.attention_form == "chunked"
            q, latent = h.dev(h.rand(10, 2, NOPE + ROPE)), h.dev(h.rand(10, LORA + ROPE))
            k, v = h.decompress(latent)
            if bad == "k dtype":
                k = k.double()

            def decompress(rows):
                kc, vc = h.decompress(rows)
                if bad == "decompress width":
                    return kc[..., :100], vc
                return kc, vc.double() if bad == "decompress dtype" else vc

            be.forward(q, k, v, 0, torch.arange(64, 74), h.cache, latent=latent, kv_decompress=decompress)


def test_argument_order_traps_are_type_errors():
    """SGLang-style positional calls must fail loudly, not be read as pagedmla's arguments (issue 23):
    init_cuda_graph_state(max_bs, max_num_tokens) would have taken max_num_tokens as a page count."""
    h = Harness()
    with pytest.raises(TypeError):
        h.backend.init_cuda_graph_state(4, 4096)
    h.backend.init_cuda_graph_state(4, max_pages_per_request=h.cfg.max_pages_per_request)
    h.backend.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                       torch.ones(2, dtype=torch.int32), ForwardMode.DECODE)
    with pytest.raises(TypeError):  # SGLang's replay passes seq_lens_sum, encoder_lens, ... positionally
        h.backend.init_forward_metadata_replay_cuda_graph(2, torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32),
                                                          ForwardMode.DECODE, h.table.block_table)
    with pytest.raises(TypeError):  # save_kv_cache is keyword-only: a sixth positional is SGLang's forward_batch
        h.backend.forward(torch.zeros(2, 4, 576), None, None, 0, torch.zeros(2, dtype=torch.int64), h.cache, True)


def test_ragged_and_uniform_verify():
    """TARGET_VERIFY with per-request token counts (1..num_draft_tokens: drafts cut short) runs the varlen
    kernel over qo_indptr; counts of num_draft_tokens each (or none given) are the uniform verify."""
    h = Harness(heads=8, num_draft_tokens=4, seed=37)
    slots = [h.add() for _ in range(4)]
    h.step(ForwardMode.EXTEND, slots, [5, 17, 33, 2])
    h.step(ForwardMode.TARGET_VERIFY, slots, [1, 4, 2, 3])
    meta = h.backend.metadata
    assert not meta.uniform and meta.qo_indptr.tolist() == [0, 1, 5, 7, 10]
    h.step(ForwardMode.TARGET_VERIFY, slots, [4] * 4)
    assert h.backend.metadata.uniform and h.backend.metadata.q_len == 4
    for bad in ([0, 4, 4, 4], [5, 4, 4, 4]):
        seq = [h.hist[s].shape[0] + n for s, n in zip(slots, bad)]
        batch = ForwardBatch(ForwardMode.TARGET_VERIFY, torch.tensor(slots), torch.tensor(seq, dtype=torch.int32),
                             h.table.block_table, seq_lens_cpu=seq, extend_seq_lens_cpu=bad)
        with pytest.raises(ValueError, match="extend_seq_lens_cpu"):
            h.backend.init_forward_metadata(batch)


def test_disable_ragged_runs_prefill_absorbed():
    """``disable_ragged``: a prefill without a cached prefix in the absorbed form (against the dense oracle);
    the default runs it as ragged MHA."""
    h = Harness(heads=8, seed=41, disable_ragged=True)
    slots = [h.add() for _ in range(3)]
    assert h.step(ForwardMode.EXTEND, slots, [1, 16, 40]) == "absorbed"
    assert h.step(ForwardMode.EXTEND, slots, [3, 2, 1]) == "absorbed"
    ragged = Harness(heads=8, seed=41)
    assert ragged.step(ForwardMode.EXTEND, [ragged.add()], [16]) == "mha"
    with pytest.raises(ValueError, match="disable_ragged"):
        MLAConfig(disable_ragged="yes")


def _replay_against_eager(h, mode, bs, real, new, width):
    """Capture-plan a ``mode`` graph of ``bs`` requests x ``width`` rows, replay-plan it for ``real`` (request
    slots, ``new[i]`` real tokens each, placed last among its rows; the other rows are padding writing
    slot 0), run it, and check the real rows against the eager step and the dense oracle, and that no live
    row outside the step's slots changed."""
    be = h.backend
    fill = be.get_cuda_graph_seq_len_fill_value()
    be.init_forward_metadata_capture_cuda_graph(bs, torch.zeros(bs, dtype=torch.int64),
                                                torch.full((bs,), fill, dtype=torch.int32), mode)
    pre = [h.hist[s].shape[0] for s in real]
    seq = [p + n for p, n in zip(pre, new)]
    for s, n in zip(real, seq):
        h.table.ensure_capacity(s, n)
    locs = [h.table.token_slots(s, p, n) for s, p, n in zip(real, pre, seq)]
    loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64)
    rows = torch.tensor([b * width + width - n + j for b, n in enumerate(new) for j in range(n)], dtype=torch.int64)
    padded_loc = torch.zeros(bs * width, dtype=torch.int64).index_copy_(0, rows, loc)
    q = h.rand(bs * width, h.heads, 576).float()
    lat = h.rand(bs * width, 576).float()
    before = h.live_hashes(loc)
    be.init_forward_metadata_replay_cuda_graph(bs, torch.tensor(real, dtype=torch.int64),
                                               torch.tensor(seq, dtype=torch.int32), mode,
                                               block_table=h.table.block_table, raw_bs=len(real))
    graph_out = be.forward(q, lat[:, None], None, 0, padded_loc, h.cache)
    assert graph_out.shape == (bs * width, h.heads * 512)
    assert before == h.live_hashes(loc), "padding rows must not touch live requests' rows"
    if not real:
        return
    if mode == ForwardMode.DRAFT_EXTEND:
        eager = ForwardBatch(mode, torch.tensor(real), torch.tensor(seq, dtype=torch.int32), h.table.block_table,
                             seq_lens_cpu=seq, extend_seq_lens_cpu=new)
    else:
        eager = ForwardBatch(mode, torch.tensor(real), torch.tensor(seq, dtype=torch.int32), h.table.block_table,
                             seq_lens_cpu=seq)
    be.init_forward_metadata(eager)
    q_real, lat_real = q.index_select(0, rows), lat.index_select(0, rows)
    eager_out = be.forward(q_real, lat_real[:, None], None, 0, loc, h.cache)
    assert torch.allclose(graph_out.index_select(0, rows), eager_out, rtol=1e-6, atol=1e-6)
    h._append(real, new, loc)
    ref = torch.cat([dense_absorbed(qr.double(), h.hist[s], h.cfg.softmax_scale, True, LORA)[0]
                     for s, qr in zip(real, q_real.split(new))])
    assert ((eager_out.view_as(ref).double() - ref).norm() / ref.norm()) < 1e-5


def test_every_graph_mode_replays_equal_to_eager():
    """DECODE and TARGET_VERIFY graphs on a target backend; DRAFT_EXTEND (num_draft_tokens rows per request,
    the accepted tokens last), DECODE and IDLE graphs on a draft backend: replayed equal to the eager step
    (and to the dense oracle), padded rows and requests confined to the reserved page."""
    target = Harness(heads=8, page_size=16, num_pages=64, num_draft_tokens=3, seed=43, max_bs=8)
    slots = [target.add() for _ in range(3)]
    target.step(ForwardMode.EXTEND, slots, [3, 20, 33])
    target.backend.init_cuda_graph_state(max_bs=4)
    _replay_against_eager(target, ForwardMode.DECODE, 4, slots, [1, 1, 1], 1)
    _replay_against_eager(target, ForwardMode.TARGET_VERIFY, 4, slots[:2], [3, 3], 3)
    draft = Harness(heads=8, page_size=16, num_pages=64, num_draft_tokens=3, is_draft=True, seed=47, max_bs=8)
    slots = [draft.add() for _ in range(3)]
    draft.step(ForwardMode.EXTEND, slots, [2, 17, 30])
    draft.backend.init_cuda_graph_state(max_bs=4)
    _replay_against_eager(draft, ForwardMode.DRAFT_EXTEND, 4, slots, [1, 3, 2], 3)
    _replay_against_eager(draft, ForwardMode.DRAFT_EXTEND, 2, slots[1:], [3, 1], 3)
    _replay_against_eager(draft, ForwardMode.DECODE, 4, slots, [1, 1, 1], 1)
    _replay_against_eager(draft, ForwardMode.IDLE, 4, [], [], 1)
    with pytest.raises(ValueError, match="raw_bs"):
        draft.backend.init_forward_metadata_replay_cuda_graph(4, torch.tensor(slots), torch.ones(3, dtype=torch.int32),
                                                              ForwardMode.IDLE, block_table=draft.table.block_table,
                                                              raw_bs=3)
    with pytest.raises(ValueError, match="DRAFT_EXTEND"):
        target.backend.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                                torch.ones(2, dtype=torch.int32),
                                                                ForwardMode.DRAFT_EXTEND)
    with pytest.raises(ValueError, match="forward_mode"):
        target.backend.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                                torch.ones(2, dtype=torch.int32), ForwardMode.EXTEND)


def test_validate_all_refuses_device_lengths_past_the_host_ones(monkeypatch):
    """PAGEDMLA_VALIDATE=all: a device length above its seq_lens_cpu entry (which sizes the plan: the pages an
    FP8 workspace holds among them) is a ValueError naming batch.seq_lens, before any kernel runs."""
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "all")
    h = Harness(heads=2, page_size=16, num_pages=40, seed=3, kv_cache_dtype="fp8_ds_mla")
    slots = [h.add() for _ in range(2)]
    h.step(ForwardMode.EXTEND, slots, [20, 40])
    seq = [h.hist[s].shape[0] + 1 for s in slots]
    device_lens = torch.tensor([seq[0], seq[1] + 5], dtype=torch.int32)  # within the table's 3 pages
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(slots), device_lens, h.table.block_table,
                         seq_lens_cpu=seq, extend_seq_lens_cpu=[1, 1], extend_prefix_lens_cpu=[s - 1 for s in seq])
    with pytest.raises(ValueError, match=r"^batch.seq_lens: request 1 has 46 tokens on the device, more than "
                                         r"seq_lens_cpu's 41"):
        h.backend.init_forward_metadata(batch)



@pytest.mark.parametrize("provider,dtype,traced", [("torch", torch.float32, False), ("triton", torch.float16, False),
                                                   ("torch", torch.float32, True)],
                         ids=["torch", "triton", "torch-compiled"])
@pytest.mark.parametrize("form,bad", [(f, b) for f in ("mha", "chunked")
                                      for b in ("negative", "beyond", "fewer", "more", "slot")] + [("chunked", "page")])
def test_mha_forms_poison_bad_device_values(monkeypatch, provider, dtype, traced, form, bad):
    """The MHA forms attend over the host's lengths, so request 0's device length negative, beyond its block-table
    row or other than seq_lens_cpu (shorter, or longer within the row), or its request slot outside the table
    (length -1), gives its rows NaN and the error bits, request 1's rows bit-identical to the clean step (same
    inputs, right device values), this step's rows stored and every other cache row untouched; so does a prefix
    page id outside the cache in the chunked form. Eager and through torch.compile (the traced forms' custom
    ops: an unguarded index there would raise, or assert on a GPU). PAGEDMLA_VALIDATE=all refuses the batch
    naming the argument (not the page id when traced: that check reads the cache at forward time)."""
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "shapes")
    h = Harness(heads=2, page_size=16, num_pages=64, seed=1, extend_prefix_mode="chunked", provider=provider,
                dtype=dtype, tol=1e-5 if dtype == torch.float32 else 5e-3)
    slots = [h.add() for _ in range(3)]
    if form == "chunked":
        h.step(ForwardMode.EXTEND, slots, [20, 30, 9])
    else:
        h.step(ForwardMode.EXTEND, slots[2:], [9])  # a request outside the step, whose rows must stay
    slots, new = slots[:2], [5, 7]
    pre = [h.hist[s].shape[0] for s in slots]
    seq = [p + n for p, n in zip(pre, new)]
    for s, n in zip(slots, seq):
        h.table.ensure_capacity(s, n)
    loc = torch.cat([h.table.token_slots(s, p, n) for s, p, n in zip(slots, pre, seq)])
    q, latent = h.dev(h.rand(12, h.heads, NOPE + ROPE)), h.dev(h.rand(12, LORA + ROPE))
    k, v = h.decompress(latent)

    torch._dynamo.reset()
    forward = torch.compile(h.backend.forward, backend="eager", fullgraph=True) if traced else h.backend.forward

    def run(device_lens, requests=slots):
        batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(requests), torch.tensor(device_lens, dtype=torch.int32),
                             h.table.block_table, seq_lens_cpu=seq, extend_seq_lens_cpu=new, extend_prefix_lens_cpu=pre)
        h.backend.init_forward_metadata(batch)
        assert h.backend.attention_form == form
        return forward(q, k, v, 0, loc, h.cache, latent=latent, kv_decompress=h.decompress)

    errors.device_errors("cpu")
    before = h._bytes().clone()
    clean = run(seq)
    assert torch.isfinite(clean).all() and errors.device_errors("cpu") == 0
    capacity = h.backend.metadata.block_table.shape[1] * h.cfg.page_size
    wrong, bit = {"negative": (-3, errors.NEGATIVE_LENGTH), "beyond": (capacity + 1, errors.LENGTH_BEYOND_TABLE),
                  "fewer": (seq[0] - 1, errors.PAGE_LAYOUT), "more": (seq[0] + 1, errors.PAGE_LAYOUT),
                  "slot": (seq[0], errors.REQUEST_SLOT | errors.NEGATIVE_LENGTH),
                  "page": (seq[0], errors.CACHE_SLOT)}[bad]
    assert wrong < 0 or (wrong > capacity) == (bad == "beyond")
    args = ([wrong, seq[1]],) + (([10 ** 4, slots[1]],) if bad == "slot" else ())
    if bad == "page":  # request 0's first prefix page (its rows were stored before the step)
        h.table.block_table[slots[0], 0] = h.cache.num_pages + 5
    out = run(*args)
    assert out[:5].isnan().all() and torch.equal(out[5:], clean[5:])
    assert errors.device_errors("cpu") == bit
    # The step's own rows are stored as in the clean step (their slots come from out_cache_loc, not the lengths).
    after = h._bytes()
    kept = torch.ones(after.shape[0], dtype=torch.bool)
    kept[loc] = False
    assert torch.equal(after[kept], before[kept]) and torch.equal(after[loc], latent.view(torch.uint8))
    if bad == "page" and traced:
        return
    monkeypatch.setenv("PAGEDMLA_VALIDATE", "all")
    named = {"slot": r"^batch\.req_pool_indices: ", "page": r"^block_table: "}.get(bad, r"^batch\.seq_lens: ")
    with pytest.raises(ValueError, match=named):
        run(*args)


FP8_CASES = [("fp8_e4m3", "torch", torch.float32), ("fp8_ds_mla", "torch", torch.float32),
             ("fp8_e4m3", "triton", torch.float16), ("fp8_ds_mla", "triton", torch.float16)]


@pytest.mark.parametrize("kv_cache_dtype,provider,dtype", FP8_CASES)
def test_every_mode_with_an_fp8_cache(kv_cache_dtype, provider, dtype):
    """Every form over an FP8 cache (quantised as written, dequantised as read: the oracle attends over the rows
    decoded from the cache's bytes, the new tokens' MHA form unquantised), then CUDA-graph stand-in replays."""
    h = Harness(heads=3, page_size=16, num_pages=600, num_draft_tokens=3, seed=61, dtype=dtype, provider=provider,
                tol=1e-5 if dtype == torch.float32 else 5e-3, kv_cache_dtype=kv_cache_dtype,
                kv_cache_scale=6 / 448 if kv_cache_dtype == "fp8_e4m3" else None)
    slots = [h.add() for _ in range(4)]
    assert h.step(ForwardMode.EXTEND, slots, [1, 15, 17, 40]) == "mha"
    h.step(ForwardMode.DECODE, slots, [1] * 4)
    h.step(ForwardMode.TARGET_VERIFY, slots, [3] * 4)
    h.backend.config.extend_prefix_mode = "absorbed"
    assert h.step(ForwardMode.EXTEND, slots, [3, 1, 0, 5]) == "absorbed"
    # The absorbed step over an FP8 cache planned the pages each request's host length spans (what sizes the
    # Hopper path's dequantised workspace), packed after qo_indptr.
    meta = h.backend.metadata
    spans = [-(-h.hist[s].shape[0] // 16) for s in slots]
    assert meta.kv_page_indptr.tolist() == [0, *torch.tensor(spans).cumsum(0).tolist()]
    assert meta.num_kv_pages == sum(spans) and meta.qo_indptr.tolist() == [0, 3, 4, 4, 9]
    h.backend.config.extend_prefix_mode = "chunked"
    h.backend.config.chunked_prefix_capacity = 24
    assert h.step(ForwardMode.EXTEND, slots, [3, 1, 2, 5]) == "chunked"
    assert h.backend.metadata.kv_page_indptr is None  # the chunked form gathers its rows: no workspace
    h.step(ForwardMode.MIXED, slots, [4, 2, 1, 1], num_extends=2)
    assert h.backend.metadata.num_kv_pages == sum(-(-h.hist[s].shape[0] // 16) for s in slots)
    if dtype == torch.float32:
        h.backend.init_cuda_graph_state(max_bs=4)
        _replay_against_eager(h, ForwardMode.DECODE, 4, slots[:3], [1, 1, 1], 1)
        _replay_against_eager(h, ForwardMode.TARGET_VERIFY, 4, slots, [3] * 4, 3)


def test_cache_checks_read_the_forwarded_layer():
    """A pipeline stage's cache view holds only its own layers (SGLang's pool indexes layer - start_layer): the
    backend's cache check reads the layer being run, never layer 0."""
    h = Harness(heads=2, page_size=16, num_pages=64, seed=42)
    slots = [h.add()]
    h.step(ForwardMode.EXTEND, slots, [20])

    class Stage:
        page_size, kv_dim, kv_format = h.cache.page_size, h.cache.kv_dim, None

        def layer(self, layer_id):
            if layer_id != 3:
                raise IndexError(f"layer {layer_id} is not on this stage")
            return h.cache.layer(0)

        def paged_view(self, layer_id):
            self.layer(layer_id)
            return h.cache.paged_view(0)

        def k_scale(self, layer_id):
            return None

    h.backend.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, torch.tensor(slots),
                                                 torch.tensor([20], dtype=torch.int32), h.table.block_table,
                                                 seq_lens_cpu=[20]))
    q = h.dev(h.rand(1, 2, LORA + ROPE))  # attends over the 20 stored rows; the step stores nothing
    out = h.backend.forward(q, None, None, 3, torch.tensor([19]), Stage(), save_kv_cache=False)
    assert torch.isfinite(out).all()
