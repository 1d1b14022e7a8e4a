"""benchmarks/bench_ab.py off the GPU: several checkouts import side by side, their column names, the errors."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from benchmark_script import load

ROOT = Path(__file__).resolve().parents[1]


def _checkout(into: Path, marker: str) -> Path:
    """A copy of this checkout's pagedmla/ under ``into`` whose package says ``marker``."""
    shutil.copytree(ROOT / "pagedmla", into / "pagedmla", ignore=shutil.ignore_patterns("__pycache__"))
    init = into / "pagedmla" / "__init__.py"
    init.write_text(init.read_text() + f"\nAB_MARKER = {marker!r}\n")
    return into


def test_two_other_checkouts_import_side_by_side(tmp_path):
    bench = load("bench_ab")
    a = _checkout(tmp_path / "rev_a", "a")
    b = _checkout(tmp_path / "rev_b", "b")
    into = tmp_path / "imported"
    into.mkdir()
    try:
        lib_a = bench.import_other(a, into, "pagedmla_other")
        lib_b = bench.import_other(b, into, "pagedmla_other1")
        assert (lib_a.AB_MARKER, lib_b.AB_MARKER) == ("a", "b")
        # Each copy is its own package with its own public calls (and torch.library namespace).
        assert lib_a.flash_mla_with_kvcache is not lib_b.flash_mla_with_kvcache
        assert lib_a.__name__ == "pagedmla_other" and lib_b.__name__ == "pagedmla_other1"
        assert "pagedmla_other1" in sys.modules and "pagedmla_other" in sys.modules
    finally:
        for name in [m for m in sys.modules if m.startswith("pagedmla_other")]:
            del sys.modules[name]
        sys.path[:] = [p for p in sys.path if p != str(into)]


def test_column_names():
    bench = load("bench_ab")
    assert bench.labels([Path("/tmp/rev")]) == ["other"]
    assert bench.labels([Path("/x/eef7c2b"), Path("/y/HEAD")]) == ["eef7c2b", "HEAD"]
    assert bench.labels([Path("/x/rev"), Path("/y/rev"), Path("/z/this")]) == ["rev#0", "rev#1", "this#2"]


def test_a_folder_without_the_package_is_named(tmp_path):
    with pytest.raises(SystemExit, match="holds no pagedmla/ package"):
        load("bench_ab").import_other(tmp_path, tmp_path / "into")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_without_a_gpu_it_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device"):
        load("bench_ab").main(["--other", str(tmp_path), "--other", str(tmp_path), "--match", "h16"])



class _Lib:
    """A stand-in for an imported checkout: its calls return ones times ``scale``."""

    def __init__(self, name: str, scale: float):
        self.name, self.scale = name, scale


def _setup(copies):
    """A cell's setup whose calls return ones times the version's scale, each knowing its version."""
    def setup(graphs):
        def bind(lib):
            def call(i):
                return torch.ones(3) * lib.scale
            call.version = lib.name
            return call
        return bind, copies if graphs else None
    return setup


def test_rows_and_table_of_three_versions(monkeypatch, capsys):
    bench = load("bench_ab")
    versions = {"this": _Lib("this", 1.0), "eef7c2b": _Lib("eef7c2b", 1.0), "HEAD": _Lib("HEAD", 2.0)}
    clock = {"this": iter([10.0, 9.0]), "eef7c2b": iter([11.0, 12.0]), "HEAD": iter([20.0, 21.0])}

    monkeypatch.setattr(bench, "timed", lambda fn: next(clock[fn.func.version]))
    row = bench.time_cell("decode b128 q1 h16 s4096", _setup(None), versions, rounds=2)
    assert (row["this_us"], row["eef7c2b_us"], row["HEAD_us"]) == (9.0, 11.0, 20.0)
    assert row["ratio_eef7c2b"] == pytest.approx(11 / 9) and row["ratio_HEAD"] == pytest.approx(20 / 9)
    assert row["spread_this"] == pytest.approx(1 / 9)
    assert row["same"] is False and row["differ"] == "HEAD"  # HEAD's output differs from this checkout's
    # 1 - 2 (1 . 2) / (|1|^2 + |2|^2) over three elements: 1 - 12 / 15.
    assert row["cos_HEAD"] == pytest.approx(0.2) and row["cos_eef7c2b"] == 0.0
    assert not any(k.startswith("graph_") for k in row)
    bench.print_table([row], ["eef7c2b", "HEAD"])
    out = capsys.readouterr().out
    assert ("| decode b128 q1 h16 s4096 | 9.0 | 11.0 | 20.0 | 1.222 | 2.222 | 11.1% / 9.1% / 5.0% "
            "| NO: HEAD (cos 2.0e-01) |") in out
    assert "HEAD / this: geomean 2.222, min 2.222, max 2.222 over 1 cells" in out


