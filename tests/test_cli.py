"""The command line as a new user meets it: every bad input is one line naming the flag or file, exit status 2
(a traceback only with --debug); --version, info, streaming, the context-cap note, the CPU thread default,
and ``pagedmla bench`` on CPU (the torch provider and the Triton interpreter on tiny shapes, with a PNG)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_checkpoint import write_checkpoint

import pagedmla
from pagedmla import cli
from pagedmla.cli import main
from pagedmla.model.config import TINY_CONFIG, DeepseekConfig, tiny_config

BASE = ["generate", "--device", "cpu", "--page-size", "16", "--max-context-len", "64"]
IDS = ["--prompt-ids", "1 2 3"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Checkpoints: a good one with tokenizer.json, and broken ones of each kind."""
    root = tmp_path_factory.mktemp("cli")
    good = write_checkpoint(root / "good")
    out = {"good": good}
    for name in ("truncated", "header", "bad_config", "list_config", "no_config", "no_weights", "bad_tokenizer"):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text((good / "config.json").read_text())
        (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        out[name] = d
    data = (good / "model.safetensors").read_bytes()
    (out["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    (out["header"] / "model.safetensors").write_bytes(data[:6])
    (out["bad_config"] / "config.json").write_text('{"model_type": "deepseek_v3",')
    (out["list_config"] / "config.json").write_text(json.dumps([1, 2]))
    (out["no_config"] / "config.json").unlink()
    (out["no_weights"] / "model.safetensors").unlink()
    (out["bad_tokenizer"] / "tokenizer.json").write_text("{}")
    out["file"] = good / "config.json"
    return out


# (arguments after BASE, the start of the message after "error: "); {name} is a path from ``dirs``.
BAD_GENERATE = [
    (["--prompt", "hello world"], "--prompt: 'hello world' is text, and this model has no tokenizer"),
    ([], "--prompt: give at least one --prompt TEXT or --prompt-ids IDS"),
    (["--chat", "--prompt", "hi"], "--prompt: 'hi' is text"),
    (["--prompt-ids", "a b"], "--prompt-ids: 'a b' is not a list of token ids"),
    (["--prompt-ids", ""], "--prompt-ids: '' is not a list of token ids"),
    (["--prompt-ids", "1 99999"], "--prompt-ids: token ids must lie in 0..511"),
    (["--prompt-ids", "-1"], "--prompt-ids: token ids must lie in 0..511"),
    ([*IDS, "--device", "gpu"], "--device: 'gpu' is not a device name"),
    ([*IDS, "--device", "mps"], "--device: 'mps' is not supported"),
    ([*IDS, "--model", "/nonexistent/model"], "--model: '/nonexistent/model' is neither 'tiny' nor"),
    ([*IDS, "--model", "{file}"], "--model: '{file}' is neither 'tiny' nor"),
    # A checkpoint's own errors (CheckpointError) name the file or config field and are printed as they are.
    ([*IDS, "--model", "{no_config}"], "--model: no config.json at {no_config}/config.json"),
    ([*IDS, "--model", "{bad_config}"], "config: {bad_config}/config.json is not valid JSON"),
    ([*IDS, "--model", "{list_config}"], "config: expected a mapping"),
    ([*IDS, "--model", "{truncated}"], "--model: cannot read {truncated}/model.safetensors: "),
    ([*IDS, "--model", "{header}"], "--model: cannot read {header}/model.safetensors: "),
    ([*IDS, "--model", "{no_weights}"], "--model: no *.safetensors files in {no_weights}"),
    ([*IDS, "--model", "{bad_tokenizer}"], "--tokenizer: {bad_tokenizer}/tokenizer.json is not a readable"),
    ([*IDS, "--tokenizer", "/nonexistent/tok.json"], "--tokenizer: /nonexistent/tok.json is neither"),
    ([*IDS, "--tokenizer", "{no_config}"], "--tokenizer: {no_config} has no tokenizer files"),
    ([*IDS, "--stop", "x"], "--stop: stop strings need a tokenizer"),
    ([*IDS, "--model", "{good}", "--stop", ""], "--stop: expected a non-empty string"),
    ([*IDS, "--max-new-tokens", "abc"], "--max-new-tokens: invalid int value: 'abc'"),
    ([*IDS, "--max-new-tokens", "0"], "--max-new-tokens: expected an int >= 1"),
    ([*IDS, "--temperature", "-1"], "--temperature: expected a finite float >= 0"),
    ([*IDS, "--temperature", "warm"], "--temperature: invalid float value"),
    ([*IDS, "--top-p", "2"], "--top-p: expected a float in (0, 1]"),
    ([*IDS, "--top-k", "-1"], "--top-k: expected an int >= 0"),
    ([*IDS, "--seed", "x"], "--seed: invalid int value"),
    ([*IDS, "--page-size", "0"], "--page-size: expected a positive int"),
    ([*IDS, "--max-batch-size", "0"], "--max-batch-size: expected a positive int"),
    ([*IDS, "--max-context-len", "0"], "--max-context-len: expected a positive int"),
    ([*IDS, "--max-num-batched-tokens", "0"], "--max-num-batched-tokens: expected a positive int"),
    ([*IDS, "--num-speculative-tokens", "-1"], "--num-speculative-tokens: expected an int >= 0"),
    ([*IDS, "--threads", "0"], "--threads: expected a positive int"),
    ([*IDS, "--dtype", "int8"], "--dtype: unknown dtype 'int8'"),
    ([*IDS, "--provider", "foo"], "--provider: unknown provider 'foo'"),
    ([*IDS, "--cuda-graph", "sometimes"], "--cuda-graph: invalid choice: 'sometimes'"),
    ([*IDS, "--mixed-batching", "--num-speculative-tokens", "2"], "--mixed-batching: verify steps cannot"),
]
if not torch.cuda.is_available():
    BAD_GENERATE += [([*IDS, "--device", "cuda"], "--device: CUDA was asked for but is not available"),
                     ([*IDS, "--cuda-graph", "on"], "--cuda-graph: CUDA graphs need a CUDA device")]


def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == code, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err  # one line: no usage block, no traceback
    return err.rstrip("\n")


@pytest.mark.parametrize(("args", "message"), BAD_GENERATE, ids=[" ".join(a) or "no prompt" for a, _ in BAD_GENERATE])
def test_bad_generate_input_is_one_line(capsys, dirs, args, message):
    args = [a.format(**dirs) for a in args]
    line = _one_line_error(capsys, BASE + args)
    assert line.startswith(f"pagedmla generate: error: {message.format(**dirs)}"), line


BAD_OTHER = [
    (["frobnicate"], "pagedmla: error: command: invalid choice: 'frobnicate'"),
    ([], "pagedmla: error: the following arguments are required: command"),
    (["bench"], "pagedmla bench: error: the following arguments are required: bench"),
    # argparse reports flags no subcommand knows at the top level.
    (["generate", "--prompt-ids", "1", "--frobnicate"], "pagedmla: error: unrecognized arguments: --frobnicate"),
    (["bench", "decode", "--quick", "--frob"], "pagedmla: error: unrecognized arguments: --frob"),
    (["bench", "engine", "--prompt-len", "9:3", "--no-plot"], "pagedmla bench engine: error: --prompt-len: expected"),
    (["bench", "engine", "--num-requests", "0", "--no-plot"], "pagedmla bench engine: error: --num-requests: "),
    (["bench", "engine", "--dtype", "int4", "--no-plot"], "pagedmla bench engine: error: --dtype: unknown dtype"),
    (["bench", "engine", "--preset", "huge"], "pagedmla bench engine: error: --preset: invalid choice: 'huge'"),
    (["bench", "prefill", "--only", "all"], "pagedmla bench prefill: error: --only: invalid choice: 'all'"),
]
if not torch.cuda.is_available():
    BAD_OTHER += [(["bench", "engine", "--cuda-graph", "on", "--no-plot"],
                   "pagedmla bench engine: error: --cuda-graph: CUDA graphs need --device cuda")]


@pytest.mark.parametrize(("argv", "start"), BAD_OTHER, ids=[" ".join(a) or "nothing" for a, _ in BAD_OTHER])
def test_bad_command_lines_are_one_line(capsys, argv, start):
    assert _one_line_error(capsys, argv).startswith(start)


def test_bench_without_matplotlib_says_so_before_timing(capsys, monkeypatch):
    monkeypatch.setattr("pagedmla.bench.common.installed", lambda module: module != "matplotlib")
    for kind in ("decode", "prefill", "engine"):
        line = _one_line_error(capsys, ["bench", kind, "--quick"])
        assert line == (f"pagedmla bench {kind}: error: --plot: writing the PNG needs matplotlib: "
                        "pip install 'pagedmla[bench]' (or pass --no-plot)")


def test_debug_shows_the_traceback_and_internal_errors_say_so(capsys, monkeypatch):
    with pytest.raises(ValueError, match="^device: 'gpu'"):
        main(BASE + IDS + ["--device", "gpu", "--debug"])

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(cli, "LLM", broken)
    line = _one_line_error(capsys, BASE + IDS, code=1)
    assert line == ("pagedmla generate: error: RuntimeError: kernel exploded second line "
                    "(run with --debug for the traceback)")


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"pagedmla {pagedmla.__version__}\n"


def test_info_lists_providers_per_op(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "triton " in out
    for op in ("paged_decode", "paged_varlen", "varlen", "merge"):
        assert re.search(rf"^providers for {op}: torch, triton", out, re.M), out
    assert ("compute capability" in out) == torch.cuda.is_available()


def test_text_generation_streams_and_notes_the_cap(capsys, dirs):
    assert main(BASE + ["--model", str(dirs["good"]), "--prompt", "Hello world", "--max-new-tokens", "500"]) == 0
    captured = capsys.readouterr()
    text = re.search(r"^\[0\] text: '(.*)'$", captured.out, re.M)
    ids = re.search(r"^\[0\] prompt ids: ((?:\d+ ?)+)$", captured.out, re.M).group(1).split()
    generated = re.search(r"^\[0\] generated ids: ((?:\d+ ?)+) \((\w+)\)$", captured.out, re.M)
    assert text and len(ids) + len(generated.group(1).split()) == 64 and generated.group(2) == "length"
    # The streamed line comes first; the context cap is one note on stderr.
    assert captured.out.split("\n[0] prompt ids:")[0] != ""
    assert captured.err.splitlines() == [f"pagedmla generate: note: --max-new-tokens 500 is capped to {64 - len(ids)} "
                                         "by the context of 64 tokens (prompt included; --max-context-len)"]


def test_ids_and_text_prompts_mix_in_order(capsys, dirs):
    rc = main(BASE + ["--model", str(dirs["good"]), "--prompt-ids", "7 8 9", "--prompt", "Hello", "--max-new-tokens",
                      "3", "--stop", "zzzz-not-generated"])
    out = capsys.readouterr().out
    assert rc == 0 and "[0] prompt ids: 7 8 9\n" in out and "[1] prompt ids: " in out
    assert len(re.findall(r"^\[\d\] text: ", out, re.M)) == 2


def test_small_models_default_to_one_cpu_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = torch.device("cpu")
    tiny, big = tiny_config(), DeepseekConfig.from_dict({**TINY_CONFIG, "hidden_size": 2048})
    parser = cli._build_parser()
    cli._set_threads(parser.parse_args(BASE + IDS), tiny, cpu)  # tiny: 1
    cli._set_threads(parser.parse_args(BASE + IDS + ["--threads", "3"]), tiny, cpu)  # asked: 3
    cli._set_threads(parser.parse_args(BASE + IDS), big, cpu)  # large ops: torch's default stays
    cli._set_threads(parser.parse_args(BASE + IDS), tiny, torch.device("cuda"))  # not a CPU run
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cli._set_threads(parser.parse_args(BASE + IDS), tiny, cpu)  # the environment's choice stays
    assert calls == [1, 3]


@pytest.mark.parametrize("kind", ["decode", "prefill", "engine"])
def test_bench_runs_on_cpu_and_plots(capsys, tmp_path, kind):
    plot = tmp_path / f"{kind}.png"
    extra = {"decode": [], "prefill": ["--only", "paged", "--only", "ragged"], "engine": ["--no-hf"]}[kind]
    assert main(["bench", kind, "--quick", "--plot", str(plot), *extra]) == 0
    out = capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if kind == "decode":
        rows = re.findall(r"^\| 2 \| [12] \| 16 \| \d+ \| m\d+\S+ \| ([\d.]+) \| .* \| ([\d.]+) \| ([\d.]+) \| "
                          r"([\d.e+-]+) \|$", out, re.M)
        assert len(rows) == 2, out
        for pagedmla_us, torch_us, ratio, cos in rows:
            assert float(ratio) == pytest.approx(float(torch_us) / float(pagedmla_us), rel=0.02, abs=1e-3)
            assert float(cos) < 1e-6  # the interpreter's kernel agrees with the torch reference
        assert "wall-clock median" in out and "| torch/pagedmla |" in out
    elif kind == "prefill":
        assert re.search(r"^paged .* triton .* \| torch_reference [\d.]+ -> x[\d.]+$", out, re.M), out
        assert re.search(r"^ragged .* triton .* \| torch_sdpa [\d.]+ -> x[\d.]+$", out, re.M), out
        errors = re.findall(r"^  triton .* rel_err=(\S+)", out, re.M)  # the interpreter against the oracles
        assert len(errors) == 2 and all(float(e) < 1e-4 for e in errors), out
    else:
        assert re.search(r"^\| pagedmla torch \| [\d.]+ \|", out, re.M), out
