"""Decode context parallelism in MLABackend: two gloo processes, each holding every other token of the cache
and half the heads, return what one backend over the whole cache with all heads returns, in every forward
mode and form, through the CUDA-graph planning path, and with a bad request (NaN rows, the others intact)."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from pagedmla import MLAConfig, MLAKVCache, PageAllocator, RequestTable
from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend

HEADS, PAGE, DCP = 4, 4, 2
LORA, ROPE, NOPE, VDIM = 512, 64, 128, 128
KV = LORA + ROPE
TOL = 1e-5


class Pair:
    """A one-process backend over the whole cache (all heads) beside this rank's DCP backend (its heads, its
    tokens), sharing one request table whose pages hold PAGE * DCP tokens."""

    def __init__(self, rank: int):
        self.rank = rank
        self.gen = torch.Generator().manual_seed(0)  # the same draws on both ranks
        common = dict(num_heads=HEADS, dtype=torch.float32, max_context_len=256, max_batch_size=8)
        self.configs = {}
        for name, extra in (("auto", {}), ("absorbed", dict(extend_prefix_mode="absorbed")),
                            ("chunked", dict(extend_prefix_mode="chunked", chunked_prefix_capacity=6)),
                            ("verify", dict(num_draft_tokens=3)), ("draft", dict(num_draft_tokens=3, is_draft=True))):
            ref = MLAConfig(page_size=PAGE * DCP, **common, **extra)
            dcp = MLAConfig(page_size=PAGE, attn_tp_size=DCP, dcp_size=DCP, dcp_rank=rank, **common, **extra)
            self.configs[name] = (MLABackend(ref, provider="torch"), MLABackend(dcp, provider="torch"))
        self.heads = slice(rank * HEADS // DCP, (rank + 1) * HEADS // DCP)
        alloc = PageAllocator(48)
        random.Random(0).shuffle(alloc._free)
        self.table = RequestTable(alloc, PAGE * DCP, 8, ref.max_pages_per_request)
        self.ref_cache = MLAKVCache(1, 48, PAGE * DCP, KV, torch.float32)
        self.dcp_cache = MLAKVCache(1, 48, PAGE, KV, torch.float32)
        for cache in (self.ref_cache, self.dcp_cache):
            cache.buffers[0].fill_(float("nan"))
        self.lens: dict[int, int] = {}
        self.w_kv = self.rand(LORA, HEADS, NOPE + VDIM) / LORA ** 0.5

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def add(self, history: int) -> int:
        """A request whose first ``history`` tokens are already cached."""
        slot = self.table.add_request()
        self.table.ensure_capacity(slot, history)
        rows = self.rand(history, KV)
        self.ref_cache.write(0, self.table.token_slots(slot, 0, history), rows)
        self.dcp_cache.write(0, self.dcp_slots(slot, 0, history), rows)
        self.lens[slot] = history
        return slot

    def dcp_slots(self, slot: int, start: int, end: int) -> torch.Tensor:
        """This rank's cache slots of positions start..end-1 (slot 0, the reserved page, for the others')."""
        pages = self.table.pages[slot]
        per_page = PAGE * DCP
        return torch.tensor([pages[p // per_page] * PAGE + p % per_page // DCP if p % DCP == self.rank else 0
                             for p in range(start, end)], dtype=torch.int64)

    def decompress(self, heads: slice):
        def kv_decompress(rows):
            kv = torch.einsum("nc,chd->nhd", rows[:, :LORA], self.w_kv[:, heads])
            k = torch.cat([kv[..., :NOPE], rows[:, None, LORA:].expand(-1, kv.shape[1], -1)], -1)
            return k, kv[..., NOPE:]
        return kv_decompress

    def step(self, config: str, mode: ForwardMode, reqs: list[tuple[int, int]], num_extends: int = 0,
             corrupt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run (slot, new tokens) requests through both backends; returns (one-process output of this rank's
        heads, this rank's DCP output). ``corrupt``: that batch row's device length is made -1."""
        ref_backend, dcp_backend = self.configs[config]
        slots = [s for s, _ in reqs]
        new = [n for _, n in reqs]
        pre = [self.lens[s] for s in slots]
        seq = [p + n for p, n in zip(pre, new)]
        for s, length in zip(slots, seq):
            self.table.ensure_capacity(s, length)
        ref_loc = torch.cat([self.table.token_slots(s, p, q) for s, p, q in zip(slots, pre, seq)])
        dcp_loc = torch.cat([self.dcp_slots(s, p, q) for s, p, q in zip(slots, pre, seq)])
        t = sum(new)
        latent = self.rand(t, KV)
        lens = torch.tensor(seq, dtype=torch.int32)
        if corrupt is not None:
            lens[corrupt] = -1
        extends = len(reqs) if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND) else num_extends
        batch = ForwardBatch(mode, torch.tensor(slots), lens, self.table.block_table, seq_lens_cpu=seq,
                             extend_seq_lens_cpu=new[:extends], extend_prefix_lens_cpu=pre[:extends],
                             num_extends=num_extends)
        ref_backend.init_forward_metadata(batch)
        dcp_backend.init_forward_metadata(batch)
        assert ref_backend.attention_form == dcp_backend.attention_form
        if ref_backend.attention_form == "absorbed":
            q = self.rand(t, HEADS, KV)
            ref = ref_backend.forward(q, latent[:, None], None, 0, ref_loc, self.ref_cache)
            q_rank = q[:, self.heads].contiguous()
            if mode.is_decode_like():  # forward_decode directly, as the SGLang adapter calls it
                got = dcp_backend.forward_decode(q_rank, latent[:, None], None, 0, dcp_loc, self.dcp_cache, len(reqs))
            else:
                got = dcp_backend.forward(q_rank, latent[:, None], None, 0, dcp_loc, self.dcp_cache)
            width = LORA
        else:
            q, k = self.rand(t, HEADS, NOPE + ROPE), self.rand(t, HEADS, NOPE + ROPE)
            v = self.rand(t, HEADS, VDIM)
            ref = ref_backend.forward(q, k, v, 0, ref_loc, self.ref_cache, latent=latent,
                                      kv_decompress=self.decompress(slice(None)))
            h = self.heads
            got = dcp_backend.forward(q[:, h].contiguous(), k[:, h].contiguous(), v[:, h].contiguous(), 0, dcp_loc,
                                      self.dcp_cache, latent=latent, kv_decompress=self.decompress(h))
            width = VDIM
        for s, length in zip(slots, seq):
            self.lens[s] = length
        return ref.view(t, HEADS, width)[:, self.heads].reshape(t, -1), got


