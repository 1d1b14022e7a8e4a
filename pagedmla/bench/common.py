"""What the benchmark grids share: the CPU wall-clock timer, baseline detection, FP8 copies of a cache, the
CSV writer, the PNG plots and the command-line entry point whose bad flags end in one line."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence

from pagedmla import kv_format

# Timer labels printed with every table, so that CPU figures are never read as GPU ones.
CUDA_TIMER = "triton.testing.do_bench median (CUDA events)"
CPU_TIMER = "wall-clock median (CPU; Triton kernels under the interpreter: a smoke run, not a speed)"


def write_csv(path: str, rows: list[dict]) -> None:
    """``rows`` (dicts with the first row's keys) as a CSV file at ``path``, a header line first."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it: baselines are slow to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fp8_caches(cache):
    """{format: (cache in that format, the public calls' keyword arguments for it)} of a bf16/fp16 paged cache
    (fp8_e4m3 with ``k_scale`` fitted over its rows)."""
    k_scale = kv_format.fit_k_scale(cache)
    return {"fp8_e4m3": (kv_format.quantize_latent(cache, "fp8_e4m3", k_scale=k_scale), {"k_scale": k_scale}),
            "fp8_ds_mla": (kv_format.quantize_latent(cache, "fp8_ds_mla"), {"is_fp8_kvcache": True})}


def wall_clock_us(fn: Callable[[], object], reps: int = 3, warmup: bool = True) -> float:
    """Median µs of ``reps`` calls of fn, after one warm-up call unless ``warmup`` is False (the caller ran
    it already), by ``time.perf_counter`` (CPU tensors: the calls are synchronous)."""
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def best_of_rounds(timers: list[Callable[[], float]], rounds: int) -> list[float]:
    """Each timer's least figure over ``rounds`` passes that run the timers in turn: the GPU's clocks fall
    under a long stretch of load (on the H200 from 1980 to ~1400 MHz within a CUDA-graph measurement), so a
    library timed right after another would pay for the other's heat; alternating and keeping each one's
    best gives both the same conditions."""
    best = [float("inf")] * len(timers)
    for _ in range(max(1, rounds)):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer())
    return best


def check_plotting(path: str | None) -> None:
    """ValueError naming --plot, before any timing starts, when a plot is asked for without matplotlib."""
    if path and not installed("matplotlib"):
        raise ValueError("--plot: writing the PNG needs matplotlib: pip install 'pagedmla[bench]' (or pass --no-plot)")


def bar_plot(path: str, labels: Sequence[str], series: dict[str, Sequence[float | None]], ylabel: str,
             title: str, reference: float | None = None) -> None:
    """A grouped bar chart as a PNG: one group per label, one bar per series (None: no bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.45 * max(1, len(series)) / 2), 4.5))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width=width, label=name)
    if reference is not None:
        ax.axhline(reference, color="k", lw=0.8)
    ax.set_xticks(list(range(len(labels))))
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command(prog: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
            run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None) -> int:
    """Parse ``argv`` (None: sys.argv) with the options ``add_arguments`` defines (description: the first
    paragraph of ``doc``) and return ``run(args)``; a ValueError from it (a bad flag, named) ends the process
    with ``prog: error: ...`` and exit status 2."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")
