"""CUDA graphs for decode and verify steps: one graph per (batch size, mode), captured once, replayed by
copying the step's inputs into the captured static buffers.

A step of ``raw`` requests replays the graph of the smallest captured batch size >= raw; the padded rows
run token 0 at position 0, write their latent row to slot 0 (the reserved page 0) and attend with the
backend's fill seq_len over block-table rows of page 0, so they touch no live data. Larger batches run
eagerly. A replay reads nothing back from the device and reuses its static buffers: the inputs are
copied into them, the backend refills its own graph buffers (``init_forward_metadata_replay_cuda_graph``),
and the logits (and the final hidden states, which an MTP draft model reads) are read from the graph's
static outputs. Building the inputs (``ModelRunner.inputs``) allocates small temporaries, which the
caching allocator serves without new device allocations once the sizes have been seen; on CUDA the
backend's schedule for the replay is written straight into its buffers.

The model runner owns its GraphRunner (``ModelRunner.capture_cuda_graphs``); a GraphRunner knows only the
model, its cache and its backend, so this module does not import the runner. Graph objects come from a
factory (``CudaGraph`` on the GPU); tests substitute one that re-runs the captured function, so the
padding and buffer logic runs on the CPU too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pagedmla.backend import ForwardBatch, ForwardMode, MLABackend
from pagedmla.cache import MLAKVCache
from pagedmla.model.context import StepContext
from pagedmla.model.deepseek import DeepseekForCausalLM


class Graph(Protocol):
    def capture(self, fn: Callable[[], Any]) -> Any:
        """Record ``fn`` and return its (static) output: a tensor or a tuple of tensors."""

    def replay(self) -> None:
        """Run the recorded work again, refreshing the output tensors in place."""


class CudaGraph:
    """torch.cuda.CUDAGraph capture after warm-up runs (which compile kernels and settle allocations).

    Graphs of one runner share a memory pool; capturing the largest batch first lets the smaller ones
    reuse its blocks."""

    def __init__(self, pool=None, warmup: int = 2):
        self.pool = pool
        self.warmup = warmup
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory(device: torch.device) -> Callable[[], Graph]:
    """Makes CudaGraphs that share one memory pool (ValueError naming ``enable_cuda_graph`` off CUDA)."""
    if device.type != "cuda":
        raise ValueError(f"enable_cuda_graph: CUDA graphs need a CUDA device, the model is on {device}")
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32 and every 16 beyond, ending at max_batch_size (cheap padding
    where batches are small, few graphs where they are large)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    b = 8
    while b < max_batch_size:
        sizes.append(b)
        b += 8 if b < 32 else 16
    return sizes + [max_batch_size]


class GraphRunner:
    """Captures decode steps (and verify steps when the backend has draft tokens) of ``batch_sizes``.

    model, cache, backend: what the graphs run (a ModelRunner's); batch_sizes: a non-empty list (None:
    ``default_batch_sizes`` of the backend's max_batch_size); graph_factory: makes one Graph per captured
    (batch size, mode) (None: ``CudaGraph``, which needs the cache on a CUDA device)."""

    def __init__(self, model: DeepseekForCausalLM, cache: MLAKVCache, backend: MLABackend,
                 batch_sizes: list[int] | None = None, graph_factory: Callable[[], Graph] | None = None):
        max_bs = backend.config.max_batch_size
        if batch_sizes is not None and not batch_sizes:
            raise ValueError("batch_sizes: expected at least one batch size to capture (None: the defaults)")
        sizes = sorted(set(default_batch_sizes(max_bs) if batch_sizes is None else batch_sizes))
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= max_bs for b in sizes):
            raise ValueError(f"batch_sizes: expected batch sizes in 1..{max_bs} (max_batch_size), got {batch_sizes!r}")
        dev = cache.device
        graph_factory = graph_factory or cuda_graph_factory(dev)
        self.model, self.cache, self.backend = model, cache, backend
        self.batch_sizes = sizes
        self.modes = [ForwardMode.DECODE]
        if backend.config.decode_q_len > 1:
            self.modes.append(ForwardMode.TARGET_VERIFY)
        tokens = sizes[-1] * max(self.q_len(m) for m in self.modes)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, ForwardMode], Graph] = {}
        self.outputs: dict[tuple[int, ForwardMode], tuple[torch.Tensor, torch.Tensor]] = {}
        backend.init_cuda_graph_state(sizes[-1])
        with torch.inference_mode():
            for mode in self.modes:
                for bs in reversed(sizes):
                    self._capture(bs, mode, graph_factory())

    def q_len(self, mode: ForwardMode) -> int:
        """Tokens per request of a captured ``mode`` step (``MLABackend.q_len``)."""
        return self.backend.q_len(mode)

    def _capture(self, bs: int, mode: ForwardMode, graph: Graph) -> None:
        n = bs * self.q_len(mode)
        dev = self.cache.device
        fill = self.backend.get_cuda_graph_seq_len_fill_value()
        seq_lens = torch.full((bs,), fill, dtype=torch.int32, device=dev)
        slots = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.backend.init_forward_metadata_capture_cuda_graph(bs, slots, seq_lens, mode)
        ctx = StepContext(backend=self.backend, cache=self.cache, out_cache_loc=self.out_cache_loc[:n])
        model = self.model

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = model(self.input_ids[:n], self.positions[:n], ctx)
            return model.compute_logits(hidden), hidden

        self.outputs[(bs, mode)] = graph.capture(step)
        self.graphs[(bs, mode)] = graph

    def padded_batch_size(self, bs: int) -> int | None:
        """The captured batch size a step of ``bs`` requests replays (None: larger than any, run eagerly)."""
        return next((b for b in self.batch_sizes if b >= bs), None)

    def can_replay(self, mode: ForwardMode, bs: int) -> bool:
        return mode in self.modes and self.padded_batch_size(bs) is not None

    def replay(self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
               out_cache_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits float32 [raw * q_len, vocab] and final hidden states [raw * q_len, hidden] of the decode /
        verify step ``batch`` of ``raw`` requests (its int64 [raw * q_len] token ids, positions and cache
        slots), from the graph of the next captured batch size. They are the graph's outputs: valid until
        the next replay."""
        mode = batch.forward_mode
        raw = batch.batch_size
        bs = self.padded_batch_size(raw)
        q = self.q_len(mode)
        n_raw, n = raw * q, bs * q
        for buf, src in ((self.input_ids, input_ids), (self.positions, positions), (self.out_cache_loc, out_cache_loc)):
            buf[:n_raw].copy_(src)
            buf[n_raw:n].zero_()
        self.backend.init_forward_metadata_replay_cuda_graph(bs, batch.req_pool_indices, batch.seq_lens, mode,
                                                             block_table=batch.block_table, raw_bs=raw)
        self.graphs[(bs, mode)].replay()
        logits, hidden = self.outputs[(bs, mode)]
        return logits[:n_raw], hidden[:n_raw]
