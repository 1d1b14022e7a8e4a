"""The prefill benchmark off the GPU: its rounds, and its summary (a baseline whose output is not pagedmla's gets
no ratio)."""

import math

import pytest

from pagedmla.bench import prefill as bp


@pytest.mark.parametrize("err", [math.nan, 0.71])
def test_summary_shows_no_ratio_for_a_wrong_baseline(capsys, err):
    bp.rows.clear()
    bp.record("paged", "cell a", "triton", 2.0, 500.0, "TFLOP/s", err=0.0)
    bp.record("paged", "cell a", "flashinfer_mla_fa3", 1.8, 550.0, "TFLOP/s", err=err)
    bp.record("paged", "cell b", "triton", 2.0, 500.0, "TFLOP/s", err=0.0)
    bp.record("paged", "cell b", "flashinfer_mla_fa3", 2.5, 400.0, "TFLOP/s", err=2.5e-3)
    ratios = bp.summary()
    out = capsys.readouterr().out
    assert ratios["flashinfer_mla_fa3"] == {"paged cell b": pytest.approx(1.25)}
    assert "flashinfer_mla_fa3 550.0 (output wrong, rel err" in out
    assert "flashinfer_mla_fa3 400.0 -> x1.25" in out
    bp.rows.clear()


def test_cell_timer_alternates_rounds_and_keeps_each_best(monkeypatch):
    figures = {"ours": iter([4.0, 2.0]), "theirs": iter([1.0, 3.0])}
    order: list[str] = []

    def timed(fn):
        name = fn()
        order.append(name)
        return next(figures[name])

    monkeypatch.setattr(bp, "timed", timed)
    monkeypatch.setattr(bp, "rounds", 2)
    bp.rows.clear()
    timer = bp.CellTimer("paged", "cell", 1e9)
    timer.add("ours", lambda: "ours", lambda out: 0.0)
    timer.add("theirs", lambda: "theirs", note="as is")
    timer.add("broken", lambda: 1 / 0)  # reported as failed, never timed
    timer.run()
    assert order == ["ours", "theirs", "ours", "theirs"]
    got = {r["impl"]: (r["ms"], r["note"], r["err"]) for r in bp.rows}
    assert got["ours"] == (2.0, "rel_err=0.0e+00", 0.0)
    assert got["theirs"] == (1.0, "as is", None)
    assert got["broken"][0] is None and got["broken"][1].startswith("ZeroDivisionError")
    bp.rows.clear()