def test_graph_figures_beside_the_eager_ones(monkeypatch, capsys):
    """``--graphs``: a decode cell gets each version's graph timer over its input copies, timed in the same
    rounds; a prefill cell (no copies) keeps eager figures only and prints dashes in the graph columns."""
    bench = load("bench_ab")
    versions = {"this": _Lib("this", 1.0), "HEAD": _Lib("HEAD", 1.0)}
    eager = {"this": iter([10.0, 9.0]), "HEAD": iter([11.0, 12.0])}
    graph = {"this": iter([8.0, 7.0]), "HEAD": iter([7.0, 7.5])}
    made, order = [], []

    def graph_timer(call, copies):
        made.append((call.version, copies))

        def timer():
            order.append(("graph", call.version))
            return next(graph[call.version])
        return timer

    def timed(fn):
        order.append(("eager", fn.func.version))
        return next(eager[fn.func.version])

    monkeypatch.setattr(bench, "timed", timed)
    monkeypatch.setattr(bench.bdecode, "graph_timer", graph_timer)
    row = bench.time_cell("decode b1 q1 h128 s4096", _setup(4), versions, rounds=2, graphs=True)
    assert made == [("this", 4), ("HEAD", 4)]
    # Every round times each version eagerly, then each as a graph.
    assert order == [("eager", "this"), ("eager", "HEAD"), ("graph", "this"), ("graph", "HEAD")] * 2
    assert (row["graph_this_us"], row["graph_HEAD_us"]) == (7.0, 7.0)
    assert row["ratio_graph_HEAD"] == pytest.approx(1.0) and row["ratio_HEAD"] == pytest.approx(11 / 9)
    assert row["spread_graph_this"] == pytest.approx(1 / 7)
    eager |= {"this": iter([5.0]), "HEAD": iter([6.0])}
    prefill = bench.time_cell("ragged 8x4096 h16", _setup(None), versions, rounds=1, graphs=True)
    assert "graph_this_us" not in prefill
    bench.print_table([row, prefill], ["HEAD"])
    out = capsys.readouterr().out
    assert ("| decode b1 q1 h128 s4096 | 9.0 | 11.0 | 1.222 | 11.1% / 9.1% | 7.0 | 7.0 | 1.000 | 14.3% / 7.1% | yes |"
            in out)
    assert "| ragged 8x4096 h16 | 5.0 | 6.0 | 1.200 | 0.0% / 0.0% | — | — | — | — | yes |" in out
    assert "HEAD / this (graphs): geomean 1.000, min 1.000, max 1.000 over 1 cells" in out
    assert "HEAD / this: geomean 1.211, min 1.200, max 1.222 over 2 cells" in out


def test_queued_figures_beside_the_eager_ones(monkeypatch, capsys):
    """``--queued``: a decode cell gets each version's queued timer over its input copies (rotated copies made
    without ``--graphs`` too), timed in the same rounds, and its own columns and geomean."""
    bench = load("bench_ab")
    versions = {"this": _Lib("this", 1.0), "HEAD": _Lib("HEAD", 1.0)}
    eager = {"this": iter([10.0, 9.0]), "HEAD": iter([11.0, 12.0])}
    queued = {"this": iter([6.0, 5.0]), "HEAD": iter([6.5, 6.0])}
    made = []

    def queued_timer(call, copies):
        made.append((call.version, copies))
        return lambda: next(queued[call.version])

    monkeypatch.setattr(bench, "timed", lambda fn: next(eager[fn.func.version]))
    monkeypatch.setattr(bench.bdecode, "queued_timer", queued_timer)
    row = bench.time_cell("decode b128 q1 h16 s1024", _setup(4), versions, rounds=2, queued=True)
    assert made == [("this", 4), ("HEAD", 4)]
    assert (row["queued_this_us"], row["queued_HEAD_us"]) == (5.0, 6.0)
    assert row["ratio_queued_HEAD"] == pytest.approx(1.2) and "graph_this_us" not in row
    bench.print_table([row], ["HEAD"])
    out = capsys.readouterr().out
    assert "queued this µs | queued HEAD µs | queued HEAD / this" in out
    assert "| 5.0 | 6.0 | 1.200 | 20.0% / 8.3% | yes |" in out
    assert "HEAD / this (queued): geomean 1.200, min 1.200, max 1.200 over 1 cells" in out