def _close(ref: torch.Tensor, got: torch.Tensor) -> float:
    assert got.shape == ref.shape
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    return (ref - got).abs().max().item()


def _every_mode(rank: int, world: int) -> dict[str, float]:
    """Max |DCP - one process| of each mode and form, with the forms the backends chose."""
    pair = Pair(rank)
    a, b, c = pair.add(0), pair.add(0), pair.add(0)
    diffs = {}
    diffs["extend mha"] = _close(*pair.step("auto", ForwardMode.EXTEND, [(a, 13), (b, 6), (c, 1)]))
    for i in range(2):
        diffs[f"decode {i}"] = _close(*pair.step("auto", ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1)]))
    d = pair.add(9)  # an odd history: rank 0 holds one token more than rank 1
    diffs["extend absorbed"] = _close(*pair.step("absorbed", ForwardMode.EXTEND, [(a, 5), (b, 3), (d, 1)]))
    diffs["extend chunked"] = _close(*pair.step("chunked", ForwardMode.EXTEND, [(a, 4), (c, 7), (d, 2)]))
    assert len(pair.configs["chunked"][1].prefix_chunks) > 2  # several loops over the prefixes
    diffs["mixed"] = _close(*pair.step("auto", ForwardMode.MIXED, [(d, 3), (a, 1), (b, 1), (c, 1)], num_extends=1))
    diffs["verify"] = _close(*pair.step("verify", ForwardMode.TARGET_VERIFY, [(a, 3), (b, 3), (c, 3), (d, 3)]))
    diffs["draft extend"] = _close(*pair.step("draft", ForwardMode.DRAFT_EXTEND, [(a, 2), (b, 1), (d, 3)]))
    return diffs


