"""torch.compile(fullgraph=True) over the public ops and the backend: a small DeepSeek-style attention
block traces without graph breaks through the ``pagedmla::`` custom ops and matches eager, cache writes
included. On CPU with the torch provider, ``eager`` and ``aot_eager`` (the traced graph with functionalised
mutations; inductor's C++ compile is left out of CI for time); on the GPU (``gpu`` mark) with the Triton
provider in bf16 under inductor, as vLLM and SGLang compile their models."""

from __future__ import annotations

import pytest
import torch

import pagedmla
from pagedmla import ForwardBatch, ForwardMode, MLABackend, MLAConfig, MLAKVCache

HEADS, PS, LORA, ROPE, NOPE, VDIM = 4, 4, 512, 64, 128, 128
D = LORA + ROPE
# (device, dtype, provider, torch.compile backend, page size, tolerance of compiled against eager)
SETUPS = [
    pytest.param("cpu", torch.float32, "torch", "eager", PS, 1e-6, id="cpu-eager"),
    pytest.param("cpu", torch.float32, "torch", "aot_eager", PS, 1e-6, id="cpu-aot_eager"),
    pytest.param("cuda", torch.bfloat16, "triton", "inductor", 64, 2e-2, id="gpu-inductor", marks=pytest.mark.gpu),
]


class Block(torch.nn.Module):
    """Latent projection, absorbed decode or MHA prefill through MLABackend, and the public ops around it."""

    def __init__(self, backend: MLABackend, cache: MLAKVCache, g: torch.Generator):
        super().__init__()
        self.backend, self.cache = backend, cache
        self.wq = torch.nn.Parameter(torch.randn(32, HEADS * D, generator=g) / 8)
        self.wkv = torch.nn.Parameter(torch.randn(32, D, generator=g) / 8)
        self.wmha = torch.nn.Parameter(torch.randn(32, HEADS * (2 * (NOPE + ROPE) + VDIM), generator=g) / 8)

    def forward(self, x, loc, decode: bool):
        latent = x @ self.wkv
        if decode:
            q = (x @ self.wq).view(-1, HEADS, D)
            return self.backend.forward(q, latent[:, None], None, 0, loc, self.cache)
        qkv = (x @ self.wmha).view(-1, HEADS, 2 * (NOPE + ROPE) + VDIM)
        q, k, v = qkv.split([NOPE + ROPE, NOPE + ROPE, VDIM], dim=-1)
        return self.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), 0, loc, self.cache,
                                    latent=latent)


def ops_block(q, k_cache, block_table, lens, qv, kv, vv, cu):
    md, ns = pagedmla.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1)
    o, lse = pagedmla.flash_mla_with_kvcache(q, k_cache, block_table, lens, LORA, md, ns, causal=True)
    o2, lse2 = pagedmla.flash_mla_varlen_with_kvcache(q.flatten(0, 1), k_cache, block_table, lens, cu, LORA,
                                                      max_q_len=q.shape[1])
    merged, merged_lse = pagedmla.merge_state(o.flatten(0, 1), lse.transpose(1, 2).flatten(0, 1), o2, lse2)
    ragged, rlse, _ = pagedmla.flash_attn_varlen_func(qv, kv, vv, cu, cu, q.shape[1], q.shape[1], causal=True,
                                                      return_attn_probs=True)
    out_buf = torch.empty_like(ragged)
    pagedmla.flash_attn_varlen_func(qv, kv, vv, cu, cu, q.shape[1], q.shape[1], causal=True, out=out_buf)
    in_place = merged.clone()
    pagedmla.merge_state(in_place, merged_lse.clone(), o2, lse2, out=in_place)
    return merged, merged_lse, ragged, rlse, out_buf, in_place


