"""CPU smoke run of benchmarks/bench_mixed.py: its table and CSV, the output check wired to the exit status.
No timing is checked."""

from __future__ import annotations

import csv
import re

from benchmark_script import load

import pagedmla.backend


def test_cpu_run_prints_the_table_and_writes_the_csv(tmp_path, capsys):
    bench = load("bench_mixed")
    path = tmp_path / "mixed.csv"
    assert bench.main(["--rounds", "1", "--kv-format", "fp8_e4m3", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    for fmt in ("bf16", "fp8_e4m3"):
        cell = rf"{fmt} h2 1x5 over 3 \+ 3 decodes x 40"
        assert re.search(rf"\| {cell} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| varlen \| [\d.e+-]+ \|", out), out
    assert "BAD" not in out
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == [f"{fmt} h2 1x5 over 3 + 3 decodes x 40" for fmt in ("bf16", "fp8_e4m3")]
    assert all(r["ok"] == "True" for r in rows)


BAD = "BAD: the two settings' outputs differ, or a setting did not plan its kernels, in"


def test_settings_that_disagree_fail_the_run(capsys, monkeypatch):
    bench = load("bench_mixed")
    monkeypatch.setattr(bench, "COS_LIMIT", -1.0)  # no cos diff passes: the check must report it
    assert bench.main(["--rounds", "1"]) == 1
    assert f"{BAD} ['bf16 h2 1x5 over 3 + 3 decodes x 40']" in capsys.readouterr().out


def test_a_setting_the_backend_ignores_fails_the_run(capsys, monkeypatch):
    """Were "decode" planned as one launch, both rows would time the same path: the run must say so."""
    bench = load("bench_mixed")
    monkeypatch.setattr(pagedmla.backend.MLABackend, "_split_decodes", lambda self, ext, seq, n_ext: 0)
    assert bench.main(["--rounds", "1"]) == 1
    assert f"{BAD} ['bf16 h2 1x5 over 3 + 3 decodes x 40']" in capsys.readouterr().out
