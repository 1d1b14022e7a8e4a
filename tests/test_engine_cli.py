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


def test_attention_per_step_with_speculative_decoding(capsys):
    """Verify steps are their own kind: each kind's calls per step are one per layer."""
    rc = main(["generate", "--prompt", "5 6 7 5 6 7 5 6", "--prompt", "1 2 3 4 1 2 3 4", "--max-new-tokens", "20",
               "--ignore-eos", "--page-size", "16", "--max-context-len", "128", "--device", "cpu",
               "--num-speculative-tokens", "2", "--profile-attention"])
    out = capsys.readouterr().out
    assert rc == 0
    per_step = {kind: (int(calls), int(layers))
                for kind, calls, layers in re.findall(r"attention \((\w+)\): (\d+) calls/step \((\d+) layers\)", out)}
    assert {"extend", "target_verify"} <= set(per_step)
    assert all(calls == layers == 3 for calls, layers in per_step.values()), per_step


@pytest.mark.parametrize(("flags", "flag"), [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--cuda-graph", "on"], "--cuda-graph"),
    (["--max-context-len", "0"], "--max-context-len"),
    (["--top-p", "2"], "--top-p"),
])
def test_errors_name_the_flag(capsys, flags, flag):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "1 2 3", "--device", "cpu", *flags])
    assert exc.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err
