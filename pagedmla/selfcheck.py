"""Self-check: every backend mode on the embedded default MLA geometry against dense float64 attention.

Runs a short life of a few requests through cache + allocator + backend (prefill without prefix,
prefill over a cached prefix in both forms, decode, speculative verify, and one MIXED step holding
prefills with and without prefix, a verify-sized request and decodes), and prints for each step the
relative error against a dense float64 computation over each request's full history (kept outside the
cache) and the time the step's attention took. ``python -m pagedmla.selfcheck [--device cuda]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend
from pagedmla.cache import MLAKVCache, PageAllocator, RequestTable
from pagedmla.config import MLAConfig

# The embedded default: DeepSeek-V3's MLA dims, 16 local heads (128 heads at tensor parallel 8).
DEFAULT = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               page_size=16, max_context_len=1024, max_batch_size=16, num_draft_tokens=4)


def _dense(q, keys, values, scale):
    """Bottom-right causal attention of q [n, H, Dk] over keys [L, H|1, Dk] / values [L, H|1, Dv], float64."""
    n, length = q.shape[0], keys.shape[0]
    scores = torch.einsum("nhd,lhd->hnl", q, keys.expand(-1, q.shape[1], -1)) * scale
    visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, values.expand(-1, q.shape[1], -1))


class _Run:
    def __init__(self, device: torch.device, dtype: torch.dtype, provider: str | None, seed: int = 0):
        self.cfg = MLAConfig(dtype=dtype, **DEFAULT)
        self.device = device
        self.backend = MLABackend(self.cfg, device=device, provider=provider)
        pages = 256
        self.cache = MLAKVCache(1, pages, self.cfg.page_size, self.cfg.kv_dim, dtype, device)
        self.cache.buffers[0].fill_(float("nan"))
        alloc = PageAllocator(pages)
        random.Random(seed).shuffle(alloc._free)
        self.table = RequestTable(alloc, self.cfg.page_size, 16, self.cfg.max_pages_per_request, device)
        self.gen = torch.Generator().manual_seed(seed)
        h, c = self.cfg.num_local_heads, self.cfg.kv_lora_rank
        self.w_kv = torch.randn(c, h, self.cfg.qk_nope_head_dim + self.cfg.v_head_dim, generator=self.gen,
                                dtype=torch.float64) / c ** 0.5
        self.hist: dict[int, torch.Tensor] = {}

    def rand(self, *shape):
        # Values representable in the run dtype, so that the float64 reference sees the same inputs.
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64).to(self.cfg.dtype).double()

    def decompress(self, rows):
        c = self.cfg.kv_lora_rank
        kv = torch.einsum("nc,chd->nhd", rows[:, :c].double(), self.w_kv.to(rows.device))
        nope = self.cfg.qk_nope_head_dim
        k = torch.cat([kv[..., :nope], rows[:, None, c:].double().expand(-1, kv.shape[1], -1)], -1)
        return k.to(rows.dtype), kv[..., nope:].to(rows.dtype)

    def step(self, mode, slots, new, num_extends=0):
        cfg, dev = self.cfg, self.device
        for s in slots:
            self.hist.setdefault(s, torch.zeros(0, cfg.kv_dim, dtype=torch.float64))
        pre = [self.hist[s].shape[0] for s in slots]
        seq = [p + n for p, n in zip(pre, new)]
        locs = []
        for s, p, n in zip(slots, pre, new):
            self.table.ensure_capacity(s, p + n)
            locs.append(self.table.token_slots(s, p, p + n))
        loc = torch.cat(locs)
        mixed = mode == ForwardMode.MIXED
        batch = ForwardBatch(mode, torch.tensor(slots, device=dev), torch.tensor(seq, dtype=torch.int32, device=dev),
                             self.table.block_table, seq_lens_cpu=seq,
                             extend_seq_lens_cpu=new[:num_extends] if mixed else new,
                             extend_prefix_lens_cpu=pre[:num_extends] if mixed else pre, num_extends=num_extends)
        t = sum(new)
        h = cfg.num_local_heads
        latent = self.rand(t, cfg.kv_dim)
        for s, rows in zip(slots, latent.split(new)):
            self.hist[s] = torch.cat([self.hist[s], rows])
        start = time.perf_counter()
        self.backend.init_forward_metadata(batch)
        form = self.backend.attention_form
        lat = latent.to(dev, cfg.dtype)
        if form == "absorbed":
            q = self.rand(t, h, cfg.kv_dim)
            out = self.backend.forward(q.to(dev, cfg.dtype), lat[:, None], None, 0, loc, self.cache)
        else:
            q = self.rand(t, h, cfg.qk_head_dim)
            k, v = self.decompress(lat)
            out = self.backend.forward(q.to(dev, cfg.dtype), k, v, 0, loc, self.cache, latent=lat,
                                       kv_decompress=self.decompress)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        refs = []
        for s, qr in zip(slots, q.split(new)):
            if qr.shape[0] == 0:
                continue
            hist = self.hist[s]
            if form == "absorbed":
                refs.append(_dense(qr, hist[:, None], hist[:, None, : cfg.kv_lora_rank], cfg.softmax_scale))
            else:
                k, v = self.decompress(hist)
                refs.append(_dense(qr, k.double(), v.double(), cfg.softmax_scale))
        ref = torch.cat(refs)
        got = out.double().cpu().view_as(ref)
        err = ((got - ref).norm() / ref.norm()).item()
        return form, err, elapsed, t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16/float16 (CUDA default bf16)")
    parser.add_argument("--provider", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    # float32 arithmetic lands far below 1e-5; bf16/fp16 operands sit near 1e-3..1e-2.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    run = _Run(device, dtype, args.provider)
    print(f"pagedmla self-check: device={device} dtype={str(dtype).replace('torch.', '')} "
          f"provider={run.backend.provider} heads={run.cfg.num_local_heads} page_size={run.cfg.page_size}")
    r = [run.table.add_request() for _ in range(6)]
    cfg = run.cfg
    steps = [
        ("prefill, no prefix", ForwardMode.EXTEND, r[:4], [37, 16, 1, 90], 0, None),
        ("decode", ForwardMode.DECODE, r[:4], [1, 1, 1, 1], 0, None),
        ("verify (q_len 4)", ForwardMode.TARGET_VERIFY, r[:4], [4, 4, 4, 4], 0, None),
        ("prefill over prefix, absorbed", ForwardMode.EXTEND, r[:2], [5, 3], 0, "absorbed"),
        ("prefill over prefix, chunked", ForwardMode.EXTEND, r[2:4], [40, 9], 0, "chunked"),
        ("mixed: 2 prefills + verify-sized + 3 decodes", ForwardMode.MIXED, [4, 0, 1, 2, 3, 5][:6],
         [20, 6, 4, 1, 1, 1], 3, None),
    ]
    worst = 0.0
    print(f"{'step':48s} {'form':9s} {'tokens':>6s} {'rel.err':>9s} {'ms':>8s}")
    for name, mode, slots, new, n_ext, prefix_mode in steps:
        if prefix_mode is not None:
            cfg.extend_prefix_mode = prefix_mode
        if mode == ForwardMode.MIXED:
            # Request 5 decodes in this step: give it a cached history first (checked like any step).
            worst = max(worst, run.step(ForwardMode.EXTEND, [5], [12])[1])
        form, err, elapsed, t = run.step(mode, slots, new, n_ext)
        cfg.extend_prefix_mode = "auto"
        worst = max(worst, err)
        print(f"{name:48s} {form:9s} {t:6d} {err:9.2e} {elapsed * 1e3:8.2f}")
    ok = worst < tol
    print(f"max relative error {worst:.2e} (tolerance {tol:.0e}): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
