"""The prefill benchmark's summary: a baseline whose output is not pagedmla's gets no ratio."""

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
