"""Prefill benchmarks (ragged MHA, paged absorbed prefill, merge_state) with baselines in one run: a thin
wrapper of ``pagedmla.bench.prefill`` (its docstring has the grids and the timing method).

    python benchmarks/bench_prefill.py [--flashinfer] [--variants] [--quick] [--rounds N] [--csv PATH] [--only PART]
"""

from pagedmla.bench.prefill import main

if __name__ == "__main__":
    main()
