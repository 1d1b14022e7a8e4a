"""CPU smoke run of benchmarks/bench_engine.py on its tiny preset (the GPU run uses --preset v2-lite)."""

from __future__ import annotations

import re

import pytest
from benchmark_script import load

pytest.importorskip("transformers")


def _bench():
    return load("bench_engine")


def test_tiny_preset_runs_on_cpu_and_matches_transformers(capsys):
    bench = _bench()
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--num-requests", "4", "--prompt-len", "8:24",
                       "--output-len", "4:8", "--batch-size", "4", "--page-size", "16", "--mixed"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| pagedmla torch \| [\d.]+ \| [\d.]+ \| [\d.]+ / [\d.]+ / [\d.]+ \| .* \| 4/4 \|", out), out
    assert "| transformers generate |" in out and "best engine throughput / transformers" in out


def test_attention_profile_counts_one_call_per_layer_and_step(capsys):
    bench = _bench()
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--num-requests", "3", "--prompt-len", "8:12",
                       "--output-len", "3:5", "--batch-size", "4", "--page-size", "16", "--no-hf",
                       "--profile-attention"]) == 0
    out = capsys.readouterr().out
    layers = bench.PRESETS["tiny"]["num_hidden_layers"]
    for kind in ("extend", "decode"):
        row = re.search(rf"\| pagedmla torch \| {kind} \| (\d+) \| (\d+) \((\d+) layers\) \| ([\d.]+) \| ([\d.]+) \| "
                        rf"(\d+)% \|", out)
        assert row, out
        steps, calls, named, attn_ms, step_ms, share = row.groups()
        assert int(steps) >= 1 and int(calls) == int(named) == layers
        assert 0 < float(attn_ms) <= float(step_ms) and 0 < int(share) <= 100


def test_percentiles_and_bad_arguments(capsys):
    bench = _bench()
    assert bench.percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, 5.0, 5.0)
    assert bench.percentiles([]) == (0.0, 0.0, 0.0)
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--device", "cpu", "--prompt-len", "9:3"])
    assert "--prompt-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--device", "cpu", "--cuda-graph", "on"])
    assert "--cuda-graph" in capsys.readouterr().err


def test_mtp_rows_beside_plain_decoding(capsys):
    """``--speculative mtp``: every configuration also served with MTP drafts (same greedy tokens), its
    acceptance rate and tokens per verify step in the table."""
    bench = _bench()
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--num-requests", "3", "--prompt-len", "8:12",
                       "--output-len", "3:5", "--batch-size", "4", "--page-size", "16", "--speculative", "mtp",
                       "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| pagedmla torch \| [\d.]+ \|.*\| 3/3 \| - \| - \|", out), out
    assert re.search(r"\| pagedmla torch \+mtp k=2 \| [\d.]+ \|.*\| 3/3 \| [\d.]+% \| [\d.]+ \|", out), out
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--device", "cpu", "--speculative", "mtp", "--num-speculative-tokens", "5"])
    assert "--num-speculative-tokens" in capsys.readouterr().err


def test_fp8_cache_rows_beside_the_model_dtype(capsys):
    """``--kv-cache-dtype``: each format served in turn, its cache tokens per GiB in the table and its decode
    step and capacity against the model-dtype row's (float32 on the CPU: 2304-byte rows, 4x fp8_e4m3's 576,
    3.51x fp8_ds_mla's 656); a bad format is named."""
    bench = _bench()
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--num-requests", "3", "--prompt-len", "8:12",
                       "--output-len", "3:5", "--batch-size", "4", "--page-size", "16", "--no-hf",
                       "--kv-cache-dtype", "auto,fp8_e4m3,fp8_ds_mla"]) == 0
    out = capsys.readouterr().out
    for name in ("pagedmla torch", "pagedmla torch fp8_e4m3", "pagedmla torch fp8_ds_mla"):
        assert re.search(rf"\| {name} \| [\d.]+ \| .* \| \d+ \|$", out, re.M), out
    assert re.search(r"pagedmla torch fp8_e4m3: decode step [\d.]+x pagedmla torch's, 4\.00x its cache tokens", out)
    assert re.search(r"pagedmla torch fp8_ds_mla: decode step [\d.]+x pagedmla torch's, 3\.51x its cache tokens", out)
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--device", "cpu", "--kv-cache-dtype", "auto,fp9"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
