"""CPU smoke runs of benchmarks/bench_mtp.py on the trained MTP checkpoint (the session's ``mtp_checkpoint``,
trained once): the table, the CSV, the greedy check, the draft-graph rows (CPU graph stand-in) and bad flags.
No timing is checked."""

from __future__ import annotations

import csv
import re

import pytest
import torch
from benchmark_script import load
from graph_standin import ReRunGraph

import pagedmla.engine.cuda_graph
import pagedmla.engine.mtp_drafter
from pagedmla.engine.mtp_drafter import DRAFT_GRAPH_MODES
from pagedmla.model import load_model, load_mtp


def _bench():
    return load("bench_mtp")


def test_cpu_run_serves_plain_and_mtp_with_the_same_tokens(mtp_checkpoint, tmp_path, capsys):
    bench = _bench()
    path = tmp_path / "mtp.csv"
    assert bench.main(["--device", "cpu", "--checkpoint", str(mtp_checkpoint), "--num-requests", "3",
                       "--output-len", "8:10", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| 2 \| plain \| off \| [\d.]+ \| 1\.00x \| - \| - \| [\d.]+ \| 3/3 \|", out), out
    for k in (1, 2):
        row = rf"\| 2 \| mtp k={k} \| off \| [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 3/3 \|"
        assert re.search(row, out), out
    assert "MISMATCH" not in out and "batch 2, eager: fastest" in out
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["config"], r["k"], r["cuda_graphs"]) for r in rows] == [
        ("plain", "0", "False"), ("mtp k=1", "1", "False"), ("mtp k=2", "2", "False")]
    for r in rows[1:]:
        # The trained draft layer: most drafts accepted (a random one accepts ~2%); the outputs' last
        # drafts are cut by max_tokens and count as rejected.
        assert float(r["acceptance"]) > 0.5
        assert 1.0 < float(r["tokens_per_verify"]) <= 1 + int(r["k"])
        assert r["match"] == "3/3" and r["output_tokens"] == rows[0]["output_tokens"]


class _CountingGraph(ReRunGraph):
    replays = 0

    def replay(self):
        type(self).replays += 1
        super().replay()


def test_draft_graph_rows_with_the_cpu_graph_standin(mtp_checkpoint, monkeypatch, capsys):
    """The graph rows of one k (fused and per-step draft graphs) with the CPU stand-in as the engine's graph
    factory: they replay graphs, and their greedy tokens are plain decoding's."""
    bench = _bench()
    for module in (pagedmla.engine.cuda_graph, pagedmla.engine.mtp_drafter):
        monkeypatch.setattr(module, "cuda_graph_factory", lambda device: _CountingGraph)
    target = load_model(str(mtp_checkpoint), dtype=torch.float32)
    mtp = load_mtp(target, str(mtp_checkpoint))
    prompts, out_lens = bench.workload(2, (8, 10), (6, 8), seed=1)
    configs = bench.configurations([2], DRAFT_GRAPH_MODES, [True])
    assert [c.name for c in configs] == ["plain", "mtp k=2 fused", "mtp k=2 per_step"]
    rows = []
    for config in configs:
        before = _CountingGraph.replays
        rows.append(bench.serve(target, mtp, prompts, out_lens, config, 2, 16, "torch", 1))
        assert _CountingGraph.replays > before, config
    assert bench.compare(rows) == []
    assert [r["match"] for r in rows] == ["2/2"] * 3
    bench.print_summary(rows)
    assert re.search(r"batch 2, CUDA graphs: draft graphs, fused tok/s / per_step tok/s: k=2 [\d.]+",
                     capsys.readouterr().out)


def test_a_mismatch_is_reported_with_its_first_differing_token():
    bench = _bench()
    plain = {"batch_size": 4, "cuda_graphs": True, "k": 0, "config": "plain", "tok_s": 10.0,
             "tokens": [[[5, 6, 7], [8, 9]]]}
    mtp = {"batch_size": 4, "cuda_graphs": True, "k": 2, "config": "mtp k=2 fused", "tok_s": 20.0,
           "tokens": [[[5, 6, 7], [8, 9]], [[5, 6, 7], [8, 3]]]}
    problems = bench.compare([plain, mtp])
    assert (plain["match"], mtp["match"], mtp["speedup"]) == ("2/2", "1/2", 2.0)
    assert len(problems) == 1 and "mtp k=2 fused +graphs" in problems[0]
    assert "request 1 first at output token 1 ([3] against [9])" in problems[0]


@pytest.mark.parametrize("flags,named", [
    (["--ks", "1,5"], "--ks"), (["--ks", "two"], "--ks"), (["--cuda-graph", "on"], "--cuda-graph"),
    (["--draft-graphs", "fused,one"], "--draft-graphs"), (["--batch-sizes", "0"], "--batch-sizes"),
    (["--repeats", "0"], "--repeats"), (["--output-len", "9:3"], "--output-len"),
    (["--checkpoint", "/nonexistent/mtp"], "--checkpoint"), (["--dtype", "int3"], "--dtype")])
def test_bad_flags_are_named_before_anything_trains(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench().main(["--device", "cpu", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
