"""pagedmla.sglang: SGLang's AttentionBackend calls over MLABackend, driven the way SGLang's model runner and
DeepSeek model call a backend (prefill -> extend with prefix -> decode -> verify -> CUDA-graph replay), with
stand-ins of SGLang's ForwardMode / ForwardBatch / token_to_kv_pool / RadixAttention, against MLABackend
driven natively over an identical cache."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest
import torch

from pagedmla import ForwardBatch, ForwardMode, MLABackend, MLAConfig, MLAKVCache
from pagedmla.sglang import SGLangMLABackend, mixed_extends

HEADS, PS, LORA, ROPE = 4, 4, 512, 64
D = LORA + ROPE
NUM_PAGES, MAX_CTX, MAX_REQS, DRAFT = 24, 32, 4, 2


class SgMode(enum.IntEnum):
    """Stand-in of SGLang's ForwardMode: its predicate methods, with is_extend() true for the extend family."""
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6

    def is_extend(self):
        return self in (SgMode.EXTEND, SgMode.MIXED, SgMode.DRAFT_EXTEND, SgMode.TARGET_VERIFY)

    def is_decode(self):
        return self == SgMode.DECODE

    def is_mixed(self):
        return self == SgMode.MIXED

    def is_idle(self):
        return self == SgMode.IDLE

    def is_target_verify(self):
        return self == SgMode.TARGET_VERIFY

    def is_draft_extend(self):
        return self == SgMode.DRAFT_EXTEND


