"""CPU smoke runs of benchmarks/bench_fp8.py: every part's table and CSV, the reference check wired to the
exit status. No timing is checked."""

from __future__ import annotations

import csv
import re

from benchmark_script import load


def test_cpu_run_prints_every_part_and_writes_the_csv(tmp_path, capsys):
    bench = load("bench_fp8")
    path = tmp_path / "fp8.csv"
    assert bench.main(["--quick", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    for cell in ("2x1x16x128", "2x2x16x64"):
        assert re.search(rf"\| {cell} \| - \| [\d.]+ \| [\d.]+ \| [\d.]+ \| - \| - \| [\d.]+ \| [\d.]+ \| ", out), out
    assert re.search(r"\| 2x16 over 48 h16 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ", out), out
    assert re.search(r"\| 3x4 over 100 / 20 h2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+, [\d.]+ \|",
                     out), out
    for fmt in ("bf16", "fp8_e4m3", "fp8_ds_mla"):
        assert re.search(rf"\| store 128 rows, {fmt} \| [\d.]+ \| [\d.]+ \| [\d.]+% \|", out), out
        assert re.search(rf"\| {fmt} 2x4 over 40 h4 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), out
    assert "BAD" not in out
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows][:4] == ["2x1x16x128", "2x2x16x64", "2x16 over 48 h16", "3x4 over 100 / 20 h2"]
    assert all(r["ok"] == "True" for r in rows[:4])


def test_an_output_off_the_reference_fails_the_run(capsys, monkeypatch):
    bench = load("bench_fp8")
    monkeypatch.setattr(bench, "COS_LIMIT", -1.0)  # no cos diff passes: every FP8 check must report it
    assert bench.main(["--quick", "--only", "prefill"]) == 1
    assert "BAD: FP8 outputs off the reference in ['2x16 over 48 h16']" in capsys.readouterr().out


def test_accuracy_script_measures_each_layer_on_shadow_caches(tmp_path, capsys):
    """benchmarks/fp8_accuracy.py part 2 on the tiny preset (torch provider): one row per format and layer,
    each error a real FP8 rounding error: above 0 (a shadow call that read the bf16 cache would give exactly
    0) and a few percent at most."""
    bench = load("fp8_accuracy")
    path = tmp_path / "acc.csv"
    assert bench.main(["--device", "cpu", "--preset", "tiny", "--skip-tiny", "--num-requests", "2",
                       "--prompt-len", "24", "--output-len", "3", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    layers = bench.PRESETS["tiny"]["num_hidden_layers"]
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["format"], int(r["layer"])) for r in rows] == [(f, i) for f in bench.FORMATS for i in range(layers)]
    for r in rows:
        assert 1e-4 < float(r["decode_rel_err"]) < 0.1, r
    for fmt in bench.FORMATS:
        assert re.search(rf"{fmt}: decode relative error mean [\d.e+-]+, max [\d.e+-]+ over {layers} layers", out)