def test_csv_takes_every_rows_columns(monkeypatch, tmp_path):
    """``--csv`` with a decode cell's graph figures after a prefill row without them: the header is every row's
    keys, the prefill row's graph fields empty."""
    import csv

    bench = load("bench_ab")
    rows = [{"cell": "ragged", "this_us": 1.0, "same": True},
            {"cell": "decode", "this_us": 2.0, "graph_this_us": 1.5, "same": True}]
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "import_other", lambda checkout, into, name: _Lib(name, 1.0))
    monkeypatch.setattr(bench, "ragged_cells", lambda quick: [("ragged", None)])
    monkeypatch.setattr(bench, "time_cell", lambda name, setup, versions, rounds, graphs, queued: rows.pop(0))
    monkeypatch.setattr(bench, "print_table", lambda rows, names: None)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "decode_cells", lambda quick, fmt=None: [("decode", None)])
    path = tmp_path / "ab.csv"
    bench.main(["--other", str(tmp_path), "--only", "ragged", "--only", "decode", "--graphs", "--csv", str(path)])
    got = list(csv.DictReader(path.open()))
    assert list(got[0]) == ["cell", "this_us", "same", "graph_this_us"]
    assert got[0]["graph_this_us"] == "" and got[1]["graph_this_us"] == "1.5"


def test_decode_cells_rotate_input_copies_for_graphs(monkeypatch):
    """With graphs a decode cell makes ``bench_decode``'s rotated copies (enough to leave L2 cold) and a version's
    call on copy i reads copy i's q and cache."""
    import functools
    import types

    import pagedmla
    from pagedmla.bench import decode as bdecode

    bench = load("bench_ab")
    monkeypatch.setattr(bench.bdecode, "grid", lambda quick: [bdecode.Cell(2, 1, 4, 40)])
    monkeypatch.setattr(bench.bdecode, "Inputs", functools.partial(bdecode.Inputs, device="cpu",
                                                                  dtype=torch.float16))
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(L2_cache_size=1 << 20))
    (_, setup), = bench.decode_cells(True)
    bind, copies = setup(True)
    assert copies is not None and copies > 1
    call = bind(pagedmla)
    out0, out1 = call(0), call(1)
    assert not torch.equal(out0, out1) and torch.equal(out0, call(0))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_fp8_decode_cells_call_on_the_quantised_cache(monkeypatch, fmt):
    """``--kv-format``: each decode cell quantises its cache once and every version's call reads those bytes
    (with the format's keyword: k_scale, or is_fp8_kvcache): the output is the FP8 cache's, near the bf16
    cell's and not equal to it."""
    import functools

    import pagedmla
    from pagedmla.bench import decode as bdecode

    bench = load("bench_ab")
    monkeypatch.setattr(bench.bdecode, "grid", lambda quick: [bdecode.Cell(2, 1, 4, 40)])
    monkeypatch.setattr(bench.bdecode, "Inputs", functools.partial(bdecode.Inputs, device="cpu",
                                                                  dtype=torch.float16))
    (name, setup), = bench.decode_cells(True, fmt)
    (_, setup_bf16), = bench.decode_cells(True)
    assert name == f"decode {fmt} b2 q1 h4 s40"
    torch.manual_seed(0)  # Inputs draws q and the cache from the global generator: the same for both cells
    bind, copies = setup(False)
    out = bind(pagedmla)(0)
    torch.manual_seed(0)
    ref = setup_bf16(False)[0](pagedmla)(0)
    assert copies is None
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0)
    assert 1 - cos < 1e-3
