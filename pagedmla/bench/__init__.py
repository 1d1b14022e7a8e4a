"""Benchmark grids of pagedmla against the baselines installed beside it, inside the package so that an
installed copy can run them (``pagedmla bench``); ``benchmarks/bench_*.py`` are thin wrappers of these.

``decode``: paged MLA decode against FlashMLA and FlashInfer; ``prefill``: ragged MHA, paged absorbed
prefill and merge_state against torch SDPA and FlashInfer; ``engine``: the serving engine against
transformers' ``generate``.
"""