@pytest.mark.parametrize("device, dtype, provider, backend, page, tol", SETUPS)
def test_public_ops_compile_fullgraph(device, dtype, provider, backend, page, tol, monkeypatch):
    monkeypatch.setenv("PAGEDMLA_PROVIDER", provider)
    g = torch.Generator().manual_seed(6)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    q, k_cache = rnd(2, 3, HEADS, D), rnd(8, page, 1, D)
    block_table = torch.tensor([[3, 1, 5], [2, 7, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([11, 6], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32, device=device)
    qv, kv, vv = rnd(6, 4, 48), rnd(6, 2, 48), rnd(6, 2, 32)
    torch._dynamo.reset()
    compiled = torch.compile(ops_block, fullgraph=True, backend=backend)
    got = compiled(q, k_cache, block_table, lens, qv, kv, vv, cu)
    want = ops_block(q, k_cache, block_table, lens, qv, kv, vv, cu)
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), atol=tol), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("device, dtype, provider, backend, page, tol", SETUPS)
def test_backend_block_compiles_fullgraph_and_matches_eager(device, dtype, provider, backend, page, tol):
    # The MIXED step below runs its decode in the decode kernel and its extend in the varlen kernel.
    cfg = MLAConfig(num_heads=HEADS, page_size=page, dtype=dtype, max_context_len=16 * page, max_batch_size=4,
                    mixed_decode_kernel="decode")
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[0, :4] = torch.tensor([5, 2, 9, 1])
    table[1, :4] = torch.tensor([3, 7, 4, 8])
    table = table.to(device)
    runs = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        be = MLABackend(cfg, device=device, provider=provider)
        cache = MLAKVCache(1, 12, page, D, dtype, device=device)
        cache.buffers[0].zero_()
        block = Block(be, cache, torch.Generator().manual_seed(1)).to(device, dtype)
        fn = block if mode == "eager" else torch.compile(block, fullgraph=True, backend=backend)
        x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        t0, t1 = table[0].long().cpu(), table[1].long().cpu()
        slots = torch.cat([t0[torch.arange(5) // page] * page + torch.arange(5) % page,
                           t1[torch.arange(4) // page] * page + torch.arange(4) % page]).to(device)
        be.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, torch.tensor([0, 1], device=device),
                                              torch.tensor([5, 4], dtype=torch.int32, device=device), table,
                                              [5, 4], [5, 4], [0, 0]))
        with torch.no_grad():  # serving: the custom ops register no backward
            prefill = fn(x, slots, False)
        be.init_forward_metadata(ForwardBatch(ForwardMode.DECODE, torch.tensor([0, 1], device=device),
                                              torch.tensor([6, 5], dtype=torch.int32, device=device), table,
                                              [6, 5]))
        # The decode step's new row goes after the prefill's 5 and 4 tokens.
        loc = torch.tensor([int(t0[5 // page]) * page + 5 % page, int(t1[4 // page]) * page + 4 % page],
                           device=device)
        with torch.no_grad():
            decode = fn(torch.randn(2, 32, generator=torch.Generator().manual_seed(3)).to(device, dtype), loc, True)
        # A MIXED step: request 0 extends by 2 tokens (positions 6, 7), request 1 decodes one (position 5).
        be.init_forward_metadata(ForwardBatch(ForwardMode.MIXED, torch.tensor([0, 1], device=device),
                                              torch.tensor([8, 6], dtype=torch.int32, device=device), table,
                                              [8, 6], [2], [6], num_extends=1))
        assert be.metadata.split_decodes == 1
        loc = torch.tensor([int(t0[p // page]) * page + p % page for p in (6, 7)]
                           + [int(t1[5 // page]) * page + 5 % page], device=device)
        with torch.no_grad():
            mixed = fn(torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).to(device, dtype), loc, True)
        runs[mode] = (prefill, decode, mixed, cache.buffers[0].clone())
    for a, b in zip(runs["eager"], runs["compiled"]):
        assert torch.allclose(a.float(), b.float(), atol=tol), (a.float() - b.float()).abs().max()
    # The compiled run wrote the cache (declared mutation): the decode step's new row is there.
    assert runs["compiled"][3].abs().sum() > 0 and torch.equal(runs["compiled"][3] != 0, runs["eager"][3] != 0)


def test_eager_calls_do_not_enter_the_dispatcher(monkeypatch):
    """Outside tracing the public ops never call the custom ops (their dispatch costs microseconds)."""
    from pagedmla.backend import MLABackend
    from pagedmla.ops import attention

    def boom(*args, **kwargs):
        raise AssertionError("custom op reached from an eager call")

    for name in ("flash_mla_with_kvcache", "flash_mla_varlen_with_kvcache", "varlen_attention",
                 "varlen_attention_out", "merge_state_out", "get_mla_metadata", "cache_write", "cache_gather",
                 "poison_bad_lengths"):
        monkeypatch.setattr(torch.ops.pagedmla, name, boom)
    for owner, name in ((attention, "_traced_varlen"), (attention, "_traced_merge"), (MLABackend, "_traced_decode"),
                        (MLABackend, "_traced_extend")):
        monkeypatch.setattr(owner, name, boom)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 1, 2, D, generator=g)
    lens = torch.tensor([3], dtype=torch.int32)
    md, ns = pagedmla.get_mla_metadata(lens, 2, 1)
    o, lse = pagedmla.flash_mla_with_kvcache(q, torch.randn(2, PS, 1, D, generator=g),
                                             torch.tensor([[1]], dtype=torch.int32), lens, LORA, md, ns)
    pagedmla.merge_state(o[0], lse.transpose(1, 2)[0], o[0], lse.transpose(1, 2)[0])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_traced_cache_ops_guard_slots(backend):
    """The traced forms' cache ops keep the eager guards: a write to a slot outside the layer is dropped and a
    gather from one reads NaN, each setting errors.CACHE_SLOT; the other rows are written and read as given."""
    from pagedmla import errors

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(11)
    buffer = torch.randn(12, 1, D, generator=g)
    rows = torch.randn(3, D, generator=g)
    slots = torch.tensor([7, 12, 2])  # 12: one past the layer's last slot

    def step(buffer, slots, rows):
        torch.ops.pagedmla.cache_write(buffer, slots, rows)
        return torch.ops.pagedmla.cache_gather(buffer, slots)

    expected = buffer.clone()
    expected[7, 0], expected[2, 0] = rows[0], rows[2]
    errors.device_errors("cpu")
    got = torch.compile(step, fullgraph=True, backend=backend)(buffer, slots, rows)
    assert torch.equal(buffer, expected)
    assert torch.equal(got[[0, 2]], rows[[0, 2]]) and got[1].isnan().all()
    assert errors.device_errors("cpu") == errors.CACHE_SLOT