class Pool:
    """Stand-in of SGLang's MLATokenToKVPool: one [num_slots, 1, 576] buffer per layer."""

    def __init__(self):
        self.buf = [torch.full((NUM_PAGES * PS, 1, D), float("nan"))]

    def get_key_buffer(self, layer_id):
        return self.buf[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.buf[layer.layer_id][loc] = cache_k.reshape(-1, 1, D)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        self.buf[layer.layer_id][loc] = torch.cat([cache_k_nope, cache_k_rope], -1).reshape(-1, 1, D)


@dataclass
class Layer:
    """Stand-in of RadixAttention (the attributes backends read)."""
    layer_id: int = 0
    tp_q_head_num: int = HEADS
    head_dim: int = D
    v_head_dim: int = LORA
    scaling: float = 0.1


@dataclass
class SgBatch:
    """Stand-in of SGLang's ForwardBatch."""
    forward_mode: SgMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    token_to_kv_pool: Pool
    extend_seq_lens_cpu: list | None = None
    extend_prefix_lens_cpu: list | None = None
    spec_info: object = None


class World:
    def __init__(self):
        self.g = torch.Generator().manual_seed(23)
        self.cfg = MLAConfig(num_heads=HEADS, page_size=PS, dtype=torch.float32, max_context_len=MAX_CTX,
                             max_batch_size=MAX_REQS, num_draft_tokens=DRAFT, extend_prefix_mode="absorbed")
        self.native = MLABackend(self.cfg, provider="torch")
        self.cache = MLAKVCache(1, NUM_PAGES, PS, D, torch.float32)
        self.cache.buffers[0].fill_(float("nan"))
        self.pool = Pool()
        pages = (torch.randperm(NUM_PAGES - 1, generator=self.g) + 1).tolist()
        per_req = MAX_CTX // PS
        self.block_table = torch.zeros(MAX_REQS, per_req, dtype=torch.int32)
        req_to_token = torch.zeros(MAX_REQS, MAX_CTX, dtype=torch.int32)
        for r in (1, 3):  # SGLang request slots 1 and 3 are live; slot 0 rows point at page 0
            mine, pages = pages[:5], pages[5:]
            self.block_table[r, :5] = torch.tensor(mine, dtype=torch.int32)
            pos = torch.arange(5 * PS)
            req_to_token[r, : 5 * PS] = (torch.tensor(mine)[pos // PS] * PS + pos % PS).to(torch.int32)
        self.req_to_token = req_to_token
        self.adapter = SGLangMLABackend(MLABackend(self.cfg, provider="torch"), req_to_token)
        self.rpi = torch.tensor([1, 3])
        self.lens = [0, 0]

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def locs(self, new):
        return torch.cat([self.req_to_token[r, L:L + n].long() for r, L, n in zip(self.rpi.tolist(), self.lens, new)])

    def batch(self, mode, new, prefix=None):
        seq = [L + n for L, n in zip(self.lens, new)]
        sg_seq = self.lens if mode == SgMode.TARGET_VERIFY else seq  # SGLang's verify lengths exclude drafts
        sg = SgBatch(mode, 2, self.rpi, torch.tensor(sg_seq, dtype=torch.int32), torch.tensor(sg_seq),
                     self.locs(new), self.pool, list(new), prefix)
        native_mode = {SgMode.EXTEND: ForwardMode.EXTEND, SgMode.DECODE: ForwardMode.DECODE,
                       SgMode.TARGET_VERIFY: ForwardMode.TARGET_VERIFY, SgMode.MIXED: ForwardMode.MIXED}[mode]
        # A native MIXED batch declares its extends (here the requests before the one-token ones).
        n_ext = sum(1 for n in new if n != 1) if mode == SgMode.MIXED else len(new)
        nb = ForwardBatch(native_mode, self.rpi, torch.tensor(seq, dtype=torch.int32), self.block_table, seq,
                          list(new)[:n_ext], None if prefix is None else list(prefix)[:n_ext], num_extends=n_ext)
        return sg, nb, seq


def test_sglang_call_sequence_matches_mla_backend():
    w = World()
    layer = Layer()

    # 1. Prefill without prefix: SGLang's DeepSeek writes the latent rows itself, then calls the MHA form.
    sg, nb, seq = w.batch(SgMode.EXTEND, [5, 7], [0, 0])
    w.adapter.init_forward_metadata(sg)
    w.native.init_forward_metadata(nb)
    q, k, v, latent = w.rand(12, HEADS, 192), w.rand(12, HEADS, 192), w.rand(12, HEADS, 128), w.rand(12, D)
    w.pool.set_kv_buffer(layer, sg.out_cache_loc, latent[:, None], None)
    got = w.adapter.forward(q, k, v, layer, sg, save_kv_cache=False)
    want = w.native.forward(q, k, v, 0, sg.out_cache_loc, w.cache, latent=latent)
    assert w.adapter.backend.attention_form == "mha" and got.shape == (12, HEADS * 128)
    assert torch.allclose(got, want, atol=1e-6)
    w.lens = seq

    # 2. Extend over the cached prefix (absorbed), q / k given as nope + rope parts (set_mla_kv_buffer).
    sg, nb, seq = w.batch(SgMode.EXTEND, [3, 2], list(w.lens))
    w.adapter.init_forward_metadata(sg)
    w.native.init_forward_metadata(nb)
    q, lat = w.rand(5, HEADS, D), w.rand(5, 1, D)
    got = w.adapter.forward_extend(q[..., :LORA], lat[..., :LORA], lat[..., :LORA], layer, sg, True,
                                   q_rope=q[..., LORA:], k_rope=lat[..., LORA:])
    want = w.native.forward(q, lat, None, 0, sg.out_cache_loc, w.cache)
    assert w.adapter.backend.attention_form == "absorbed" and torch.allclose(got, want, atol=1e-6)
    w.lens = seq

    # 3. Decode: q 576, k the new latent row, v its first 512 columns (set_kv_buffer).
    sg, nb, seq = w.batch(SgMode.DECODE, [1, 1])
    w.adapter.init_forward_metadata(sg)
    w.native.init_forward_metadata(nb)
    q, lat = w.rand(2, HEADS, D), w.rand(2, 1, D)
    got = w.adapter.forward(q, lat, lat[..., :LORA], layer, sg)
    want = w.native.forward(q, lat, None, 0, sg.out_cache_loc, w.cache)
    assert torch.allclose(got, want, atol=1e-6)
    w.lens = seq

    # 3b. MIXED: request 1's chunk of 3 tokens, request 3's decode after it; the adapter declares the trailing
    #     one-token request a decode, which runs in the decode kernel here.
    w.cfg.mixed_decode_kernel = "decode"
    sg, nb, seq = w.batch(SgMode.MIXED, [3, 1], list(w.lens))
    w.adapter.init_forward_metadata(sg)
    w.native.init_forward_metadata(nb)
    assert w.adapter.backend.metadata.split_decodes == 1 and w.native.metadata.split_decodes == 1
    q, lat = w.rand(4, HEADS, D), w.rand(4, 1, D)
    got = w.adapter.forward(q, lat, lat[..., :LORA], layer, sg)
    want = w.native.forward(q, lat, None, 0, sg.out_cache_loc, w.cache)
    assert torch.allclose(got, want, atol=1e-6)
    w.cfg.mixed_decode_kernel = "auto"
    w.lens = seq

    # 4. Verify: SGLang's seq_lens exclude the drafts; SGLang routes verify through forward_extend.
    sg, nb, seq = w.batch(SgMode.TARGET_VERIFY, [DRAFT, DRAFT])
    w.adapter.init_forward_metadata(sg)
    w.native.init_forward_metadata(nb)
    q, lat = w.rand(2 * DRAFT, HEADS, D), w.rand(2 * DRAFT, 1, D)
    got = w.adapter.forward(q, lat, lat[..., :LORA], layer, sg)
    want = w.native.forward(q, lat, None, 0, sg.out_cache_loc, w.cache)
    assert torch.allclose(got, want, atol=1e-6)
    # (drafts rejected: the lengths stay, the next decode overwrites those slots)

    # 5. CUDA graph: state, capture planning for 4 rows, replay with 2 real + 2 padded rows (run eagerly
    #    on CPU: the capture itself is the only part a CPU cannot do).
    w.adapter.init_cuda_graph_state(4, 4 * DRAFT)
    assert w.adapter.backend._graph.block_table.shape == (4, MAX_CTX // PS)  # not max_num_tokens pages
    fill = w.adapter.get_cuda_graph_seq_len_fill_value()
    w.adapter.init_forward_metadata_capture_cuda_graph(4, 4, torch.zeros(4, dtype=torch.int64),
                                                       torch.full((4,), fill, dtype=torch.int32), None,
                                                       SgMode.DECODE, None)
    sg, nb, seq = w.batch(SgMode.DECODE, [1, 1])
    rpi_pad = torch.tensor([1, 3, 0, 0])
    seq_pad = torch.tensor(seq + [fill, fill], dtype=torch.int32)
    w.adapter.init_forward_metadata_replay_cuda_graph(4, rpi_pad, seq_pad, int(seq_pad.sum()), None, SgMode.DECODE,
                                                      None, seq_pad.clone())
    q, lat = w.rand(4, HEADS, D), w.rand(4, 1, D)
    loc_pad = torch.cat([sg.out_cache_loc, torch.zeros(2, dtype=torch.int64)])
    sg_pad = SgBatch(SgMode.DECODE, 4, rpi_pad, seq_pad, seq_pad, loc_pad, w.pool)
    got = w.adapter.forward_decode(q, lat, lat[..., :LORA], layer, sg_pad)[:2]
    w.native.init_forward_metadata(nb)
    want = w.native.forward(q[:2], lat[:2], None, 0, sg.out_cache_loc, w.cache)
    assert torch.allclose(got, want, atol=1e-6)
    # Both caches hold the same rows wherever a live request has one.
    live = torch.cat([w.req_to_token[r, :L].long() for r, L in zip([1, 3], seq)])
    assert torch.equal(w.pool.buf[0][live], w.cache.buffers[0][live])


def test_mixed_batches_declare_their_trailing_decodes():
    assert [mixed_extends(x) for x in ([5, 2, 1, 1], [1, 1], [4, 1, 3], [7], [])] == [2, 0, 3, 1, 0]
    assert mixed_extends(torch.tensor([9, 1])) == 1


def test_adapter_rejects_what_sglang_cannot_drive():
    cfg = MLAConfig(num_heads=HEADS, page_size=PS, dtype=torch.float32, max_context_len=MAX_CTX,
                    max_batch_size=MAX_REQS)
    with pytest.raises(ValueError, match="extend_prefix_mode"):
        SGLangMLABackend(MLABackend(cfg, provider="torch"), torch.zeros(2, 8, dtype=torch.int32))
    w = World()
    with pytest.raises(ValueError, match="req_to_token"):
        SGLangMLABackend(w.native, torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        w.adapter.init_forward_metadata_replay_cuda_graph(1, torch.zeros(1, dtype=torch.int64),
                                                          torch.ones(1, dtype=torch.int32), 1, None, SgMode.DECODE,
                                                          None, None)
    sg, _, _ = w.batch(SgMode.EXTEND, [2, 3], [0, 0])
    w.adapter.init_forward_metadata(sg)
    with pytest.raises(ValueError, match="save_kv_cache"):
        w.adapter.forward(w.rand(5, HEADS, 192), w.rand(5, HEADS, 192), w.rand(5, HEADS, 128), Layer(), sg)
