"""Paged latent KV cache: page allocator, request block tables, per-layer latent buffers.

Layout: each layer's buffer is ``[num_pages * page_size, 1, width]``; token slot
``page_id * page_size + offset``. Page 0 is reserved: it is never handed out, and padded tokens (CUDA
graph padding, idle rows) write there, so it may hold garbage but never a live request's data.

FP8 caches (``pagedmla.kv_format``): ``fp8_e4m3`` rows are kv_dim float8_e4m3fn values with one float32 scale
per layer, ``fp8_ds_mla`` rows FlashMLA's 656 bytes with their own scales. Writes quantise the rows they store
(and only those); gathers dequantise the rows they read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedmla import checks, errors, kv_format
from pagedmla.device import to_device
from pagedmla.rows import gather_slots, live_slots, store_slots


class OutOfPagesError(RuntimeError):
    """The allocator cannot satisfy a request; nothing was allocated."""


class PageAllocator:
    """Hands out page ids 1..num_pages-1 with reference counts (shared prefix pages have count > 1).

    Freed pages are reused most-recently-freed first, so a finishing request's pages go to the next.
    ``reclaim(n)`` and ``reclaimable()``, when set (a prefix cache sets both), free up to ``n`` pages and
    count the pages that could be freed; an allocation that would fail asks for them only when they suffice.
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages: expected an int >= 2 (page 0 is reserved), got {num_pages!r}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self.reclaim: Callable[[int], object] | None = None
        self.reclaimable: Callable[[], int] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def num_available(self) -> int:
        """Pages an allocation could take now: the free ones plus those ``reclaim`` could free."""
        return len(self._free) + (self.reclaimable() if self.reclaimable is not None else 0)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (reference count 1 each), or raise OutOfPagesError taking none."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        short = n - len(self._free)
        # Evict only when it makes the allocation succeed: a failing one must take nothing, cached pages included.
        if short > 0 and self.reclaim is not None and self.reclaimable is not None and self.reclaimable() >= short:
            self.reclaim(short)
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, only {len(self._free)} of {self.num_pages - 1} are free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (a second request reusing a cached prefix)."""
        for p in pages:
            self._check_live(p, "share")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages: the same page appears twice in {pages}")
        for p in pages:
            self._check_live(p, "free")
        released = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                released.append(p)
        return released

    def _check_live(self, p: int, what: str) -> None:
        if not isinstance(p, int) or not 0 < p < self.num_pages:
            raise ValueError(f"pages: cannot {what} page {p!r}: valid ids are 1..{self.num_pages - 1}")
        if self._refs[p] == 0:
            raise ValueError(f"pages: cannot {what} page {p}: it is not allocated (double free?)")


class RequestTable:
    """Request slots and their pages: the host lists and the int32 ``block_table`` the kernels read.

    Row r of ``block_table`` lists request slot r's pages in order; unused entries hold 0 (the reserved
    page), so a stray read of them touches no live data.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, max_requests: int, max_pages_per_request: int,
                 device: torch.device | str = "cpu"):
        for name, value in (("page_size", page_size), ("max_requests", max_requests),
                            ("max_pages_per_request", max_pages_per_request)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if page_size & (page_size - 1) or page_size > 256:
            raise ValueError(f"page_size: expected a power of two between 1 and 256, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.max_pages_per_request = max_pages_per_request
        self.block_table = torch.zeros(max_requests, max_pages_per_request, dtype=torch.int32, device=device)
        self.pages: dict[int, list[int]] = {}
        self._free_slots = list(range(max_requests - 1, -1, -1))

    def add_request(self, shared_pages: list[int] | None = None) -> int:
        """Open a request slot, optionally starting from shared prefix pages (referenced, not copied).

        Share only full pages: the request writes its next token into the page after them."""
        if not self._free_slots:
            raise OutOfPagesError(f"all {self.block_table.shape[0]} request slots are in use")
        shared = list(shared_pages or [])
        if len(shared) > self.max_pages_per_request:
            raise ValueError(f"shared_pages: {len(shared)} pages exceed "
                             f"max_pages_per_request={self.max_pages_per_request}")
        self.allocator.share(shared)
        slot = self._free_slots.pop()
        self.pages[slot] = shared
        self._sync_row(slot)
        return slot

    def ensure_capacity(self, slot: int, num_tokens: int) -> list[int]:
        """Grow request ``slot`` to hold ``num_tokens`` tokens; returns the newly allocated pages."""
        pages = self._pages(slot)
        if num_tokens < 0:
            raise ValueError(f"num_tokens: expected a length >= 0, got {num_tokens!r}")
        need = -(-num_tokens // self.page_size)
        if need > self.max_pages_per_request:
            raise ValueError(f"num_tokens: {num_tokens} tokens need {need} pages, more than "
                             f"max_pages_per_request={self.max_pages_per_request}")
        new = self.allocator.allocate(max(0, need - len(pages)))
        if new:
            pages.extend(new)
            self._sync_row(slot)
        return new

    def free_request(self, slot: int) -> list[int]:
        """Close request ``slot``, dropping its page references; returns the pages that became free."""
        pages = self._pages(slot)
        released = self.allocator.free(pages)
        del self.pages[slot]
        self.block_table[slot].zero_()
        self._free_slots.append(slot)
        return released

    def token_slots(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Cache slots (int64) of token positions start..end-1 of request ``slot``: the out_cache_loc."""
        pages = self._pages(slot)
        if not 0 <= start <= end <= len(pages) * self.page_size:
            raise ValueError(f"start/end: positions {start}..{end} are outside request {slot}'s "
                             f"{len(pages) * self.page_size} allocated token slots")
        pos = torch.arange(start, end, dtype=torch.int64)
        page_ids = torch.tensor(pages, dtype=torch.int64)[pos // self.page_size] if end > start else pos
        return to_device(page_ids * self.page_size + pos % self.page_size, torch.int64, self.block_table.device)

    def _pages(self, slot: int) -> list[int]:
        if slot not in self.pages:
            raise ValueError(f"slot: request slot {slot!r} is not open")
        return self.pages[slot]

    def _sync_row(self, slot: int) -> None:
        row = torch.zeros(self.max_pages_per_request, dtype=torch.int32)
        pages = self.pages[slot]
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table[slot].copy_(to_device(row, torch.int32, self.block_table.device))


class MLAKVCache:
    """Per-layer latent buffers ``[num_pages * page_size, 1, width]`` plus writes and gathers by slot.

    dtype: the rows' dtype (bfloat16, float16, float32, float64; width = kv_dim) or an FP8 format
    (``pagedmla.kv_format``): "fp8_e4m3" / torch.float8_e4m3fn (width kv_dim, one float32 scale per layer,
    ``k_scale``, 1.0 unless given) or "fp8_ds_mla" / torch.uint8 (width 656 bytes, kv_dim 576). ``dtype`` then
    holds the storage dtype, ``kv_format`` the format (None for float rows).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_dim: int = 576,
                 dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str = "cpu", *,
                 k_scale: float | None = None):
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("kv_dim", kv_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 256 \
                or page_size & (page_size - 1):
            raise ValueError(f"page_size: expected a power of two between 1 and 256, got {page_size!r}")
        fp8 = kv_format.fp8_storage(dtype)
        if fp8 is None and dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"dtype: expected bfloat16, float16, float32, float64, fp8_e4m3 or fp8_ds_mla, "
                             f"got {dtype}")
        self.kv_format = None if fp8 is None else fp8[1]
        dtype, width = (dtype, kv_dim) if fp8 is None else kv_format.storage(self.kv_format, kv_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dim = kv_dim
        self.dtype = dtype
        self.row_width = width
        self.num_slots = num_pages * page_size
        self.buffers = [torch.empty(self.num_slots, 1, width, dtype=dtype, device=device) for _ in range(num_layers)]
        # The two views every step takes of each layer, made once (a view costs host time on every call); FP8
        # rows are moved as bytes (torch has no index_copy_ for float8 on the CPU).
        self._flat = [b.view(self.num_slots, width) if fp8 is None else b.view(torch.uint8).view(self.num_slots, width)
                      for b in self.buffers]
        self._paged = [b.view(num_pages, page_size, 1, width) for b in self.buffers]
        self._k_scales = self._layer_scales(k_scale, num_layers, device)

    def _layer_scales(self, k_scale, num_layers: int, device) -> list[torch.Tensor] | None:
        """fp8_e4m3: one float32 [1] scale tensor per layer (the kernels read it on the device); else None."""
        if self.kv_format != "fp8_e4m3":
            if k_scale is not None:
                raise ValueError(f"k_scale: only an fp8_e4m3 cache has a scale, this one is "
                                 f"{self.kv_format or self.dtype}")
            return None
        k_scale = 1.0 if k_scale is None else k_scale
        if isinstance(k_scale, bool) or not isinstance(k_scale, (int, float)) or not 0 < k_scale < float("inf"):
            raise ValueError(f"k_scale: expected a finite positive float, got {k_scale!r}")
        return [torch.full((1,), float(k_scale), dtype=torch.float32, device=device) for _ in range(num_layers)]

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    def k_scale(self, layer_id: int) -> torch.Tensor | None:
        """The layer's fp8_e4m3 scale (float32 [1], on the cache's device; value = fp8 x scale), None for the
        other formats. Its value may be set in place (``k_scale(layer).fill_(s)``) before rows are written."""
        self.layer(layer_id)
        return self._scale(layer_id)

    def _scale(self, layer_id: int) -> torch.Tensor | None:
        """``k_scale`` for a layer id the caller checked (the step path's stores and gathers)."""
        return None if self._k_scales is None else self._k_scales[layer_id]

    def layer(self, layer_id: int) -> torch.Tensor:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < len(self.buffers):
            raise ValueError(f"layer_id: expected an int in 0..{len(self.buffers) - 1}, got {layer_id!r}")
        return self.buffers[layer_id]

    def paged_view(self, layer_id: int) -> torch.Tensor:
        """The layer's buffer as the kernels see it: [num_pages, page_size, 1, width] (``k_scale`` and
        ``kv_format`` tell an FP8 one)."""
        self.layer(layer_id)
        return self._paged[layer_id]

    def store(self, layer_id: int, out_cache_loc: torch.Tensor, rows: torch.Tensor) -> None:
        """``write`` without its argument checks, for a caller that checked them (the backend, once per layer):
        rows [T, kv_dim] of any float dtype, out_cache_loc int64 [T] on the cache's device, layer_id valid.
        A slot outside the cache is dropped and reported (``errors.CACHE_SLOT``), never written. FP8 caches
        quantise the rows as they store them: on CUDA in one kernel (``kernels/triton/rows.store_fp8_rows``,
        byte for byte ``kv_format.quantize_latent``), elsewhere with torch ops."""
        if not 0 <= layer_id < len(self._flat):
            raise ValueError(f"layer_id: expected an int in 0..{len(self._flat) - 1}, got {layer_id!r}")
        flat = self._flat[layer_id]
        if self.kv_format is None:
            store_slots(flat, out_cache_loc, rows)
        elif flat.is_cuda:
            from pagedmla.kernels.triton.rows import store_fp8_rows

            rows = rows if rows.stride(-1) == 1 else rows.contiguous()
            store_fp8_rows(flat, out_cache_loc, rows, self.kv_format, self._scale(layer_id))
        else:
            codes = kv_format.quantize_latent(rows, self.kv_format, k_scale=self._scale(layer_id))
            store_slots(flat, out_cache_loc, codes.view(torch.uint8))

    def write(self, layer_id: int, out_cache_loc: torch.Tensor, latent: torch.Tensor, validate: bool = True) -> None:
        """Store full latent rows: latent [T, kv_dim] or [T, 1, kv_dim] at slots out_cache_loc int64 [T].

        ``validate`` checks the slot range on the host where ``pagedmla.errors.host_value_checks`` says (a
        synchronisation on CUDA with ``PAGEDMLA_VALIDATE=all``); ``validate=False`` never does, for callers
        inside a step such as the backend. Either way a slot outside the cache is never written: that row
        is dropped and the device error word reports it (``errors.CACHE_SLOT``)."""
        self.layer(layer_id)
        checks.tensor(latent, "latent", dtypes=checks.FLOAT_DTYPES)
        if tuple(latent.shape[1:]) not in ((self.kv_dim,), (1, self.kv_dim)):
            raise ValueError(f"latent: expected shape [T, {self.kv_dim}] or [T, 1, {self.kv_dim}], "
                             f"got {tuple(latent.shape)}")
        rows = latent.reshape(latent.shape[0], self.kv_dim)
        self._check_slots(out_cache_loc, rows.shape[0], check_values=validate)
        self.store(layer_id, out_cache_loc, rows)

    def write_split(self, layer_id: int, out_cache_loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store rows given as their two parts: c_kv [T, kv_lora_rank] and k_pe [T, rope_dim] (or [T, 1, *])."""
        self.layer(layer_id)
        c = checks.tensor(c_kv, "c_kv", dtypes=checks.FLOAT_DTYPES)
        r = checks.tensor(k_pe, "k_pe", dtypes=checks.FLOAT_DTYPES)
        # [T, 1, w] rows are [T, w] rows; explicit widths keep zero-row inputs reshapeable.
        c = c.reshape(c.shape[0], c.shape[-1]) if c.dim() == 3 and c.shape[1] == 1 else c
        r = r.reshape(r.shape[0], r.shape[-1]) if r.dim() == 3 and r.shape[1] == 1 else r
        if c.dim() != 2 or r.dim() != 2 or c.shape[0] != r.shape[0] or c.shape[1] + r.shape[1] != self.kv_dim:
            raise ValueError(f"c_kv/k_pe: widths must add up to {self.kv_dim} over the same T rows, got "
                             f"{tuple(c_kv.shape)} and {tuple(k_pe.shape)}")
        self._check_slots(out_cache_loc, c.shape[0])
        # FP8 caches quantise the joined rows on store: join them in float32, not in the storage dtype.
        joined = self.dtype if self.kv_format is None else torch.float32
        self.write(layer_id, out_cache_loc, torch.cat([c.to(joined), r.to(joined)], dim=1), validate=False)

    def gather(self, layer_id: int, slots: torch.Tensor, validate: bool = True,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows at ``slots`` (int64 [n]) as [n, kv_dim] values; ``validate`` as in ``write``. A slot outside the
        cache gives a NaN row (and sets ``errors.CACHE_SLOT``). dtype: the values' dtype for an FP8 cache, whose
        gathered rows (only those) are dequantised (float32 by default); float rows come back as stored."""
        self.layer(layer_id)
        self._check_slots(slots, None, name="slots", check_values=validate)
        flat = self._flat[layer_id]
        if self.kv_format is None:
            return gather_slots(flat, slots)
        ok = live_slots(slots, self.num_slots)
        raw = flat.index_select(0, torch.where(ok, slots, 0)).view(self.dtype)
        rows = kv_format.dequantize_latent(raw, self.kv_format, k_scale=self._scale(layer_id),
                                           dtype=dtype or torch.float32)
        return rows.masked_fill(~ok.unsqueeze(1), float("nan"))

    def _check_slots(self, slots: torch.Tensor, count: int | None, name: str = "out_cache_loc",
                     check_values: bool = True) -> None:
        checks.tensor(slots, name, ndim=1, dtypes=(torch.int64,))
        if count is not None and slots.shape[0] != count:
            raise ValueError(f"{name}: expected {count} slots (one per row), got {slots.shape[0]}")
        checks.same_device(self.buffers[0], **{name: slots})
        if check_values and slots.numel() and errors.host_value_checks(slots.device):
            lo, hi = torch.stack([slots.min(), slots.max()]).tolist()
            if lo < 0 or hi >= self.num_slots:
                raise ValueError(f"{name}: slots must lie in 0..{self.num_slots - 1}, got range {lo}..{hi}")
