"""The ``pagedmla generate`` command on the tiny model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pagedmla.cli import main


def test_generate_prints_ids_and_summary(capsys):
    rc = main(["generate", "--model", "tiny", "--prompt", "1 2 3 4 5 6 7 8", "--prompt", "9 10",
               "--max-new-tokens", "5", "--page-size", "16", "--max-context-len", "128", "--device", "cpu",
               "--profile-attention"])
    out = capsys.readouterr().out
    assert rc == 0
    ids = re.findall(r"\[(\d)\] generated ids: ((?:\d+ ?)+)", out)
    assert [i for i, _ in ids] == ["0", "1"] and all(len(t.split()) == 5 for _, t in ids)
    assert re.search(r"prefill: 10 tokens in [\d.]+ ms \([\d.]+ tokens/s", out)
    assert re.search(r"decode:  8 tokens in [\d.]+ ms \([\d.]+ tokens/s", out)
    assert "attention (decode): 3 calls/step (3 layers)" in out


def test_engine_feature_flags(capsys):
    rc = main(["generate", "--prompt", " ".join(["3 4 5 6"] * 6), "--prompt", "3 4 5 6 7", "--max-new-tokens", "12",
               "--page-size", "16", "--max-context-len", "128", "--device", "cpu", "--max-num-batched-tokens", "8",
               "--enable-prefix-caching", "--num-speculative-tokens", "3", "--cuda-graph", "off"])
    out = capsys.readouterr().out
    assert rc == 0 and len(re.findall(r"generated ids: (?:\d+ ?){12} \(length\)", out)) == 2
    assert re.search(r"prefill: 29 tokens in [\d.]+ ms \([\d.]+ tokens/s, 4 steps\)", out)


def test_bad_prompt_exits_with_a_message(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hello world", "--max-context-len", "64"])
    assert exc.value.code == 2
    assert "--prompt" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "pagedmla", "generate", "--prompt", "1 2 3", "--max-new-tokens", "2",
                           "--max-context-len", "64", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "generated ids:" in proc.stdout and "decode:" in proc.stdout