def _graph_and_bad_request(rank: int, world: int) -> dict[str, object]:
    """The CUDA-graph planning path (capture at batch 4, replay 3 real rows) against the eager one-process
    backend, and a request with a bad device length among good ones."""
    pair = Pair(rank)
    slots = [pair.add(n) for n in (17, 4, 30)]
    ref_backend, dcp_backend = pair.configs["verify"]
    dcp_backend.init_cuda_graph_state(4)
    out = {}
    for mode, q_len in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)):
        fill = dcp_backend.get_cuda_graph_seq_len_fill_value()
        dcp_backend.init_forward_metadata_capture_cuda_graph(4, torch.zeros(4, dtype=torch.int64),
                                                             torch.full((4,), fill, dtype=torch.int32), mode)
        pre = [pair.lens[s] for s in slots]
        seq = [p + q_len for p in pre]
        for s, n in zip(slots, seq):
            pair.table.ensure_capacity(s, n)
        dcp_backend.init_forward_metadata_replay_cuda_graph(
            4, torch.tensor(slots), torch.tensor(seq, dtype=torch.int32), mode,
            block_table=pair.table.block_table, raw_bs=3)
        t = 3 * q_len
        latent, q = pair.rand(t, KV), pair.rand(t, HEADS, KV)
        ref_loc = torch.cat([pair.table.token_slots(s, p, n) for s, p, n in zip(slots, pre, seq)])
        dcp_loc = torch.cat([pair.dcp_slots(s, p, n) for s, p, n in zip(slots, pre, seq)])
        pad = torch.zeros(q_len, dtype=torch.int64)  # the padded row writes to the reserved page
        got = dcp_backend.forward(torch.cat([q[:, pair.heads], q.new_zeros(q_len, HEADS // DCP, KV)]),
                                  torch.cat([latent, latent.new_zeros(q_len, KV)])[:, None], None, 0,
                                  torch.cat([dcp_loc, pad]), pair.dcp_cache)[:t]
        ref_backend.init_forward_metadata(ForwardBatch(mode, torch.tensor(slots), torch.tensor(seq, dtype=torch.int32),
                                                       pair.table.block_table, seq_lens_cpu=seq))
        ref = ref_backend.forward(q, latent[:, None], None, 0, ref_loc, pair.ref_cache)
        ref = ref.view(t, HEADS, LORA)[:, pair.heads].reshape(t, -1)
        out[f"graph {mode.value}"] = _close(ref, got)
        for s, n in zip(slots, seq):
            pair.lens[s] = n
    ref, got = pair.step("auto", ForwardMode.DECODE, [(s, 1) for s in slots], corrupt=1)
    out["bad row nan"] = bool(torch.isnan(ref[1]).all() and torch.isnan(got[1]).all())
    out["bad request others"] = max(_close(ref[i:i + 1], got[i:i + 1]) for i in (0, 2))
    return out


@pytest.fixture(scope="module")
def modes():
    return run_ranks(_every_mode)


def test_dcp_matches_one_process_in_every_mode(modes):
    for rank, diffs in enumerate(modes):
        for name, diff in diffs.items():
            assert diff <= TOL, f"rank {rank} {name}: max |DCP - one process| = {diff}"


def test_dcp_graph_path_and_a_bad_request():
    for rank, result in enumerate(run_ranks(_graph_and_bad_request)):
        assert result["graph decode"] <= TOL and result["graph target_verify"] <= TOL, (rank, result)
        assert result["bad row nan"], (rank, result)
        assert result["bad request others"] <= TOL, (rank, result)


def test_dcp_config_errors():
    with pytest.raises(ValueError, match="dcp_size: 2 does not divide attn_tp_size=1"):
        MLAConfig(dcp_size=2)
    with pytest.raises(ValueError, match="dcp_rank"):
        MLAConfig(attn_tp_size=2, dcp_size=2, dcp_rank=2)
    assert MLAConfig(page_size=16, attn_tp_size=4, dcp_size=2).tokens_per_page == 32
    with pytest.raises(ValueError, match="dcp_group: dcp_size=2 needs torch.distributed"):
        MLABackend(MLAConfig(num_heads=4, attn_tp_size=2, dcp_size=2, dtype=torch.float32), provider="torch")


def _validate_all_rank(rank: int, world: int) -> dict[str, str]:
    """PAGEDMLA_VALIDATE=all under DCP 2 (a group whose collectives time out after 20 s, so that a rank left
    waiting fails the case instead of hanging it): what each case raised, or "ok"."""
    from datetime import timedelta

    os.environ["PAGEDMLA_VALIDATE"] = "all"
    group = dist.new_group([0, 1], timeout=timedelta(seconds=20))
    ps, lora, rope = 2, 32, 16
    g = torch.Generator().manual_seed(7)
    w = torch.randn(lora, 1, 32, generator=g)

    def kv_decompress(rows):
        kv = torch.einsum("nc,chd->nhd", rows[:, :lora], w)
        return torch.cat([kv[..., :16], rows[:, None, lora:]], -1), kv[..., 16:]

    def setup(**extra):
        cfg = MLAConfig(num_heads=2, kv_lora_rank=lora, qk_rope_head_dim=rope, qk_nope_head_dim=16, v_head_dim=16,
                        dtype=torch.float32, page_size=ps, attn_tp_size=world, dcp_size=world, dcp_rank=rank,
                        max_context_len=64, max_batch_size=4, **extra)
        table = RequestTable(PageAllocator(16), cfg.tokens_per_page, 4, cfg.max_pages_per_request)
        cache = MLAKVCache(1, 16, ps, lora + rope, torch.float32)
        cache.buffers[0].copy_(torch.randn(cache.buffers[0].shape, generator=g))
        return MLABackend(cfg, provider="torch", dcp_group=group), table, cache

    def attempt(fn) -> str:
        try:
            fn()
            return "ok"
        except ValueError as e:
            return str(e)

    results = {}
    # Request of 8 cached tokens + 1: pages of 4 tokens (2 a rank); a page id of 1000 in column 2, which holds
    # token 8 only, rank 0's. Only rank 0 reads it; rank 1 must not wait in the attention's collectives.
    be, table, cache = setup()
    slot = table.add_request()
    table.ensure_capacity(slot, 9)
    bt = table.block_table.clone()
    bt[slot, 2] = 1000
    batch = ForwardBatch(ForwardMode.DECODE, torch.tensor([slot]), torch.tensor([9], dtype=torch.int32), bt,
                         seq_lens_cpu=[9])
    q, lat = torch.randn(1, 1, lora + rope, generator=g), torch.randn(1, 1, lora + rope, generator=g)
    loc = torch.tensor([table.pages[slot][2] * ps if rank == 0 else 0])
    results["page"] = attempt(lambda: (be.init_forward_metadata(batch), be.forward(q, lat, None, 0, loc, cache)))
    # A slot outside rank 1's cache in its own out_cache_loc (each rank writes its own tokens' slots).
    batch = ForwardBatch(ForwardMode.DECODE, torch.tensor([slot]), torch.tensor([9], dtype=torch.int32),
                         table.block_table, seq_lens_cpu=[9])
    bad_loc = torch.tensor([10 ** 6]) if rank == 1 else loc
    results["slot"] = attempt(lambda: (be.init_forward_metadata(batch), be.forward(q, lat, None, 0, bad_loc, cache)))
    # A clean chunked-prefix EXTEND (12 cached + 4 new tokens): its whole-step page check counts pages of
    # tokens_per_page tokens, not of one rank's page_size.
    be, table, cache = setup(extend_prefix_mode="chunked")
    slot = table.add_request()
    table.ensure_capacity(slot, 16)
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor([slot]), torch.tensor([16], dtype=torch.int32),
                         table.block_table, seq_lens_cpu=[16], extend_seq_lens_cpu=[4], extend_prefix_lens_cpu=[12])
    be.init_forward_metadata(batch)
    assert be.attention_form == "chunked"
    q, k = torch.randn(4, 1, 32, generator=g), torch.randn(4, 1, 32, generator=g)
    v, lat = torch.randn(4, 1, 16, generator=g), torch.randn(4, lora + rope, generator=g)
    pages = table.pages[slot]
    loc = torch.tensor([pages[p // (ps * world)] * ps + p % (ps * world) // world if p % world == rank else 0
                        for p in range(12, 16)])
    results["chunked"] = attempt(lambda: be.forward(q, k, v, 0, loc, cache, latent=lat, kv_decompress=kv_decompress))
    return results


def test_validate_all_fails_on_every_rank_together():
    """PAGEDMLA_VALIDATE=all under decode context parallelism: a bad page id only one rank reads, or a bad slot
    in one rank's own out_cache_loc, raises on that rank naming the argument and on the others naming the
    group, so that no rank waits in a collective for one that raised; a clean chunked-prefix step passes."""
    ranks = run_ranks(_validate_all_rank)
    assert ranks[0]["page"].startswith("block_table: page id 1000")
    assert ranks[1]["page"].startswith("dcp_group: ")
    assert ranks[1]["slot"].startswith("out_cache_loc: ") and ranks[0]["slot"].startswith("dcp_group: ")
    assert ranks[0]["chunked"] == ranks[1]["chunked"] == "ok"


def _bad_page_rank(rank: int, world: int) -> tuple[list[bool], list[bool]]:
    """An absorbed EXTEND of 4 new tokens after 5 cached under DCP 2 (pages of 4 tokens, 2 a rank), clean and
    with a page id outside the cache in column 2, which holds token 8 only: which output rows are NaN."""
    os.environ["PAGEDMLA_VALIDATE"] = "shapes"
    cfg = MLAConfig(num_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                    dtype=torch.float32, page_size=2, attn_tp_size=world, dcp_size=world, dcp_rank=rank,
                    max_context_len=64, max_batch_size=4, extend_prefix_mode="absorbed")
    be = MLABackend(cfg, provider="torch")
    table = RequestTable(PageAllocator(16), cfg.tokens_per_page, 4, cfg.max_pages_per_request)
    cache = MLAKVCache(1, 16, cfg.page_size, 48, torch.float32)
    g = torch.Generator().manual_seed(5)
    cache.buffers[0].copy_(torch.randn(cache.buffers[0].shape, generator=g))
    slot = table.add_request()
    table.ensure_capacity(slot, 9)
    q, lat = torch.randn(4, 1, 48, generator=g), torch.randn(4, 1, 48, generator=g)
    nan_rows = []
    for bad in (False, True):
        bt = table.block_table.clone()
        if bad:
            bt[slot, 2] = 1000
        be.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, torch.tensor([slot]),
                                              torch.tensor([9], dtype=torch.int32), bt, seq_lens_cpu=[9],
                                              extend_seq_lens_cpu=[4], extend_prefix_lens_cpu=[5]))
        out = be.forward(q, lat, None, 0, torch.zeros(4, dtype=torch.int64), cache, save_kv_cache=False)
        nan_rows.append([bool(row.isnan().all()) for row in out])
    return nan_rows[0], nan_rows[1]


def test_bad_page_poisons_every_row_of_its_request():
    """Under DCP each query row is its own one-token request of the local kernel: a bad page id used to poison
    only the rows whose causal window reaches it (here the last), the others passing for data. Every row of
    the request is NaN now, on every rank, as on one rank; the clean step is finite."""
    for clean, bad in run_ranks(_bad_page_rank):
        assert clean == [False] * 4 and bad == [True] * 4


def _capture_after_validated_step_rank(rank: int, world: int) -> str:
    """PAGEDMLA_VALIDATE=all, an eager DECODE step under DCP 2, then a graph's capture planning and a forward as
    inside the capture: host value checks off (``errors.host_value_checks`` is False there) and a read-back
    (``Tensor.item``) failing, as it would; returns what the forward did."""
    from unittest import mock

    from pagedmla import errors

    os.environ["PAGEDMLA_VALIDATE"] = "all"
    cfg = MLAConfig(num_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                    dtype=torch.float32, page_size=2, attn_tp_size=world, dcp_size=world, dcp_rank=rank,
                    max_context_len=64, max_batch_size=4)
    be = MLABackend(cfg, provider="torch")
    table = RequestTable(PageAllocator(16), cfg.tokens_per_page, 4, cfg.max_pages_per_request)
    cache = MLAKVCache(1, 16, cfg.page_size, 48, torch.float32)
    slot = table.add_request()
    table.ensure_capacity(slot, 9)
    q, lat = torch.randn(1, 1, 48), torch.randn(1, 1, 48)
    be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, torch.tensor([slot]),
                                          torch.tensor([9], dtype=torch.int32), table.block_table, seq_lens_cpu=[9]))
    be.forward(q, lat, None, 0, torch.tensor([0]), cache)
    be.init_cuda_graph_state(1)
    be.init_forward_metadata_capture_cuda_graph(1, torch.tensor([slot]), torch.tensor([9], dtype=torch.int32),
                                                ForwardMode.DECODE)

    def no_read_back(self):
        raise RuntimeError("a host read-back inside a CUDA-graph capture")

    with mock.patch.object(errors, "host_value_checks", lambda device: False), \
            mock.patch.object(torch.Tensor, "item", no_read_back):
        be.forward(q, lat, None, 0, torch.tensor([0]), cache)
    return "ok"


def test_validate_all_checks_stay_out_of_a_capture():
    """The group's agreement on PAGEDMLA_VALIDATE=all verdicts reads a flag back: inside a CUDA-graph capture
    (after an eager validated step, whose planning left the checks on) it must not run, on any rank."""
    assert run_ranks(_capture_after_validated_step_rank) == ["ok", "ok"]
