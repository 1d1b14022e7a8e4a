"""Serving benchmark, pagedmla's engine against transformers' ``generate``: a thin wrapper of
``pagedmla.bench.engine`` (its docstring has the presets, the workload and the columns).

    python benchmarks/bench_engine.py --preset v2-lite                     # GPU: bf16, batch 64
    python benchmarks/bench_engine.py --preset tiny --device cpu --num-requests 4 --prompt-len 8:24 \\
        --output-len 4:8 --batch-size 4                                    # CPU smoke run
"""

import sys

from pagedmla.bench.engine import PRESETS, main, percentiles

__all__ = ["PRESETS", "main", "percentiles"]

if __name__ == "__main__":
    sys.exit(main())
