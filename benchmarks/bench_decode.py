"""Paged MLA decode beside FlashMLA and FlashInfer: a thin wrapper of ``pagedmla.bench.decode`` (its
docstring has the grid, the timing method and the options; ``--help`` prints it).

    python3 benchmarks/bench_decode.py [--quick] [--flashinfer] [--alt] [--graphs] [--csv out.csv] [--plot out.png]
    python3 benchmarks/bench_decode.py --sweep [SPECS]  # time kernel configs on representative cells
"""

from pagedmla.bench.decode import main

if __name__ == "__main__":
    main()
